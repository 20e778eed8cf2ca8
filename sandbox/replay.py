"""Replaying a recording: groups that answer collectives without communicating.

A :class:`ReplayGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` with the
recorded group's ``rank()`` and ``size()``. It answers each collective from the recording, in
the order the group saw them: it checks that the call is the recorded one (op, tensor shapes
and dtypes, reduction, root, peer, tag), copies the recorded outputs into the caller's output
tensors, and returns a work that is already complete. ``barrier`` and ``send`` have nothing to
copy and complete at once. No socket, store or communicator is ever created.

A call that does not match, or one past the end of the recording, raises
:class:`~understudy.sandbox.errors.ReplayDiverged`, and every group of the same
:class:`ReplayGroups` refuses all later calls with it: after a divergence nothing the shadow
iteration computes is meaningful. Inputs that differ from the recorded ones (another DP
replica's data, another state) are counted, not refused, unless ``strict_inputs`` is set: the
outputs are still the recorded ones, so the shadow iteration exercises the same code paths.
"""

from __future__ import annotations

import hashlib
import io
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from understudy.sandbox import ops
from understudy.sandbox.errors import RecordingError, ReplayDiverged
from understudy.sandbox.manifest import (
    Expectation,
    Manifest,
    RoleType,
    read_manifest,
    role_directory,
)
from understudy.sandbox.recording import DATA_FORMAT


@dataclass(frozen=True)
class RecordedCall:
    """One call of the recording: its group, its place in that group's sequence, the segment
    (``build`` or the step) it belongs to, what was issued and what came back."""

    group: str
    index: int
    segment: str
    call: ops.Call
    digest: str
    outputs: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Recording:
    """A recording loaded from disk (see :meth:`load`)."""

    manifest: Manifest
    folder: Path
    #: calls of each group, in the group's order
    calls: dict[str, tuple[RecordedCall, ...]]

    @classmethod
    def load(cls, recording_dir: Path | str, role_type: RoleType | str,
             expect: Expectation | None = None) -> Recording:
        """Read the recording of ``role_type`` under ``recording_dir``, checking the manifest
        against ``expect`` first (if given) and the data file against the manifest's digest.

        Raises:
            RecordingMismatch: the manifest does not fit ``expect`` (nothing else is read).
            RecordingError: there is no recording, or it is malformed, torn or replaced.
        """
        folder = role_directory(recording_dir, role_type)
        manifest = read_manifest(folder)
        if expect is not None:
            manifest.check(expect)
        path = folder / manifest.data_file
        if Path(manifest.data_file).name != manifest.data_file:
            raise RecordingError(f"{folder} names a data file outside its folder: "
                                 f"{manifest.data_file!r}")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise RecordingError(f"{path} is gone: the recording was replaced while it was "
                                 "being read; read it again") from None
        except OSError as exc:
            raise RecordingError(f"cannot read {path}: {exc}") from exc
        sha = hashlib.sha256(data).hexdigest()
        if sha != manifest.data_sha256 or len(data) != manifest.data_bytes:
            raise RecordingError(f"{path} does not match its manifest (sha256 {sha[:12]}, "
                                 f"{len(data)} bytes; the manifest says "
                                 f"{manifest.data_sha256[:12]}, {manifest.data_bytes} bytes)")
        try:
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            if payload.get("format") != DATA_FORMAT:
                raise RecordingError(f"{path} has data format {payload.get('format')!r}; this "
                                     f"understudy reads format {DATA_FORMAT} only")
            calls: dict[str, list[RecordedCall]] = {name: [] for name in manifest.groups}
            for raw in payload["calls"]:
                rec = RecordedCall(str(raw["group"]), int(raw["index"]), str(raw["segment"]),
                                   ops.Call.from_json(raw["call"]), str(raw["digest"]),
                                   tuple(raw["outputs"]))
                seq = calls.setdefault(rec.group, [])
                if rec.index != len(seq):
                    raise RecordingError(f"{path}: call {rec.index} of group {rec.group} is "
                                         f"out of order (expected {len(seq)})")
                seq.append(rec)
        except RecordingError:
            raise
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RecordingError(f"{path} is not a valid recording: {type(exc).__name__}: "
                                 f"{exc}") from exc
        return cls(manifest, folder, {name: tuple(seq) for name, seq in calls.items()})


class _Sequence:
    """What the groups of one replay share: the first divergence, and counters."""

    def __init__(self, check_inputs: bool, strict_inputs: bool) -> None:
        self.check_inputs = check_inputs
        self.strict_inputs = strict_inputs
        self.lock = threading.Lock()
        self.diverged: ReplayDiverged | None = None
        self.answered = 0
        self.inputs_differed = 0


