"""The controller's decisions, as a pure function of what etcd holds and the time.

No I/O and no clock reads here: the controller (``controller.py``) lists etcd, calls
:func:`plan` with ``now``, and carries out the returned actions with compare-and-swap. Losing a
race is normal: the next round plans again from fresh state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from understudy.daemon.records import (
    Assignment,
    JobSpec,
    JobState,
    JobStatus,
    NodeRecord,
    RankExit,
    RegistryEntry,
)
from understudy.daemon.states import NodeState


@dataclass(frozen=True)
class MarkFailed:
    """Write ``failed`` into the node's registry entry, if it is still at ``mod_revision``."""

    node: str
    mod_revision: int
    reason: str


@dataclass(frozen=True)
class PruneEvents:
    keys: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class AssignJob:
    """Create the job's first assignment (only if none exists) and mark it running."""

    assignment: Assignment
    reason: str


@dataclass(frozen=True)
class SetJobState:
    job: str
    state: JobState
    reason: str


Action = MarkFailed | PruneEvents | AssignJob | SetJobState


@dataclass(frozen=True)
class JobView:
    spec: JobSpec
    status: JobStatus | None = None
    assignment: Assignment | None = None
    #: exits of the current epoch's ranks, by rank
    exits: Mapping[int, RankExit] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterView:
    #: node name -> (registry entry, its mod revision)
    registry: Mapping[str, tuple[RegistryEntry, int]]
    #: node name -> live record (present only while the node's lease is alive)
    live: Mapping[str, NodeRecord]
    #: event keys, oldest first
    event_keys: tuple[str, ...] = ()
    jobs: Mapping[str, JobView] = field(default_factory=dict)


def plan(view: ClusterView, now: float, max_events: int = 1000) -> list[Action]:
    """Decide what the controller does next. Deterministic in ``view`` and ``now``."""
    actions: list[Action] = []
    for name in sorted(view.registry):
        entry, rev = view.registry[name]
        if name in view.live or entry.offline or entry.state == NodeState.FAILED:
            continue
        # The node record is bound to the node's lease: it is gone only when the lease expired
        # (or was revoked by a daemon that did not leave cleanly).
        actions.append(MarkFailed(
            node=name, mod_revision=rev,
            reason=f"lease expired: node was {entry.state} with no keep-alive for a full TTL",
        ))
    actions.extend(_plan_jobs(view, now))
    excess = len(view.event_keys) - max_events
    if excess > 0:
        actions.append(PruneEvents(view.event_keys[:excess],
                                   f"keeping the newest {max_events} events"))
    return actions


def placeable_nodes(view: ClusterView) -> list[NodeRecord]:
    """Online nodes that may take new work: not cordoned (the caller filters by state)."""
    out = []
    for name, rec in sorted(view.live.items()):
        entry = view.registry.get(name)
        if entry is not None and entry[0].cordoned:
            continue
        out.append(rec)
    return out


def used_slots(view: ClusterView) -> dict[str, int]:
    used: dict[str, int] = {}
    for job in view.jobs.values():
        if job.assignment is None or (job.status and job.status.state in (JobState.DONE,
                                                                          JobState.FAILED)):
            continue
        for node in job.assignment.ranks:
            used[node] = used.get(node, 0) + 1
    return used


def reserved_standbys(view: ClusterView) -> set[str]:
    return {n for job in view.jobs.values() if job.assignment is not None
            and not (job.status and job.status.state in (JobState.DONE, JobState.FAILED))
            for n in job.assignment.standbys}


def place(spec: JobSpec, view: ClusterView, now: float) -> Assignment | str:
    """Ranks fill the free slots of active nodes in name order (so TP neighbours share a node
    when they can); standbys are free standby nodes. Returns the reason when it cannot."""
    used = used_slots(view)
    ranks: list[str] = []
    for rec in placeable_nodes(view):
        if rec.state != NodeState.ACTIVE:
            continue
        free = rec.slots - used.get(rec.name, 0)
        take = min(free, spec.world_size - len(ranks))
        ranks.extend([rec.name] * max(take, 0))
    if len(ranks) < spec.world_size:
        return (f"needs {spec.world_size} slots on active nodes, {len(ranks)} are free")
    taken = reserved_standbys(view)
    standbys = [rec.name for rec in placeable_nodes(view)
                if rec.state == NodeState.STANDBY and rec.name not in taken][:spec.standby]
    if len(standbys) < spec.standby:
        return f"needs {spec.standby} standby nodes, {len(standbys)} are free"
    return Assignment(job=spec.name, epoch=1, ranks=tuple(ranks), standbys=tuple(standbys),
                      reason="initial placement", updated_at=now)


def _plan_jobs(view: ClusterView, now: float) -> list[Action]:
    actions: list[Action] = []
    for name in sorted(view.jobs):
        job = view.jobs[name]
        state = job.status.state if job.status else JobState.PENDING
        if state == JobState.PENDING and job.assignment is None:
            placed = place(job.spec, view, now)
            if isinstance(placed, str):
                if job.status is None or job.status.reason != placed:
                    actions.append(SetJobState(name, JobState.PENDING, placed))
            else:
                actions.append(AssignJob(placed, "placed on " + ", ".join(
                    sorted(set(placed.ranks)))))
        elif state == JobState.RUNNING and job.assignment is not None:
            failed = [e for e in job.exits.values() if e.failed]
            lost = [(r, n) for r, n in enumerate(job.assignment.ranks)
                    if n not in view.live and r not in job.exits]
            if lost:
                # Recovery onto a standby is the next step; until then the job fails cleanly.
                rank, node = lost[0]
                actions.append(SetJobState(name, JobState.FAILED,
                                           f"node {node} holding rank {rank} is gone"))
            elif failed:
                first = min(failed, key=lambda e: e.time)
                actions.append(SetJobState(name, JobState.FAILED,
                                           f"rank {first.rank} failed: {first.description}"))
            elif len(job.exits) == job.spec.world_size:
                actions.append(SetJobState(name, JobState.DONE, "every rank finished"))
    return actions
