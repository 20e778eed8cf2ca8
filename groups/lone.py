"""A process group of one member, answered in this process: no backend, no store, no socket.

Megatron asks for groups of every parallel dimension; those of size one (pipeline, context,
expert parallelism in a TP x DP job) have no peer, so nothing about them can move or fail. A
gloo group would still open a TCP device (and need a network interface: a standby's sandbox
may have none); :class:`LoneGroup` answers each collective the way a one-member group must:
reductions and broadcasts leave the tensors as they are, gathers and scatters copy the input
to the output. Point-to-point calls have no peer and raise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from understudy.groups.works import completed_work


class LoneGroup(dist.ProcessGroup):
    """Rank 0 of a group of one, registered with ``torch.distributed`` under ``global_rank``."""

    def __init__(self, global_rank: int) -> None:
        # The (rank, size) constructor is the pybind trampoline's; stubs list only the C++ one.
        super().__init__(0, 1)  # type: ignore[call-arg]
        _world.pg_group_ranks[self] = {global_rank: 0}

    def __repr__(self) -> str:
        return f"LoneGroup(rank {next(iter(_world.pg_group_ranks.get(self, {0: 0})))})"

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

    def unregister(self) -> None:
        _world.pg_group_ranks.pop(self, None)


# The methods are set after the class is made, as for the stable group: the bindings' own
# signatures differ per method, and these accept what torch.distributed passes to each.
def _unchanged(self: LoneGroup, tensors: list[torch.Tensor], *_: Any, **__: Any) -> dist.Work:
    """In place, the one member's contribution is the result."""
    return completed_work(list(tensors))


def _nothing(self: LoneGroup, *_: Any, **__: Any) -> dist.Work:
    return completed_work([])


def _gather_lists(self: LoneGroup, outputs: list[list[torch.Tensor]],
                  inputs: list[torch.Tensor], *_: Any, **__: Any) -> dist.Work:
    for out, inp in zip(outputs, inputs, strict=True):
        out[0].copy_(inp)
    return completed_work([o[0] for o in outputs])


def _copy(self: LoneGroup, output: torch.Tensor, input: torch.Tensor, *_: Any,
          **__: Any) -> dist.Work:
    """Gathers, scatters and all-to-alls of one member: the output is the input."""
    output.copy_(input.view_as(output))
    return completed_work([output])


def _no_peer(self: LoneGroup, *_: Any, **__: Any) -> dist.Work:
    raise RuntimeError("a group of one has no peer to send to or receive from")


_METHODS = {
    "allreduce": _unchanged, "broadcast": _unchanged, "reduce": _unchanged,
    "barrier": _nothing, "allgather": _gather_lists,
    "all_gather_single": _copy, "_allgather_base": _copy, "reduce_scatter_single": _copy,
    "_reduce_scatter_base": _copy, "all_to_all_single": _copy, "alltoall_base": _copy,
    "send": _no_peer, "recv": _no_peer, "recv_anysource": _no_peer,
}
for _name, _method in _METHODS.items():
    setattr(LoneGroup, _name, _method)
