"""Recording a rank's collectives during the first iterations of a job.

One rank per role type (:func:`~understudy.sandbox.manifest.recording_ranks`) records. The
launcher of such a rank taps the job's stable groups and wraps the runtime's boundary hook::

    recorder = Recorder(recording_dir, job=job, layout=Layout(world, tp), rank=rank,
                        iterations=2, code=CodeVersion.of(script))
    recorder.tap(JobGroups(...))             # every VersionedGroup of the rank
    runtime = Runtime(make_job(), JobContext(..., groups=JobGroups(...)))
    runtime.build()                          # collectives of build() are recorded too
    runtime.hook = recorder.hook(MigrationHook(...))
    runtime.run(steps)                       # recording stops by itself after 2 iterations
    recorder.close(timeout=30)               # at the end of the run: bounded join of the writer

:meth:`Recorder.tap` sets a tap (:meth:`~understudy.groups.versioned.VersionedGroup.tap`) on
each of the rank's :class:`~understudy.groups.versioned.VersionedGroup` objects, the ones the
job holds (Megatron's ``parallel_state`` keeps them for the whole run), so the job sees the
same objects whether or not it is recorded. For each collective the recorder notes the op, the
shapes and dtypes of its tensors, a digest of its inputs (taken before the call, since
in-place collectives overwrite them) and, once the work has completed, a copy of its outputs.
The boundary hook tells the recorder where each iteration starts; the calls of an attempt the
vote rejected are dropped, so the recording holds what committed steps issued. Once the
recorder stops (written, or abandoned), the taps are removed: no cost afterwards.

Communicators that are not stable groups (a plain ``ProcessGroup``) are recorded through
:meth:`Recorder.provider` instead: ``ctx.group(name)`` returns a :class:`RecordingGroup`
wrapper while recording, the real group afterwards, and a wrapper a job kept forwards without
recording. The recording
is written on a background thread (``sandbox-recording-writer``), data file first, manifest
last, each atomically (see :mod:`understudy.sandbox.manifest`). A failure to record never
fails training: the recorder logs it and gives up (:attr:`RecordState.ABANDONED`).
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from understudy.common import logs
from understudy.groups.versioned import Tap, VersionedGroup
from understudy.sandbox import ops
from understudy.sandbox.errors import RecordingError
from understudy.sandbox.manifest import (
    MANIFEST,
    CodeVersion,
    Layout,
    Manifest,
    RoleType,
    atomic_write,
    read_manifest,
    recording_ranks,
    role_directory,
    sha256_file,
)
from understudy.worker.api import Communicator, GroupsProvider
from understudy.worker.runtime import Action, BoundaryHook, NoMigration

#: The data file format (its ``format`` key); the manifest's is :data:`manifest.FORMAT`.
DATA_FORMAT = 1
BUILD = "build"


class RecordState(enum.Enum):
    """Lifecycle of a recording. Legal transitions (``Recorder._set`` only)::

        recording -> writing -> written
        recording | writing -> abandoned
    """

    RECORDING = "recording"
    WRITING = "writing"
    WRITTEN = "written"
    ABANDONED = "abandoned"


_TRANSITIONS = {
    RecordState.RECORDING: {RecordState.WRITING, RecordState.ABANDONED},
    RecordState.WRITING: {RecordState.WRITTEN, RecordState.ABANDONED},
    RecordState.WRITTEN: set(),
    RecordState.ABANDONED: set(),
}


def should_record(rank: int, layout: Layout) -> bool:
    """Whether ``rank`` is the one that records its role type."""
    return rank in recording_ranks(layout).values()


@dataclass
class _Entry:
    group: str
    segment: str
    call: ops.Call
    digest: str
    #: None until the work completed; [] for calls without outputs
    outputs: list[torch.Tensor] | None


class Recorder:
    """Records one rank's collectives for its first ``iterations`` committed steps (see the
    module docstring). ``background=False`` writes on the caller's thread instead (tests).

    Raises (at construction):
        ValueError: ``iterations`` below one, or ``rank`` outside ``layout``.
    """

    def __init__(self, directory: Path | str, *, job: str, layout: Layout, rank: int,
                 iterations: int, code: CodeVersion, background: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if iterations < 1:
            raise ValueError(f"iterations must be at least 1, got {iterations}")
        self.directory = Path(directory)
        self.job, self.layout, self.rank = job, layout, rank
        self.role_type = RoleType.of(rank, layout)
        self.iterations = iterations
        self.code = code
        self.state = RecordState.RECORDING
        #: why the recording was abandoned
        self.reason: str | None = None
        #: the manifest written, once :attr:`state` is ``written``
        self.manifest: Manifest | None = None
        self._background = background
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._segment = BUILD
        self._first_step: int | None = None
        self._committed = 0
        self._groups: dict[str, list[int]] = {}
        for name in layout.logical():
            ranks = layout.group_ranks(name, rank)
            self._groups[name] = [ranks.index(rank), len(ranks)]
        self._writer: threading.Thread | None = None
        self._tapped: list[VersionedGroup] = []
        self._log = logs.get("understudy.sandbox",
            job=job, rank=rank, role_type=self.role_type.key)

    @property
    def active(self) -> bool:
        """Whether collectives are still being recorded."""
        return self.state is RecordState.RECORDING

    def _set(self, to: RecordState) -> None:
        """The one place the state changes; the caller holds ``_lock``."""
        assert to in _TRANSITIONS[self.state], f"a {self.state.value} recording cannot " \
                                               f"become {to.value}"
        self.state = to
        if to is not RecordState.RECORDING:
            for group in self._tapped:
                group.tap(None)
            self._tapped.clear()

    # -- what the launcher wires --------------------------------------------------------------

    def provider(self, inner: GroupsProvider) -> RecordingGroups:
        """A groups provider that hands out recording wrappers of ``inner``'s groups while this
        recorder records, and ``inner``'s own groups afterwards."""
        return RecordingGroups(inner, self)

    def tap(self, groups: GroupsProvider) -> None:
        """Record the collectives of each of this rank's groups (``groups.current(name)`` for
        every logical group of the layout) in place, while this recorder records.

        Raises:
            TypeError: a group is not a stable :class:`VersionedGroup` (use :meth:`provider`).
            ValueError: as ``groups.current``.
        """
        found: dict[str, VersionedGroup] = {}
        for name in self.layout.logical():
            group = groups.current(name)
            if not isinstance(group, VersionedGroup):
                raise TypeError(f"group {name} is a {type(group).__name__}, not a stable "
                                "VersionedGroup: record it through Recorder.provider")
            found[name] = group
        with self._lock:
            if self.state is not RecordState.RECORDING:
                return
            for name, group in found.items():
                self._groups[name] = [group.rank(), group.size()]
                group.tap(self._tap_for(name))
                self._tapped.append(group)

    def _tap_for(self, name: str) -> Tap:
        def tap(op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                issue: Callable[..., Any]) -> Any:
            return self.issue(name, op, args, kwargs, issue)
        return tap

    def hook(self, inner: BoundaryHook | None = None) -> RecordingHook:
        """A boundary hook that marks iterations for this recorder, then defers to ``inner``."""
        return RecordingHook(inner or NoMigration(), self)

    def boundary(self, step: int) -> None:
        """``step`` is about to be attempted (the runtime's ``on_boundary``): the calls since
        the previous boundary belong to the step before, or, if ``step`` is attempted again,
        to a rejected attempt and are dropped. Once ``iterations`` steps are complete the
        recording stops and is written."""
        finished = False
        with self._lock:
            if self.state is not RecordState.RECORDING:
                return
            current = self._segment
            if current == BUILD:
                self._first_step, self._segment = step, str(step)
                return
            if step == int(current):
                self._entries = [e for e in self._entries if e.segment != current]
                return
            if step != int(current) + 1:
                reason = (f"the run jumped from step {current} to step {step} (a state was "
                          "loaded); the calls would not replay in order")
                self._abandon_locked(reason)
                return
            self._committed += 1
            self._segment = str(step)
            if self._committed >= self.iterations:
                self._set(RecordState.WRITING)
                finished = True
        if finished:
            self._start_writing()

    def close(self, timeout: float = 30.0) -> RecordState:
        """The run is over: write what was recorded if at least one iteration is complete,
        else give up; then wait up to ``timeout`` seconds for the writer. Returns the state
        (``writing`` if the writer is still busy)."""
        start = False
        with self._lock:
            if self.state is RecordState.RECORDING:
                if self._committed >= 1:
                    self._entries = [e for e in self._entries if e.segment != self._segment]
                    self._set(RecordState.WRITING)
                    start = True
                else:
                    self._abandon_locked("the run ended before one iteration was complete")
        if start:
            self._start_writing()
        return self.wait(timeout)

    def abandon(self, reason: str) -> None:
        """Stop recording and write nothing (a writer already running still finishes)."""
        with self._lock:
            if self.state is RecordState.RECORDING:
                self._abandon_locked(reason)

    def wait(self, timeout: float) -> RecordState:
        """Wait up to ``timeout`` seconds for the writer; return the state."""
        writer = self._writer
        if writer is not None:
            writer.join(timeout)
        return self.state

    # -- used by RecordingGroup --------------------------------------------------------------

    def issue(self, group: str, op: str, args: Sequence[Any], kwargs: dict[str, Any],
              method: Callable[..., Any]) -> Any:
        """Issue ``op`` through ``method(*args, **kwargs)`` (the real group's) and record it
        (if still recording). The result is the real work, or a work that completes once the
        outputs are copied."""
        if not self.active:
            return method(*args, **kwargs)
        try:
            call = ops.issued(op, args, kwargs)
            entry = _Entry(group, self._segment, call.call, ops.digest(call.inputs),
                           None if call.outputs else [])
        except (TypeError, ValueError, RuntimeError) as exc:  # a call this recorder cannot read
            self.abandon(f"{op} on group {group} could not be recorded: {exc}")
            return method(*args, **kwargs)
        with self._lock:
            if self.state is not RecordState.RECORDING:
                return method(*args, **kwargs)
            entry.segment = self._segment
            self._entries.append(entry)
        work = method(*args, **kwargs)
        if not call.outputs or work is None:
            return work
        outputs = call.outputs

        def capture() -> None:
            if entry.outputs is None:
                entry.outputs = [t.detach().clone() for t in outputs]

        try:
            future = work.get_future()
        except RuntimeError:  # gloo's send/recv works have no future on torch 2.13
            return _CapturingWork(work, capture)

        def then(done: torch.futures.Future[Any]) -> Any:
            value = done.value()  # re-raises the communicator's error into the chained future
            capture()
            return value

        # The caller waits on the chained future, so the copy is taken before it can touch
        # the outputs again (a plain done-callback may run after a waiter woke up).
        return ops.work_from_future(future.then(then))

    def note_group(self, name: str, rank: int, size: int) -> None:
        with self._lock:
            self._groups[name] = [rank, size]

    # -- writing -----------------------------------------------------------------------------

    def _abandon_locked(self, reason: str) -> None:
        self._set(RecordState.ABANDONED)
        self.reason = reason
        self._entries = []
        self._log.warning(f"Recording for the sandbox abandoned: {reason}.")

    def _start_writing(self) -> None:
        if self._background:
            self._writer = threading.Thread(target=self._write, name="sandbox-recording-writer",
                                            daemon=True)
            self._writer.start()
        else:
            self._write()

    def _write(self) -> None:
        try:
            manifest = self._write_files()
        except (OSError, RecordingError, RuntimeError) as exc:
            with self._lock:
                self._set(RecordState.ABANDONED)
                self.reason = f"writing the recording failed: {exc}"
                self._entries = []
            self._log.warning(f"Recording for the sandbox abandoned: {self.reason}.")
            return
        with self._lock:
            self.manifest = manifest
            self._set(RecordState.WRITTEN)
            self._entries = []
        self._log.info(f"Recorded {manifest.calls} collectives of {manifest.iterations} "
                       f"iterations for role type {manifest.role_type}.",
                       folder=str(role_directory(self.directory, self.role_type)))

    def _write_files(self) -> Manifest:
        with self._lock:
            entries = list(self._entries)
            groups = dict(self._groups)
            first_step = self._first_step if self._first_step is not None else 0
            iterations = self._committed
        missing = [e for e in entries if e.outputs is None]
        if missing:
            raise RecordingError(f"{len(missing)} recorded calls never completed (first: "
                                 f"{missing[0].call.op} on {missing[0].group}); a work was "
                                 "not waited on")
        counters: dict[str, int] = {}
        calls, segments = [], {BUILD: 0}
        for e in entries:
            index = counters.get(e.group, 0)
            counters[e.group] = index + 1
            segments[e.segment] = segments.get(e.segment, 0) + 1
            calls.append({"group": e.group, "index": index, "segment": e.segment,
                          "call": e.call.to_json(), "digest": e.digest,
                          "outputs": [t.to("cpu") for t in e.outputs or []]})
        folder = role_directory(self.directory, self.role_type)
        folder.mkdir(parents=True, exist_ok=True)
        data_path = folder / f"calls-{uuid.uuid4().hex[:16]}.pt"
        payload = {"format": DATA_FORMAT, "calls": calls}
        atomic_write(data_path, lambda f: torch.save(payload, f))
        sha, size = sha256_file(data_path)
        manifest = Manifest(
            job=self.job, layout=self.layout, role_type=self.role_type.key, rank=self.rank,
            groups=groups, first_step=first_step, iterations=iterations, calls=len(calls),
            segments=segments, code=self.code, data_file=data_path.name, data_sha256=sha,
            data_bytes=size, created_unix=time.time(),
            record_seconds=round(self._clock() - self._start, 6))
        atomic_write(folder / MANIFEST, lambda f: f.write(manifest.to_json().encode()))
        # Earlier recordings of this role type go, except what the manifest on disk names now
        # (another writer of the same role type may have renamed its manifest in meanwhile).
        keep = {data_path.name, read_manifest(folder).data_file}
        for old in folder.glob("calls-*.pt"):
            if old.name not in keep:
                old.unlink(missing_ok=True)
        return manifest


