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


@dataclass(frozen=True)
class SnapshotReport:
    """What one rank's snapshots are: the steps in storage, and those a holder keeps."""

    storage: tuple[int, ...] = ()
    memory: MemoryCopies | None = None

    def encode(self) -> bytes:
        memory = None if self.memory is None else {
            "node": self.memory.node, "holder": self.memory.holder,
            "steps": list(self.memory.steps)}
        return json.dumps({"storage": list(self.storage), "memory": memory}).encode()

    @classmethod
    def parse(cls, value: bytes) -> SnapshotReport:
        """A report as a worker wrote it: ``{"storage": [...], "memory": {"node", "holder",
        "steps"} | null}``, or the older plain list of storage steps.

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
            memory = MemoryCopies(node, holder, _steps(memory.get("steps")))
        return cls(storage=_steps(body.get("storage", [])), memory=memory)


def _steps(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        raise ValueError(f"steps must be a list of non-negative integers, got {value!r}")
    return tuple(sorted(set(value)))[-MAX_STEPS:]


def memory_source(node: str, holder: str) -> str:
    return f"memory:{node}:{holder}"


def parse_source(source: str) -> MemoryCopies | None:
    """None for :data:`STORAGE`, else the holder (steps empty) a ``memory:`` source names.

    Raises:
        ValueError: neither.
    """
    if source == STORAGE:
        return None
    tier, _, rest = source.partition(":")
    node, _, holder = rest.rpartition(":")
    if tier != "memory" or not _NODE_RE.match(node) or not HOLDER_ID_RE.match(holder):
        raise ValueError(f"snapshot source {source!r} is neither {STORAGE!r} nor "
                         "'memory:<node>:<holder id>'")
    return MemoryCopies(node, holder, ())


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
                   holders: Mapping[str, str]) -> RollbackPoint | None:
    """The newest step every rank holds in some tier, and where each rank's copy comes from
    (memory when a live holder has it, else storage). None: no step is held by every rank.
    ``holders``: node -> id of the holder alive there (:func:`live_holders`)."""
    in_memory: dict[int, set[int]] = {}
    for rank, copies in memory.items():
        if holders.get(copies.node) == copies.holder:
            in_memory[rank] = set(copies.steps)
    held = [set(storage.get(r, ())) | in_memory.get(r, set()) for r in range(world_size)]
    common = set.intersection(*held) if held else set()
    if not common:
        return None
    step = max(common)
    sources = tuple(memory_source(memory[r].node, memory[r].holder)
                    if step in in_memory.get(r, set()) else STORAGE
                    for r in range(world_size))
    return RollbackPoint(step, sources)
