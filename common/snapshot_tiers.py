"""Where a job's snapshots are held, and which copy a rollback takes: pure, no I/O.

Two tiers (``worker/snapshots.py`` takes the snapshots, ``worker/holder.py`` is the memory
tier):

- **memory**: a copy in the host memory of a standby worker on another node (a *holder*,
  named by its node and an incarnation id that changes whenever the worker is restarted);
- **storage**: ``torch.distributed.checkpoint`` under ``UNDERSTUDY_SNAPSHOTS``.

Each rank reports what it holds under ``<job>/snapshots/<rank>`` (:class:`SnapshotReport`).
A memory copy counts only while its holder is alive: the holder's standby worker reports its
id with its warmth, which lives in the node record (bound to the node's lease, and dropped by
the daemon as soon as that worker exits or is promoted to a rank). A rollback goes to the
newest step every rank holds in some tier, each rank's copy taken from memory when there is
one and from storage otherwise (:func:`rollback_point`); the plan names the source of each
rank's copy (:func:`memory_source`, :data:`STORAGE`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: a holder's incarnation id (hex, from the standby worker that runs it)
HOLDER_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: a rank's copy comes from storage
STORAGE = "storage"
#: the newest steps a report may list per tier (the workers keep two)
MAX_STEPS = 64


@dataclass(frozen=True)
class MemoryCopies:
    """Steps of one rank held in the memory of holder ``holder`` on ``node``."""

    node: str
    holder: str
    steps: tuple[int, ...]
    #: the epoch each step's copy was pushed under, in the order of ``steps`` (empty: not said,
    #: as older workers and holders did)
    epochs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.epochs and len(self.epochs) != len(self.steps):
            raise ValueError(f"{len(self.epochs)} epochs for {len(self.steps)} steps")

    def epoch_of(self, step: int) -> int | None:
        return dict(zip(self.steps, self.epochs, strict=False)).get(step)


@dataclass(frozen=True)
class SnapshotReport:
    """What one rank's snapshots are: the steps in storage, and those a holder keeps; with the
    epoch the rank held when it sent the report, and the epoch each storage copy was written
    under (the folder's name), in the order of ``storage``. No epoch: an older worker's."""

    storage: tuple[int, ...] = ()
    memory: MemoryCopies | None = None
    epoch: int | None = None
    storage_epochs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.storage_epochs and len(self.storage_epochs) != len(self.storage):
            raise ValueError(f"{len(self.storage_epochs)} epochs for {len(self.storage)} steps")

    def storage_epoch(self, step: int) -> int | None:
        return dict(zip(self.storage, self.storage_epochs, strict=False)).get(step)

    def encode(self) -> bytes:
        memory: dict[str, Any] | None = None
        if self.memory is not None:
            memory = {"node": self.memory.node, "holder": self.memory.holder,
                      "steps": list(self.memory.steps)}
            if self.memory.epochs:
                memory["epochs"] = list(self.memory.epochs)
        body: dict[str, Any] = {"storage": list(self.storage), "memory": memory}
        if self.epoch is not None:
            body["epoch"] = self.epoch
        if self.storage_epochs:
            body["storage_epochs"] = list(self.storage_epochs)
        return json.dumps(body).encode()

    @classmethod
    def parse(cls, value: bytes) -> SnapshotReport:
        """A report as a worker wrote it: ``{"storage": [...], "storage_epochs": [...],
        "epoch": e, "memory": {"node", "holder", "steps", "epochs"} | null}`` (the epochs
        absent in older workers' reports), or the older plain list of storage steps.

        Raises:
            ValueError: anything else (workers write these keys: the value is untrusted).
        """
        try:
            body = json.loads(value)
        except (UnicodeDecodeError, ValueError):
            raise ValueError("a snapshot report is not JSON") from None
        if isinstance(body, list):
            return cls(storage=_steps(body))
        if not isinstance(body, dict):
            raise ValueError("a snapshot report is a JSON object or a list of steps")
        memory = body.get("memory")
        if memory is not None:
            if not isinstance(memory, dict):
                raise ValueError("a snapshot report's memory is an object or null")
            node, holder = memory.get("node"), memory.get("holder")
            if not isinstance(node, str) or not _NODE_RE.match(node):
                raise ValueError(f"holder node {node!r} is not a node name")
            if not isinstance(holder, str) or not HOLDER_ID_RE.match(holder):
                raise ValueError(f"holder id {holder!r} is not one")
            steps, epochs = _copies(memory.get("steps"), memory.get("epochs"))
            memory = MemoryCopies(node, holder, steps, epochs)
        epoch = body.get("epoch")
        if epoch is not None and not _is_count(epoch):
            raise ValueError(f"a snapshot report's epoch must be a non-negative integer, "
                             f"got {epoch!r}")
        storage, storage_epochs = _copies(body.get("storage", []), body.get("storage_epochs"))
        return cls(storage=storage, memory=memory, epoch=epoch, storage_epochs=storage_epochs)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _steps(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_count(x) for x in value):
        raise ValueError(f"steps must be a list of non-negative integers, got {value!r}")
    return tuple(sorted(set(value)))[-MAX_STEPS:]


def _copies(steps: Any, epochs: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Steps, and (if given) the epoch of each, sorted by step and cut to the newest
    :data:`MAX_STEPS`. Raises ValueError: not lists of non-negative integers of one length, or
    one step with two epochs."""
    if epochs is None:
        return _steps(steps), ()
    if not isinstance(steps, list) or not isinstance(epochs, list) or \
            len(steps) != len(epochs) or not all(_is_count(x) for x in (*steps, *epochs)):
        raise ValueError(f"steps {steps!r} and their epochs {epochs!r} must be lists of "
                         "non-negative integers of one length")
    pairs = dict(zip(steps, epochs, strict=True))
    if len(pairs) != len(set(zip(steps, epochs, strict=True))):
        raise ValueError(f"a step is listed with two epochs: {steps!r}, {epochs!r}")
    kept = sorted(pairs)[-MAX_STEPS:]
    return tuple(kept), tuple(pairs[s] for s in kept)


def memory_source(node: str, holder: str, epoch: int | None = None) -> str:
    """``memory:<node>:<holder id>``, and ``@<epoch>``: the epoch the copy was pushed under."""
    base = f"memory:{node}:{holder}"
    return base if epoch is None else f"{base}@{epoch}"


def storage_source(epoch: int | None = None) -> str:
    """``storage@<epoch>``: the folder the writer of that epoch made; :data:`STORAGE` alone is
    the layout of older workers (one folder per step and rank)."""
    return STORAGE if epoch is None else f"{STORAGE}@{epoch}"


@dataclass(frozen=True)
class Source:
    """Where a plan says a rank's copy comes from: a holder (``memory``: its node and id, no
    steps) or storage (``memory`` None), and the epoch the copy was written under (None: not
    said, an older controller's plan)."""

    memory: MemoryCopies | None
    epoch: int | None = None


def source_of(source: str) -> Source:
    """Raises ValueError: ``source`` is neither ``storage`` nor ``memory:<node>:<holder id>``,
    each optionally followed by ``@<epoch>``."""
    base, at, epoch_text = source.partition("@")
    epoch = None
    if at:
        if not epoch_text.isdigit() or len(epoch_text) > 12 or not epoch_text.isascii():
            raise ValueError(f"snapshot source {source!r} is neither {STORAGE!r} nor "
                             f"'memory:<node>:<holder id>' followed by '@<epoch>'")
        epoch = int(epoch_text)
    if base == STORAGE:
        return Source(None, epoch)
    tier, _, rest = base.partition(":")
    node, _, holder = rest.rpartition(":")
    if tier != "memory" or not _NODE_RE.match(node) or not HOLDER_ID_RE.match(holder):
        raise ValueError(f"snapshot source {source!r} is neither {STORAGE!r} nor "
                         "'memory:<node>:<holder id>' (either may end in '@<epoch>')")
    return Source(MemoryCopies(node, holder, ()), epoch)


def parse_source(source: str) -> MemoryCopies | None:
    """None for storage, else the holder (steps empty) a ``memory:`` source names (the epoch,
    if any, is :func:`source_of`'s).

    Raises:
        ValueError: neither.
    """
    return source_of(source).memory


def report_counts(report: SnapshotReport, epoch: int) -> bool:
    """Whether a rank's report counts toward a rollback while the job's assignment is at
    ``epoch``: a report sent under that epoch or the one before (only a migration raises an
    epoch, by one). A report of the previous epoch was written before the migration that ended
    it committed (the daemon fences the write on the assignment, in etcd): by the rank that
    still holds it and has not sent a report since its switch, or by the process it replaced,
    which can no longer prune what that report lists (a rank prunes only after its daemon took
    a report). Older reports, and reports of an epoch not committed yet (a joiner whose
    migration may still be called off), do not count. A report without an epoch (an older
    worker's) cannot be judged and counts."""
    return report.epoch is None or epoch - 1 <= report.epoch <= epoch


def counted_copies(reports: tuple[SnapshotReport, ...], epoch: int
                   ) -> tuple[dict[int, int | None], MemoryCopies | None]:
    """One rank's copies that count at ``epoch`` (:func:`report_counts`), from its newest
    report and the one it replaced (oldest first): storage step -> the writer's epoch (None:
    the old layout), and the memory copies of the newest counted report's holder (those of an
    earlier report of the same holder included). A step in both keeps the newer report's."""
    storage: dict[int, int | None] = {}
    memory: MemoryCopies | None = None
    for report in reports:
        if not report_counts(report, epoch):
            continue
        for step in report.storage:
            storage[step] = report.storage_epoch(step)
        m = report.memory
        if m is None:
            continue
        if memory is not None and (memory.node, memory.holder) == (m.node, m.holder) \
                and bool(memory.epochs) == bool(m.epochs):
            merged = dict(zip(memory.steps, memory.epochs or (None,) * len(memory.steps),
                              strict=True))
            merged.update(zip(m.steps, m.epochs or (None,) * len(m.steps), strict=True))
            steps = tuple(sorted(merged))
            epochs = tuple(e for e in (merged[s] for s in steps) if e is not None)
            memory = MemoryCopies(m.node, m.holder, steps, epochs)
        else:
            memory = m
    return storage, memory


def live_holders(job: str, warmth_by_node: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """node -> the id of ``job``'s holder running there now, from the live node records'
    warmth (``warmth_by_node``: node -> its record's ``warmth``; junk is skipped)."""
    out = {}
    for node, warmth in warmth_by_node.items():
        w = warmth.get(job) if isinstance(warmth, Mapping) else None
        holder = w.get("holder") if isinstance(w, Mapping) else None
        if isinstance(holder, str) and HOLDER_ID_RE.match(holder):
            out[node] = holder
    return out


@dataclass(frozen=True)
class RollbackPoint:
    step: int
    #: per rank: :data:`STORAGE` or a :func:`memory_source`
    sources: tuple[str, ...]

    def summary(self) -> str:
        """``memory on s1 (ranks 0, 1); storage (rank 2)``"""
        by: dict[str, list[int]] = {}
        for r, source in enumerate(self.sources):
            copies = parse_source(source)
            where = STORAGE if copies is None else f"memory on {copies.node}"
            by.setdefault(where, []).append(r)
        return "; ".join(f"{where} (rank{'s' if len(rs) > 1 else ''} "
                         f"{', '.join(map(str, rs))})" for where, rs in by.items())


def rollback_point(world_size: int, storage: Mapping[int, tuple[int, ...]],
                   memory: Mapping[int, MemoryCopies],
                   holders: Mapping[str, str],
                   storage_epochs: Mapping[int, Mapping[int, int | None]] | None = None
                   ) -> RollbackPoint | None:
    """The newest step every rank holds in some tier, and where each rank's copy comes from
    (memory when a live holder has it, else storage), naming the epoch the copy was written
    under where the report said it. None: no step is held by every rank. ``holders``: node ->
    id of the holder alive there (:func:`live_holders`); ``storage_epochs``: rank -> step ->
    the writer's epoch of its storage copy (absent: the old layout)."""
    in_memory: dict[int, set[int]] = {}
    for rank, copies in memory.items():
        if holders.get(copies.node) == copies.holder:
            in_memory[rank] = set(copies.steps)
    held = [set(storage.get(r, ())) | in_memory.get(r, set()) for r in range(world_size)]
    common = set.intersection(*held) if held else set()
    if not common:
        return None
    step = max(common)
    epochs = storage_epochs or {}
    sources = tuple(memory_source(memory[r].node, memory[r].holder, memory[r].epoch_of(step))
                    if step in in_memory.get(r, set())
                    else storage_source(epochs.get(r, {}).get(step))
                    for r in range(world_size))
    return RollbackPoint(step, sources)
