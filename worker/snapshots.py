"""Periodic snapshots of a rank's state, for the jobs no replica can recover.

A lost rank is rebuilt from a data-parallel replica when it has one. Where none holds its state
(DP=1), every rank rolls back to the newest snapshot all of them hold, and the job redoes the
steps since: with the data and the random streams keyed to the step, the run ends bit for bit
where an uninterrupted one does.

:class:`Snapshotter` takes one every ``every`` committed steps (``UNDERSTUDY_SNAPSHOT_EVERY``,
and at step 0) when the job asks for snapshots (that variable or ``UNDERSTUDY_SNAPSHOTS`` is
set). The state is copied on the training thread (the only synchronous part: a memory copy);
a background thread then keeps it in two tiers:

- **memory** (always): serialized once with ``torch.save`` and pushed to a holder in a standby
  worker's host memory on another node (``worker/holder.py``), which keeps the newest ``keep``
  per rank. No shared directory is needed.
- **storage** (only with ``UNDERSTUDY_SNAPSHOTS=DIR``, a directory every node sees): written
  with ``torch.distributed.checkpoint`` (one directory per step and rank, a ``COMPLETE`` marker
  last), the newest ``keep`` kept.

After each tier, the rank reports what it holds to the daemon under ``<job>/snapshots/<rank>``
(a :class:`~understudy.daemon.snapshot_tiers.SnapshotReport`: storage steps, and the memory
steps with their holder), for the controller to pick the rollback step and each rank's source:
memory when a live holder has the copy, storage otherwise (:func:`restore`). A snapshot still
being kept when the next one is due makes that one skipped, never a stall; a push that fails
or is slow costs the memory copy of that step, never training.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from understudy.daemon import env
from understudy.daemon.snapshot_tiers import MemoryCopies, SnapshotReport, parse_source
from understudy.worker.daemon_client import DaemonClient, DaemonError
from understudy.worker.holder import HolderAddress, HolderError, SnapshotHolder, node_address
from understudy.worker.holder_client import HolderDirectory, fetch, push_to_any
from understudy.worker.runtime import Runtime

COMPLETE = "COMPLETE"
SKELETON = "skeleton.pt"
#: The job's environment: the snapshot directory (every node must see it), the period, and
#: how many bytes a standby's holder may keep (default: half the machine's memory).
SNAPSHOTS = "UNDERSTUDY_SNAPSHOTS"
SNAPSHOT_EVERY = "UNDERSTUDY_SNAPSHOT_EVERY"
SNAPSHOT_HOLDER_BYTES = "UNDERSTUDY_SNAPSHOT_HOLDER_BYTES"
DEFAULT_EVERY = 50


class SnapshotError(RuntimeError):
    """A snapshot could not be restored; says which, from where, and why."""


def snapshots_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the job takes snapshots: it names a directory or a period."""
    return bool(environ.get(SNAPSHOTS) or environ.get(SNAPSHOT_EVERY))


def snapshot_dir(directory: Path, step: int, rank: int) -> Path:
    return directory / f"step-{step:09d}" / f"rank-{rank}"


def complete_steps(directory: Path, rank: int) -> list[int]:
    """The steps whose snapshot of ``rank`` is complete, oldest first."""
    steps = []
    for folder in directory.glob("step-*"):
        try:
            step = int(folder.name.removeprefix("step-"))
        except ValueError:
            continue
        if (folder / f"rank-{rank}" / COMPLETE).exists():
            steps.append(step)
    return sorted(steps)


def _map_tensors(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_map_tensors(v, fn) for v in state]
    if isinstance(state, tuple):
        return tuple(_map_tensors(v, fn) for v in state)
    return state


def copy_state(state: Any) -> Any:
    """A deep copy whose tensors share nothing with the live ones."""
    return _map_tensors(state, lambda t: t.detach().clone())


def load_snapshot(directory: Path, step: int, runtime: Runtime) -> None:
    """Put ``runtime`` (built) back to its rank's snapshot of ``step``.

    The state is loaded into the structure saved with it (``skeleton.pt``: every tensor's
    shape and dtype, every key as it was), not into the runtime's own: a fresh process has an
    optimizer without state yet, and the checkpoint's flat keys would not say that ``0`` was an
    int.

    Raises:
        FileNotFoundError: no complete snapshot of that step for this rank.
    """
    folder = snapshot_dir(directory, step, runtime.ctx.rank)
    if not (folder / COMPLETE).exists():
        raise FileNotFoundError(f"no complete snapshot of step {step} for rank "
                                f"{runtime.ctx.rank} under {directory}")
    skeleton = torch.load(folder / SKELETON, weights_only=True)
    template = _map_tensors(skeleton, lambda t: torch.empty(t.shape, dtype=t.dtype))
    dcp = _dcp()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    runtime.load_state(template)


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use: it pulls in DTensor and sympy,
    over a second of every worker's start (and of a cold joiner's), for the storage tier
    alone."""
    import torch.distributed.checkpoint as dcp

    return dcp


def serialize(state: Any) -> memoryview:
    """``state`` as one ``torch.save`` archive (what a holder keeps)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getbuffer()


