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
  with ``torch.distributed.checkpoint`` (one directory per step, rank and epoch, a ``COMPLETE``
  marker last), the newest ``keep`` kept.

After each tier, the rank reports what it holds to the daemon under ``<job>/snapshots/<rank>``
(a :class:`~understudy.common.snapshot_tiers.SnapshotReport`: storage steps, and the memory
steps with their holder), for the controller to pick the rollback step and each rank's source:
memory when a live holder has the copy, storage otherwise (:func:`restore`). A snapshot still
being kept when the next one is due makes that one skipped, never a stall; a push that fails
or is slow costs the memory copy of that step, never training.

**Fencing by epoch.** A rank replaced by the controller (its lease expired while its node was
cut off from etcd only) may run on for a while under its old epoch; it cannot commit a step of
the live job, but its snapshot thread may still write. Its writes may happen; nothing a live
rank reads comes from them:

- a storage copy is written in a folder of its own (``step-<S>/rank-<r>.tmp-<epoch>-<pid>``),
  synced, then renamed to ``step-<S>/rank-<r>.e<epoch>`` in one step; a visible folder is never
  rewritten or replaced, and its ``COMPLETE`` marker says the step, rank and epoch;
- every copy is tagged with the epoch its writer held when the step was copied, every report
  with the epoch the rank holds when it sends it, and a rollback plan names each copy's epoch,
  so a reader loads exactly the copy a counted report named and checks the marker;
- reports go through the daemon, which refuses them once the job's assignment moved past the
  rank's epoch (``daemon/localsock.py``), and a rank prunes its older copies only after a report
  was taken, and only copies this process wrote: a replaced rank deletes nothing;
- a holder refuses a push from an epoch older than the rank's copies it keeps
  (``worker/holder.py``).

A rank reports only the copies this process wrote. When its epoch moves (a recovery or
migration it survived), it reports them again under the new one.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from understudy.common import env, logs
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.env import SNAPSHOT_EVERY, SNAPSHOT_HOLDER_BYTES, SNAPSHOTS
from understudy.common.snapshot_tiers import MemoryCopies, SnapshotReport, source_of
from understudy.worker.holder import HolderAddress, HolderError, SnapshotHolder, node_address
from understudy.worker.holder_client import HolderDirectory, fetch, push_to_any
from understudy.worker.runtime import Runtime

COMPLETE = "COMPLETE"
SKELETON = "skeleton.pt"
DEFAULT_EVERY = 50
#: a visible copy's folder under ``step-<S>/``: ``rank-<r>.e<epoch>`` (``rank-<r>``: older workers)
_FOLDER_RE = re.compile(r"^rank-(?P<rank>[0-9]+)(?:\.e(?P<epoch>[0-9]+))?$")


class SnapshotError(RuntimeError):
    """A snapshot could not be restored; says which, from where, and why."""


def snapshots_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the job takes snapshots: it names a directory or a period."""
    return bool(environ.get(SNAPSHOTS) or environ.get(SNAPSHOT_EVERY))


def snapshot_dir(directory: Path, step: int, rank: int, epoch: int | None = None) -> Path:
    """The visible folder of ``rank``'s copy of ``step`` written under ``epoch``:
    ``step-<S>/rank-<r>.e<epoch>``. None: the layout of workers older than epochs,
    ``step-<S>/rank-<r>`` (read, never written)."""
    name = f"rank-{rank}" if epoch is None else f"rank-{rank}.e{epoch}"
    return directory / f"step-{step:09d}" / name


def _temp_dir(directory: Path, step: int, rank: int, epoch: int) -> Path:
    """Where this process writes a copy before it makes it visible: no other process (a rank
    of another epoch, or another process of the same epoch) writes there."""
    return directory / f"step-{step:09d}" / f"rank-{rank}.tmp-{epoch}-{os.getpid()}"


def complete_copies(directory: Path, rank: int) -> list[tuple[int, int | None]]:
    """(step, the writer's epoch; None for the old layout) of every visible copy of ``rank``
    with a ``COMPLETE`` marker, by step. Which of them a rollback may use is the reports' to
    say, not the directory's."""
    copies = []
    for folder in directory.glob("step-*"):
        try:
            step = int(folder.name.removeprefix("step-"))
        except ValueError:
            continue
        for sub in folder.glob(f"rank-{rank}*"):
            m = _FOLDER_RE.match(sub.name)
            if m is not None and int(m["rank"]) == rank and (sub / COMPLETE).exists():
                copies.append((step, None if m["epoch"] is None else int(m["epoch"])))
    return sorted(copies, key=lambda c: (c[0], -1 if c[1] is None else c[1]))


def complete_steps(directory: Path, rank: int) -> list[int]:
    """The steps of which ``rank`` has a complete copy (any epoch), oldest first."""
    return sorted({step for step, _ in complete_copies(directory, rank)})


def check_marker(folder: Path, step: int, rank: int, epoch: int | None) -> None:
    """Check that ``folder`` holds a complete copy of ``step`` of ``rank`` written under
    ``epoch`` (None: the old layout, whose marker names no epoch).

    Raises:
        FileNotFoundError: no ``COMPLETE`` marker (not there, or not finished).
        SnapshotError: the marker names another copy, or is unreadable.
    """
    try:
        text = (folder / COMPLETE).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"no complete snapshot of step {step} for rank {rank} under "
                                f"{folder.parent.parent}") from None
    try:
        marker = json.loads(text)
    except ValueError:
        raise SnapshotError(f"the {COMPLETE} marker in {folder} is not JSON") from None
    if not isinstance(marker, dict):
        raise SnapshotError(f"the {COMPLETE} marker in {folder} is not a JSON object")
    said = (marker.get("step"), marker.get("rank"))
    if said != (step, rank):
        raise SnapshotError(f"{folder} holds step {said[0]} of rank {said[1]}, not step {step} "
                            f"of rank {rank}")
    if epoch is not None and marker.get("epoch") != epoch:
        raise SnapshotError(f"{folder} was written under epoch {marker.get('epoch')}, not "
                            f"epoch {epoch}")


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