class _CapturingWork(dist.Work):
    """Wraps a work without a future (gloo's send/recv): ``wait()`` waits, then copies the
    outputs for the recording."""

    def __init__(self, inner: Any, capture: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._capture = capture

    def wait(self, timeout: Any = None) -> bool:
        done = bool(self._inner.wait() if timeout is None else self._inner.wait(timeout))
        self._capture()
        return done

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def get_future(self) -> torch.futures.Future[Any]:
        return self._inner.get_future()  # raises as the inner work does


class RecordingGroup(dist.ProcessGroup):
    """A group that records the collectives it forwards to ``inner`` while its recorder
    records, and only forwards afterwards. Same ``rank()`` and ``size()`` as ``inner``; if
    ``inner`` is registered with torch (``dist.recv`` and ``get_global_rank`` need that), so is
    the wrapper."""

    def __init__(self, name: str, inner: Communicator, recorder: Recorder) -> None:
        # The (rank, size) constructor is the pybind trampoline's; stubs list only the C++ one.
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self.logical_name = name
        self.inner = inner
        self.recorder = recorder
        ranks = _world.pg_group_ranks.get(inner)  # type: ignore[call-overload]
        if ranks is not None:
            _world.pg_group_ranks[self] = dict(ranks)

    def __repr__(self) -> str:
        return (f"RecordingGroup({self.logical_name}, rank {self.rank()} of {self.size()}, "
                f"{self.recorder.state.value})")

    @property
    def _device_types(self) -> list[torch.device]:
        return list(getattr(self.inner, "_device_types", []))

    def unregister(self) -> None:
        _world.pg_group_ranks.pop(self, None)


def _recording_method(op: str) -> Callable[..., Any]:
    def method(self: RecordingGroup, *args: Any, **kwargs: Any) -> Any:
        return self.recorder.issue(self.logical_name, op, args, kwargs,
                                   getattr(self.inner, op))

    method.__name__ = method.__qualname__ = op
    method.__doc__ = f"Forward ``{op}`` to the real group, recording it while recording."
    return method


for _op in sorted(ops.OPS):
    setattr(RecordingGroup, _op, _recording_method(_op))


class RecordingGroups:
    """The runtime's groups provider while a rank records (see :meth:`Recorder.provider`)."""

    def __init__(self, inner: GroupsProvider, recorder: Recorder) -> None:
        self.inner = inner
        self.recorder = recorder
        self._wrapped: dict[str, RecordingGroup] = {}

    def current(self, name: str) -> Communicator:
        """``inner``'s group ``name``, wrapped while recording.

        Raises:
            ValueError: as ``inner.current``.
        """
        group = self.inner.current(name)
        if not self.recorder.active:
            return group
        wrapper = self._wrapped.get(name)
        if wrapper is None or wrapper.inner is not group:
            wrapper = self._wrapped[name] = RecordingGroup(name, group, self.recorder)
            self.recorder.note_group(name, group.rank(), group.size())
        return wrapper


class RecordingHook:
    """A boundary hook that tells its recorder where iterations start, then defers everything
    to ``inner`` (see :meth:`Recorder.hook`)."""

    def __init__(self, inner: BoundaryHook, recorder: Recorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def on_boundary(self, step: int) -> Action:
        self.recorder.boundary(step)
        return self.inner.on_boundary(step)

    def switch_groups(self, step: int) -> None:
        self.inner.switch_groups(step)

    def hand_off(self, step: int, state: dict[str, Any]) -> bool:
        return self.inner.hand_off(step, state)

    def vote_flag(self, step: int) -> int:
        return self.inner.vote_flag(step)

    def send_ahead(self, step: int, state: dict[str, Any]) -> None:
        self.inner.send_ahead(step, state)  # type: ignore[attr-defined]

    def before_apply(self, step: int, job: Any, after: dict[str, Any]) -> bool:
        before_apply = getattr(self.inner, "before_apply", None)
        return bool(before_apply(step, job, after)) if before_apply is not None else False

    def on_vote(self, step: int, flag: int) -> None:
        self.inner.on_vote(step, flag)