def load_serialized(data: bytes | bytearray | memoryview, runtime: Runtime) -> None:
    """Put ``runtime`` back to a state :func:`serialize` made. Only tensors, containers and
    scalars are unpickled (``weights_only``).

    Raises:
        SnapshotError: the bytes are not such a state.
    """
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        raise SnapshotError(f"the bytes are not a saved state: {exc}") from exc
    if not isinstance(state, dict):
        raise SnapshotError(f"the saved state is a {type(state).__name__}, not a dict")
    try:
        runtime.load_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SnapshotError(f"the saved state does not fit this rank: {exc}") from exc


def restore(runtime: Runtime, step: int, source: str, *, directory: Path | None,
            holders: HolderDirectory | Callable[[str], HolderAddress] | None,
            local: SnapshotHolder | None = None, timeout: float = 60.0) -> str:
    """Put ``runtime`` back to its rank's snapshot of ``step``, from ``source`` (the plan's:
    ``storage`` or ``memory:<node>:<holder id>``; a memory copy that cannot be had is taken
    from storage if ``directory`` has it). ``local``: the holder this process runs, whose
    copies need no network. Returns where the copy came from, for the log.

    Raises:
        SnapshotError: that copy is not there (the holder was restarted, the step evicted, no
            directory here) or does not load.
    """
    rank = runtime.ctx.rank
    try:
        copies = parse_source(source)
    except ValueError as exc:
        raise SnapshotError(str(exc)) from exc
    if copies is None:
        if directory is None:
            raise SnapshotError(f"rank {rank}'s snapshot of step {step} is to come from "
                                f"storage, but {SNAPSHOTS} is not set here")
        try:
            load_snapshot(directory, step, runtime)
        except (OSError, ValueError, RuntimeError) as exc:
            raise SnapshotError(f"rank {rank}'s snapshot of step {step} did not load from "
                                f"{directory}: {exc}") from exc
        return "from storage"
    try:
        if local is not None and (local.node, local.id) == (copies.node, copies.holder):
            data = local.get(rank, step)
            where = "from this standby's own memory"
        else:
            if holders is None:
                raise HolderError("this worker cannot look holders up")
            lookup = holders.lookup if isinstance(holders, HolderDirectory) else holders
            holder = lookup(copies.node)
            if holder.id != copies.holder:
                raise HolderError(f"the holder on {copies.node} is now {holder.id}, not "
                                  f"{copies.holder}: it was restarted and its copies are gone")
            data = fetch(holder, rank, step, timeout=timeout)
            where = f"from memory on {copies.node}"
    except HolderError as exc:
        missing = (f"rank {rank}'s snapshot of step {step} is not to be had from memory: "
                   f"{exc}")
        # The same step in storage is the same state: take it rather than fail the rollback.
        if directory is not None and (snapshot_dir(directory, step, rank) / COMPLETE).exists():
            try:
                load_snapshot(directory, step, runtime)
            except (OSError, ValueError, RuntimeError) as again:
                raise SnapshotError(f"{missing}; nor from storage: {again}") from again
            return f"from storage: {missing}"
        raise SnapshotError(missing) from exc
    load_serialized(data, runtime)
    return where