def load_snapshot(directory: Path, step: int, runtime: Runtime,
                  epoch: int | None = None) -> None:
    """Put ``runtime`` (built) back to its rank's snapshot of ``step`` written under ``epoch``
    (None: the old layout), after checking the folder's ``COMPLETE`` marker.

    The state is loaded into the structure saved with it (``skeleton.pt``: every tensor's
    shape and dtype, every key as it was), not into the runtime's own: a fresh process has an
    optimizer without state yet, and the checkpoint's flat keys would not say that ``0`` was an
    int.

    Raises:
        FileNotFoundError: no complete snapshot of that step for this rank, of that epoch.
        SnapshotError: the marker names another step, rank or epoch.
    """
    folder = snapshot_dir(directory, step, runtime.ctx.rank, epoch)
    check_marker(folder, step, runtime.ctx.rank, epoch)
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


def load_serialized(data: bytes | bytearray | memoryview | mmap.mmap,
                    runtime: Runtime) -> None:
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
            local: SnapshotHolder | None = None, timeout: float = 60.0,
            epoch: int | None = None) -> str:
    """Put ``runtime`` back to its rank's snapshot of ``step``, from ``source`` (the plan's:
    ``storage`` or ``memory:<node>:<holder id>``, with ``@<epoch>`` the epoch the copy was
    written under: exactly that copy is loaded; a memory copy that cannot be had is taken from
    the same writer's storage copy if ``directory`` has it). ``local``: the holder this process
    runs, whose copies need no network. ``epoch``: the epoch the rollback was planned at; a copy
    the plan says was written under a newer one is refused (no counted report names one).
    Returns where the copy came from, for the log.

    Raises:
        SnapshotError: that copy is not there (the holder was restarted, the step evicted, no
            directory here), is not the one named (marker or holder of another epoch), or does
            not load.
    """
    rank = runtime.ctx.rank
    try:
        named = source_of(source)
    except ValueError as exc:
        raise SnapshotError(str(exc)) from exc
    copies, written = named.memory, named.epoch
    if written is not None and epoch is not None and written > epoch:
        raise SnapshotError(f"rank {rank}'s snapshot of step {step} is named as written under "
                            f"epoch {written}, after epoch {epoch} of the rollback's plan")
    if copies is None:
        if directory is None:
            raise SnapshotError(f"rank {rank}'s snapshot of step {step} is to come from "
                                f"storage, but {SNAPSHOTS} is not set here")
        try:
            load_snapshot(directory, step, runtime, written)
        except (OSError, ValueError, RuntimeError) as exc:
            raise SnapshotError(f"rank {rank}'s snapshot of step {step} did not load from "
                                f"{directory}: {exc}") from exc
        return "from storage"
    try:
        data: bytes | bytearray | mmap.mmap
        if local is not None and (local.node, local.id) == (copies.node, copies.holder):
            data = local.get(rank, step, written)
            where = "from this standby's own memory"
        else:
            if holders is None:
                raise HolderError("this worker cannot look holders up")
            lookup = holders.lookup if isinstance(holders, HolderDirectory) else holders
            holder = lookup(copies.node)
            if holder.id != copies.holder:
                raise HolderError(f"the holder on {copies.node} is now {holder.id}, not "
                                  f"{copies.holder}: it was restarted and its copies are gone")
            data = fetch(holder, rank, step, epoch=written, timeout=timeout)
            where = f"from memory on {copies.node}"
    except HolderError as exc:
        missing = (f"rank {rank}'s snapshot of step {step} is not to be had from memory: "
                   f"{exc}")
        # The same step written by the same writer (same epoch) in storage is the same state:
        # take it rather than fail the rollback.
        if directory is not None and \
                (snapshot_dir(directory, step, rank, written) / COMPLETE).exists():
            try:
                load_snapshot(directory, step, runtime, written)
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
    what this rank holds, after each tier; it raises if the report was not taken (then nothing
    is pruned). ``epoch``: the rank's current epoch (default: 0)."""

    def __init__(self, directory: Path | None, *, rank: int, every: int,
                 report: Callable[[SnapshotReport], None], keep: int = 2,
                 holders: HolderDirectory | Callable[[], list[HolderAddress]] | None = None,
                 push_timeout: float = 60.0,
                 log_context: Mapping[str, Any] | None = None,
                 epoch: Callable[[], int] | None = None) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"every ({every}) and keep ({keep}) must be at least 1")
        if directory is None and holders is None:
            raise ValueError("a snapshotter needs a directory or holders to keep snapshots in")
        self.directory, self.rank, self.every, self.keep = directory, rank, every, keep
        self.report, self.holders, self.push_timeout = report, holders, push_timeout
        self.epoch: Callable[[], int] = epoch or (lambda: 0)
        self.skipped = 0
        #: the steps this process's copies hold in storage (the newest ``keep``), and in a
        #: holder's memory: only copies this process wrote (a directory may hold copies of
        #: other processes of this rank: a predecessor's, or a replaced one's)
        self.storage: tuple[int, ...] = ()
        self.memory: MemoryCopies | None = None
        #: step -> epoch of every visible storage copy this process made and has not pruned
        self._written: dict[int, int] = {}
        #: (holder id, step) -> the epoch of this process's push of it
        self._pushed: dict[tuple[str, int], int] = {}
        self._reported_epoch: int | None = None  # the epoch of the last report attempted
        self._push_error: str | None = ""  # the last push's failure ("": none yet)
        self._report_error: str | None = None  # the last report's failure
        self._busy = threading.Lock()
        self._thread: threading.Thread | None = None
        self._log = logs.get("understudy.worker", **(log_context or {}), rank=rank)

    def after_commit(self, runtime: Runtime) -> None:
        """Called by the runtime after each committed step."""
        step, epoch = runtime.step, self.epoch()
        if step % self.every:
            if self._reported_epoch is not None and epoch != self._reported_epoch and \
                    self._busy.acquire(blocking=False):
                # The rank's epoch moved (it survived a recovery or a migration): the same
                # copies, reported under the new epoch (a busy writer's report will be).
                self._start(self._report_again, ())
            return
        if not self._busy.acquire(blocking=False):
            self.skipped += 1
            self._log.warning(f"Snapshot of step {step} skipped: the previous one is still "
                              "being kept.")
            return
        # The epoch the step was committed under: the copy's, whenever it lands.
        self._start(self._keep, (step, epoch, copy_state(runtime.state())))

    def _start(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Run ``target`` on the snapshot thread; ``_busy`` is held, and released by it."""
        self._thread = threading.Thread(target=target, args=args, name="snapshot-writer",
                                        daemon=True)
        self._thread.start()

    def _report_again(self) -> None:
        try:
            self._report()
        finally:
            self._busy.release()

    def _keep(self, step: int, epoch: int, state: dict[str, Any]) -> None:
        try:
            if self.holders is not None:
                self._push(step, epoch, state)
            if self.directory is not None:
                self._write(step, epoch, state)
        finally:
            self._busy.release()

    def _push(self, step: int, epoch: int, state: dict[str, Any]) -> None:
        assert self.holders is not None
        try:
            held = push_to_any(self.holders, self.rank, step, lambda: serialize(state),
                               epoch=epoch, timeout=self.push_timeout)
            # This process's own copies among what the holder keeps for the rank (it may
            # keep a predecessor's too): those are the ones it can vouch for.
            self._pushed[(held.holder, step)] = epoch
            mine = [(s, e) for s, e in zip(held.steps, held.epochs, strict=True)
                    if self._pushed.get((held.holder, s)) == e]
            self._pushed = {(held.holder, s): e for s, e in mine}
            self.memory = MemoryCopies(held.node, held.holder, tuple(s for s, _ in mine),
                                       tuple(e for _, e in mine))
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

    def _write(self, step: int, epoch: int, state: dict[str, Any]) -> None:
        assert self.directory is not None
        folder = snapshot_dir(self.directory, step, self.rank, epoch)
        temp = _temp_dir(self.directory, step, self.rank, epoch)
        try:
            if folder.exists():
                raise FileExistsError(f"{folder} exists already (a visible copy is never "
                                      "rewritten)")
            if temp.exists():
                shutil.rmtree(temp)  # this process's own, from an attempt that failed
            temp.parent.mkdir(parents=True, exist_ok=True)
            dcp = _dcp()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(temp)), no_dist=True)
            torch.save(_map_tensors(state, lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                                 device="meta")),
                       temp / SKELETON)
            marker = {"step": step, "rank": self.rank, "epoch": epoch}
            (temp / COMPLETE).write_text(json.dumps(marker))
            _sync_tree(temp)
            # Visible whole or not at all; rename(2) never replaces a non-empty folder.
            os.rename(temp, folder)
            _sync_dir(folder.parent)
        except Exception as exc:  # a snapshot that fails must never fail training
            shutil.rmtree(temp, ignore_errors=True)
            self._log.error(f"Snapshot of step {step} failed: {type(exc).__name__}: {exc}")
            return
        self._written[step] = epoch
        self.storage = tuple(sorted(self._written)[-self.keep:])
        if not self._report():
            return  # not taken (the rank may have been replaced): delete nothing
        for old in sorted(self._written)[:-self.keep]:
            shutil.rmtree(snapshot_dir(self.directory, old, self.rank, self._written.pop(old)),
                          ignore_errors=True)

    def _report(self) -> bool:
        """Tell the controller what this process's copies hold, under the rank's epoch now.
        True if the report was taken."""
        epoch = self._reported_epoch = self.epoch()
        held = SnapshotReport(self.storage, self.memory, epoch=epoch,
                              storage_epochs=tuple(self._written[s] for s in self.storage))
        try:
            self.report(held)
        except Exception as exc:  # the report is advice to the controller, never fatal
            error = f"{type(exc).__name__}: {exc}"
            if error != self._report_error:
                self._log.warning(f"Could not report this rank's snapshots (its older copies "
                                  f"are kept until a report is taken): {error}", epoch=epoch)
            self._report_error = error
            return False
        if self._report_error is not None:
            self._log.info("This rank's snapshots are reported again.", epoch=epoch)
            self._report_error = None
        return True

    def close(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        if isinstance(self.holders, HolderDirectory):
            self.holders.close()


def _sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folders themselves (deepest first)."""
    folders = []
    for root, _, files in os.walk(folder):
        folders.append(root)
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for root in reversed(folders):
        _sync_dir(Path(root))


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
                              report=_reporter(job, rank),
                              holders=HolderDirectory(job, epoch), epoch=epoch,
                              log_context={"job": job, "node": environ.get(env.CHILD_NODE, "")})
    runtime.after_commit.append(snapshotter.after_commit)
    if runtime.step == 0:
        snapshotter.after_commit(runtime)
    return snapshotter


