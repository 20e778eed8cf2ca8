"""What one collective call is, as recording and replay see it: which arguments are inputs and
which are outputs, the shapes and dtypes, the parameters that change the result, and a digest
of the inputs.

The table covers every ``ProcessGroup`` method that issues communication (the ``FORWARDED``
tuple of :mod:`understudy.groups.versioned`); a test holds the two together. Calls arrive the
way ``torch.distributed`` makes them on torch 2.13: positionally, tensors first, e.g.
``allreduce([t], opts)``, ``allgather([[o0, o1]], [i], opts)``, ``recv([t], src, tag)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from understudy.groups.works import completed_work, work_from_future

#: Above this many bytes, a tensor's digest covers a strided sample of it (see :func:`digest`).
FULL_DIGEST_BYTES = 1 << 20
#: Argument 0 is both input and output (the result overwrites it).
IN_PLACE = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "reduce"})
#: Argument 0 receives the outputs, argument 1 holds the inputs.
OUT_IN = frozenset({
    "allgather", "all_gather_single", "_allgather_base", "allgather_coalesced",
    "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "alltoall", "alltoall_base", "all_to_all_single",
})
#: Argument 0 receives the outputs; there are no inputs.
RECEIVE = frozenset({"recv", "recv_anysource"})
#: Argument 0 holds the inputs; nothing comes back.
SEND = frozenset({"send"})
#: No tensors at all.
NO_TENSORS = frozenset({"barrier", "_start_coalescing", "_end_coalescing"})
#: Every method recorded and replayed.
OPS = IN_PLACE | OUT_IN | RECEIVE | SEND | NO_TENSORS

# Keyword names of the tensor arguments in torch's bindings (calls through torch.distributed are
# positional; these cover a job that calls the group's methods with keywords).
_OUTPUT_NAMES = frozenset({"tensors", "tensor", "output_tensors", "output_tensor", "output",
                           "outputTensor", "outputs", "output_lists", "arg0"})
_INPUT_NAMES = frozenset({"input_tensors", "input_tensor", "input", "inputTensor", "inputs",
                          "input_list"})
# Attributes of the *Options objects that change what a collective computes. Timeouts and
# asyncOp do not, so a replay under other timeouts still matches.
_OPTION_FIELDS = ("reduceOp", "rootRank", "rootTensor")


@dataclass(frozen=True)
class Call:
    """One collective as recorded or issued: the op, the layout of its tensor arguments
    (``float32[32, 16]@cpu``, nested as the call nests them) and the parameters that change its
    result (reduction, root, peer, tag, split sizes)."""

    op: str
    specs: tuple[str, ...]
    params: tuple[tuple[str, Any], ...]

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.op}({', '.join(self.specs)}{'; ' + params if params else ''})"

    def difference(self, recorded: Call) -> str | None:
        """What differs from ``recorded``, in words, or None."""
        if self.op != recorded.op:
            return f"the op is {self.op}, the recording has {recorded.op}"
        if self.specs != recorded.specs:
            return (f"the tensors are {', '.join(self.specs)}, the recording has "
                    f"{', '.join(recorded.specs)}")
        if self.params != recorded.params:
            return f"the parameters are {dict(self.params)}, the recording has " \
                   f"{dict(recorded.params)}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "specs": list(self.specs), "params": [list(p) for p in
                                                                    self.params]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Call:
        return cls(str(raw["op"]), tuple(raw["specs"]),
                   tuple((str(k), _freeze(v)) for k, v in raw["params"]))


@dataclass
class Issued:
    """A call being issued: its description, the tensors it reads before it runs and the
    tensors its result lands in."""

    call: Call
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def issued(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Issued:
    """Describe ``group.<op>(*args, **kwargs)``.

    Raises:
        ValueError: ``op`` is not a method the sandbox knows (see :data:`OPS`).
    """
    if op not in OPS:
        raise ValueError(f"{op!r} is not a collective the sandbox records or replays")
    slots: dict[int, Any] = {}
    params: list[tuple[str, Any]] = []
    tensor_slots = 0 if op in NO_TENSORS else 2 if op in OUT_IN else 1
    for i, value in enumerate(args):
        if i < tensor_slots:
            slots[i] = value
        else:
            params.append((f"arg{i}", _param(value)))
    for name, value in sorted(kwargs.items()):
        if name in _OUTPUT_NAMES and tensor_slots >= 1:
            slots[0] = value
        elif name in _INPUT_NAMES and tensor_slots == 2:
            slots[1] = value
        else:
            params.append((name, _param(value)))
    first, second = _flatten(slots.get(0)), _flatten(slots.get(1))
    if op in IN_PLACE:
        inputs, outputs = first, first
    elif op in OUT_IN:
        inputs, outputs = second, first
    elif op in RECEIVE:
        inputs, outputs = [], first
    else:
        inputs, outputs = first, []
    specs = tuple(_spec(slots[i]) for i in sorted(slots))
    kept = tuple((k, v) for k, v in params if v is not None)
    return Issued(Call(op, specs, kept), inputs, outputs)


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """A 64-bit BLAKE2b digest of the tensors' dtypes, shapes and bytes, to tell whether a
    replay saw the recorded inputs. Exact up to :data:`FULL_DIGEST_BYTES` per tensor; a larger
    tensor contributes an evenly strided sample of about that size, so an 84 MiB gradient costs
    ~4 ms instead of ~0.15 s for a full hash here, and only the sample leaves
    a GPU. Different data (another replica's batch, another state) changes nearly every element
    of a gradient or an activation, so the sample still tells them apart."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        flat = t.detach().reshape(-1)
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        budget = max(1, FULL_DIGEST_BYTES // max(1, flat.element_size()))
        if flat.numel() > budget:
            flat = flat[::-(-flat.numel() // budget)]
        flat = flat.to("cpu").contiguous()
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().data)
    return h.hexdigest()


def _flatten(value: Any) -> list[torch.Tensor]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _flatten(v)]
    raise TypeError(f"expected tensors, got {type(value).__name__}")


def _spec(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{value.device.type}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_spec(v) for v in value) + "]"
    return type(value).__name__


def _param(value: Any) -> Any:
    """A JSON-able form of a non-tensor argument, or None for what does not change the result
    (timeouts)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, timedelta):
        return None
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, dist.ReduceOp.RedOpType):  # first: it passes for a ReduceOp too
        return str(value).removeprefix("RedOpType.")
    if isinstance(value, dist.ReduceOp):
        return _param(value.op)  # type: ignore[attr-defined]  # the stubs lack ReduceOp.op
    if isinstance(value, list | tuple):
        return tuple(_param(v) for v in value)
    kind = type(value).__name__
    if kind.endswith("Options"):
        fields = [f"{name}={_param(getattr(value, name))}" for name in _OPTION_FIELDS
                  if hasattr(value, name)]
        return f"{kind}({', '.join(fields)})"
    return kind


def _freeze(value: Any) -> Any:
    """JSON lists back to the tuples :func:`_param` makes, so that calls compare equal."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


__all__ = ["Call", "Issued", "completed_work", "digest", "issued", "work_from_future"]