class Snapshotter:
    """Takes this rank's snapshots (see the module docstring): to a holder's memory when
    ``holders`` is given (the job's :class:`HolderDirectory`, or a function listing holders
    to try), to ``directory`` when given. ``report`` is called on the background thread with
    what this rank holds, after each tier."""

    def __init__(self, directory: Path | None, *, rank: int, every: int,
                 report: Callable[[SnapshotReport], None], keep: int = 2,
                 holders: HolderDirectory | Callable[[], list[HolderAddress]] | None = None,
                 push_timeout: float = 60.0,
                 log_context: Mapping[str, Any] | None = None) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"every ({every}) and keep ({keep}) must be at least 1")
        if directory is None and holders is None:
            raise ValueError("a snapshotter needs a directory or holders to keep snapshots in")
        self.directory, self.rank, self.every, self.keep = directory, rank, every, keep
        self.report, self.holders, self.push_timeout = report, holders, push_timeout
        self.skipped = 0
        #: the steps this rank's snapshots hold in storage, and in a holder's memory
        self.storage: tuple[int, ...] = () if directory is None else \
            tuple(complete_steps(directory, rank)[-keep:])
        self.memory: MemoryCopies | None = None
        self._push_error: str | None = ""  # the last push's failure ("": none yet)
        self._busy = threading.Lock()
        self._thread: threading.Thread | None = None
        self._log = structlog.get_logger("understudy.worker").bind(**(log_context or {}), rank=rank)

    def after_commit(self, runtime: Runtime) -> None:
        """Called by the runtime after each committed step."""
        step = runtime.step
        if step % self.every:
            return
        if not self._busy.acquire(blocking=False):
            self.skipped += 1
            self._log.warning(f"Snapshot of step {step} skipped: the previous one is still "
                              "being kept.")
            return
        state = copy_state(runtime.state())
        self._thread = threading.Thread(target=self._keep, args=(step, state),
                                        name="snapshot-writer", daemon=True)
        self._thread.start()

    def _keep(self, step: int, state: dict[str, Any]) -> None:
        try:
            if self.holders is not None:
                self._push(step, state)
            if self.directory is not None:
                self._write(step, state)
        finally:
            self._busy.release()

    def _push(self, step: int, state: dict[str, Any]) -> None:
        assert self.holders is not None
        try:
            self.memory = push_to_any(self.holders, self.rank, step,
                                      lambda: serialize(state), timeout=self.push_timeout)
        except Exception as exc:  # a snapshot that fails must never fail training
            error = f"{type(exc).__name__}: {exc}"
            if error != self._push_error:
                self._log.warning(f"Snapshot of step {step} not kept in memory: {error}")
            self._push_error = error
            return
        if self._push_error is not None:
            self._log.info(f"Snapshots are kept in memory on {self.memory.node} "
                           f"(holder {self.memory.holder}), from step {step} on.")
            self._push_error = None
        self._report()

    def _write(self, step: int, state: dict[str, Any]) -> None:
        assert self.directory is not None
        try:
            folder = snapshot_dir(self.directory, step, self.rank)
            if folder.exists():
                shutil.rmtree(folder)
            dcp = _dcp()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
            torch.save(_map_tensors(state, lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                                 device="meta")),
                       folder / SKELETON)
            (folder / COMPLETE).write_text(json.dumps({"step": step, "rank": self.rank}))
            steps = complete_steps(self.directory, self.rank)
            for old in steps[:-self.keep]:
                shutil.rmtree(snapshot_dir(self.directory, old, self.rank), ignore_errors=True)
            self.storage = tuple(steps[-self.keep:])
        except Exception as exc:  # a snapshot that fails must never fail training
            self._log.error(f"Snapshot of step {step} failed: {type(exc).__name__}: {exc}")
            return
        self._report()

    def _report(self) -> None:
        try:
            self.report(SnapshotReport(self.storage, self.memory))
        except Exception as exc:  # the report is advice to the controller, never fatal
            self._log.warning(f"Could not report this rank's snapshots: {exc}")

    def close(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if isinstance(self.holders, HolderDirectory):
            self.holders.close()


def start_snapshotter(runtime: Runtime, job: str, epoch: Callable[[], int],
                      environ: Mapping[str, str] = os.environ) -> Snapshotter | None:
    """This rank's snapshotter as the job's environment asks (None: no snapshots), hooked to
    ``runtime``; the start is a snapshot too (step 0). ``epoch``: the rank's current epoch."""
    if not snapshots_enabled(environ):
        return None
    rank = runtime.ctx.rank
    directory = Path(environ[SNAPSHOTS]) if environ.get(SNAPSHOTS) else None
    every = int(environ.get(SNAPSHOT_EVERY) or DEFAULT_EVERY)
    snapshotter = Snapshotter(directory, rank=rank, every=every,
                              report=_reporter(job, rank, epoch),
                              holders=HolderDirectory(job, epoch),
                              log_context={"job": job, "node": environ.get(env.CHILD_NODE, "")})
    runtime.after_commit.append(snapshotter.after_commit)
    if runtime.step == 0:
        snapshotter.after_commit(runtime)
    return snapshotter


def _reporter(job: str, rank: int,
              epoch: Callable[[], int]) -> Callable[[SnapshotReport], None]:
    """Tells the controller (through the daemon) which snapshots this rank holds; runs on the
    snapshot writer's thread, on a connection of its own."""
    client: list[DaemonClient] = []

    def report(held: SnapshotReport) -> None:
        try:
            if not client:
                client.append(DaemonClient(f"{job}/snapshots", epoch=epoch(), timeout=10))
            client[0].set(str(rank), held.encode())
        except DaemonError:
            if client:
                client.pop().close()

    return report


def start_holder(job: str, node: str, epoch: int,
                 environ: Mapping[str, str] = os.environ) -> SnapshotHolder | None:
    """As a standby worker of a job that takes snapshots: run a holder for them in this
    process and advertise it under ``<job>/holders/<node>``. None (logged) if the job takes
    none, or the holder cannot start: its ranks then keep storage copies only."""
    if not snapshots_enabled(environ):
        return None
    log = structlog.get_logger("understudy.worker").bind(job=job, node=node)
    raw = environ.get(SNAPSHOT_HOLDER_BYTES)
    try:
        capacity = int(raw) if raw else None
        holder = SnapshotHolder(node, host=node_address(), capacity=capacity)
    except (OSError, ValueError) as exc:
        log.error(f"No snapshot holder on this standby: {type(exc).__name__}: {exc}")
        return None
    directory = HolderDirectory(job, lambda: epoch)
    try:
        directory.advertise(holder)
    except HolderError as exc:
        log.error(f"No snapshot holder on this standby: {exc}")
        holder.close()
        return None
    finally:
        directory.close()
    log.info(f"Snapshot holder {holder.id} serves at {holder.address} "
             f"({holder.capacity} bytes, the newest {holder.keep} steps per rank).")
    return holder
