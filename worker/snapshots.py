"""Periodic snapshots of a rank's state, for the jobs no replica can recover.

A lost rank is rebuilt from a data-parallel replica when it has one. Where none holds its state
(DP=1), every rank rolls back to the newest snapshot all of them hold, and the job redoes the
steps since: with the data and the random streams keyed to the step, the run ends bit for bit
where an uninterrupted one does.

:class:`Snapshotter` takes one every ``every`` committed steps: the state is copied on the
training thread (the only synchronous part: a memory copy), then written by a background
thread with ``torch.distributed.checkpoint`` (one directory per step and rank, a ``COMPLETE``
marker last), and the steps held complete are reported to the daemon under
``<job>/snapshots/<rank>`` (a JSON list) for the controller to pick the rollback step. A
snapshot still being written when the next one is due makes that one skipped, never a stall.
The newest ``keep`` complete snapshots are kept.

Storage only, so far: in-memory snapshots on another node are not implemented.
"""

from __future__ import annotations

import json
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed.checkpoint as dcp

from understudy.worker.runtime import Runtime

COMPLETE = "COMPLETE"
SKELETON = "skeleton.pt"
#: The job's environment: the snapshot directory (every node must see it) and the period.
SNAPSHOTS = "UNDERSTUDY_SNAPSHOTS"
SNAPSHOT_EVERY = "UNDERSTUDY_SNAPSHOT_EVERY"
DEFAULT_EVERY = 50


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
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    runtime.load_state(template)


class Snapshotter:
    """Takes this rank's snapshots (see the module docstring). ``report(steps)`` is called on
    the writer thread with the complete steps held, after each write."""

    def __init__(self, directory: Path, *, rank: int, every: int,
                 report: Callable[[list[int]], None], keep: int = 2) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"every ({every}) and keep ({keep}) must be at least 1")
        self.directory, self.rank, self.every, self.keep = directory, rank, every, keep
        self.report = report
        self.skipped = 0
        self._busy = threading.Lock()
        self._thread: threading.Thread | None = None
        self._log = structlog.get_logger("understudy.worker").bind(rank=rank)

    def after_commit(self, runtime: Runtime) -> None:
        """Called by the runtime after each committed step."""
        step = runtime.step
        if step % self.every:
            return
        if not self._busy.acquire(blocking=False):
            self.skipped += 1
            self._log.warning(f"Snapshot of step {step} skipped: the previous one is still "
                              "being written.")
            return
        state = copy_state(runtime.state())
        self._thread = threading.Thread(target=self._write, args=(step, state),
                                        name="snapshot-writer", daemon=True)
        self._thread.start()

    def _write(self, step: int, state: dict[str, Any]) -> None:
        try:
            folder = snapshot_dir(self.directory, step, self.rank)
            if folder.exists():
                shutil.rmtree(folder)
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
            self.report(steps[-self.keep:])
        except Exception as exc:  # a snapshot that fails must never fail training
            self._log.error(f"Snapshot of step {step} failed: {type(exc).__name__}: {exc}")
        finally:
            self._busy.release()

    def close(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