class ReplayGroup(dist.ProcessGroup):
    """One group of a replay (see the module docstring)."""

    def __init__(self, name: str, rank: int, size: int, calls: Sequence[RecordedCall],
                 shared: _Sequence) -> None:
        # The (rank, size) constructor is the pybind trampoline's; stubs list only the C++ one.
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.logical_name = name
        self.calls = tuple(calls)
        #: the index of the next call to answer
        self.position = 0
        self._shared = shared

    def __repr__(self) -> str:
        return (f"ReplayGroup({self.logical_name}, rank {self.rank()} of {self.size()}, "
                f"{self.position}/{len(self.calls)} calls answered)")

    @property
    def _device_types(self) -> list[torch.device]:
        """The device types the recorded tensors were on (torch picks a collective's device
        for objects and barriers from these); CPU if none was recorded."""
        kinds = {kind for c in self.calls for spec in c.call.specs
                 for kind in re.findall(r"@(\w+)", spec)}
        return [torch.device(k) for k in sorted(kinds)] or [torch.device("cpu")]

    def register(self, global_ranks: Sequence[int]) -> None:
        """Tell ``torch.distributed`` the job-wide ranks the group spans, as
        ``VersionedGroup.register`` does (``dist.recv`` and ``get_global_rank`` need it)."""
        _world.pg_group_ranks[self] = {g: i for i, g in enumerate(global_ranks)}

    def unregister(self) -> None:
        _world.pg_group_ranks.pop(self, None)

    def answer(self, op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Answer ``<op>(*args, **kwargs)`` from the recording.

        Raises:
            ReplayDiverged: the call is not the recorded one, the recording ran out, or an
                earlier call of this replay diverged.
        """
        issued = ops.issued(op, args, kwargs)
        shared = self._shared
        with shared.lock:
            if shared.diverged is not None:
                raise ReplayDiverged(f"the replay diverged earlier ({shared.diverged}); "
                                     f"{op} on group {self.logical_name} cannot be answered",
                                     group=self.logical_name, call=self.position)
            i = self.position
            if i >= len(self.calls):
                self._diverge(i, f"the job issued {issued.call.describe()} but the recording "
                                 f"has only {len(self.calls)} calls on this group (it ran out)")
            rec = self.calls[i]
            diff = issued.call.difference(rec.call)
            if diff is not None:
                self._diverge(i, f"(recorded in segment {rec.segment}) {diff}")
            if shared.check_inputs and ops.digest(issued.inputs) != rec.digest:
                if shared.strict_inputs:
                    self._diverge(i, f"(recorded in segment {rec.segment}) the inputs of "
                                     f"{rec.call.op} differ from the recorded ones")
                shared.inputs_differed += 1
            with torch.no_grad():
                for out, value in zip(issued.outputs, rec.outputs, strict=True):
                    out.copy_(value)
            self.position = i + 1
            shared.answered += 1
        if op == "_start_coalescing":
            return None  # the C++ method returns no work
        return ops.completed_work(issued.outputs)

    def _diverge(self, index: int, what: str) -> None:
        error = ReplayDiverged(f"call {index} on group {self.logical_name!r}: {what}",
                               group=self.logical_name, call=index)
        self._shared.diverged = error
        raise error


def _replay_method(op: str) -> Callable[..., Any]:
    def method(self: ReplayGroup, *args: Any, **kwargs: Any) -> Any:
        return self.answer(op, args, kwargs)

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"Answer ``{op}`` from the recording."
    return method


for _op in sorted(ops.OPS):
    setattr(ReplayGroup, _op, _replay_method(_op))


class ReplayGroups:
    """A groups provider made of one :class:`ReplayGroup` per recorded group (``tp``, ``dp``,
    ``world``...), sharing one divergence state. ``check_inputs=False`` skips the input
    digests (no hashing); ``strict_inputs=True`` makes differing inputs a divergence.

    With a pipeline-free layout the groups are registered with ``torch.distributed`` under
    the recorded rank's job-wide ranks; :meth:`close` unregisters them.
    """

    def __init__(self, recording: Recording, *, check_inputs: bool = True,
                 strict_inputs: bool = False) -> None:
        self.recording = recording
        self._shared = _Sequence(check_inputs, strict_inputs)
        m = recording.manifest
        self.groups: dict[str, ReplayGroup] = {}
        for name, (rank, size) in m.groups.items():
            self.groups[name] = ReplayGroup(name, rank, size, recording.calls.get(name, ()),
                                            self._shared)
            if name in m.layout.logical():
                self.groups[name].register(m.layout.group_ranks(name, m.rank))

    def current(self, name: str) -> ReplayGroup:
        """Raises: ValueError: the recording has no group ``name``."""
        try:
            return self.groups[name]
        except KeyError:
            raise ValueError(f"unknown group {name!r}: the recording has "
                             f"{', '.join(sorted(self.groups))}") from None

    @property
    def diverged(self) -> ReplayDiverged | None:
        """The first divergence, if any."""
        return self._shared.diverged

    @property
    def answered(self) -> int:
        return self._shared.answered

    @property
    def inputs_differed(self) -> int:
        """Calls whose inputs were not the recorded ones (their outputs still were)."""
        return self._shared.inputs_differed

    def remaining(self) -> int:
        """Recorded calls not answered yet, over all groups."""
        return sum(len(g.calls) - g.position for g in self.groups.values())

    def answered_through(self, segment: str) -> bool:
        """Whether every recorded call of ``segment`` (``build`` or a step) was answered."""
        return all(c.index < g.position for g in self.groups.values() for c in g.calls
                   if c.segment == segment)

    def close(self) -> None:
        for group in self.groups.values():
            group.unregister()