def _reporter(job: str, rank: int) -> Callable[[SnapshotReport], None]:
    """Tells the controller (through the daemon) which snapshots this rank holds; runs on the
    snapshot writer's thread, on a connection of its own that said hello with the report's
    epoch (a new one when the rank's epoch moves): the daemon takes the report only while the
    job's assignment has not moved past that epoch.

    The function raises DaemonError: the report was not taken."""
    client: list[tuple[int, DaemonClient]] = []

    def report(held: SnapshotReport) -> None:
        epoch = held.epoch or 0
        if client and client[0][0] != epoch:
            client.pop()[1].close()
        try:
            if not client:
                client.append((epoch, DaemonClient(f"{job}/snapshots", epoch=epoch,
                                                   timeout=10)))
            client[0][1].set(str(rank), held.encode())
        except DaemonError:
            if client:
                client.pop()[1].close()
            raise

    return report


def start_holder(job: str, node: str, epoch: int,
                 environ: Mapping[str, str] = os.environ) -> SnapshotHolder | None:
    """As a standby worker of a job that takes snapshots: run a holder for them in this
    process and advertise it under ``<job>/holders/<node>``. None (logged) if the job takes
    none, or the holder cannot start: its ranks then keep storage copies only."""
    if not snapshots_enabled(environ):
        return None
    log = logs.get("understudy.worker", job=job, node=node)
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
