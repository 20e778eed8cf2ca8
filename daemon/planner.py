"""The controller's decisions, as a pure function of what etcd holds and the time.

No I/O and no clock reads here: the controller (``controller.py``) lists etcd, calls
:func:`plan` with ``now``, and carries out the returned actions with compare-and-swap. Losing a
race is normal: the next round plans again from fresh state.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from understudy.common.layout import Layout
from understudy.common.records import (
    CANNOT_RESHAPE,
    NEW_REPLICA,
    NO_REPLICA_COPY,
    PAUSED,
    STOPPED_CLEANLY,
    Assignment,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    MigrationKind,
    MigrationPhase,
    NodeRecord,
    RankExit,
    RegistryEntry,
    Report,
    ResizeRequest,
    StopRequest,
    StuckReport,
    current_layout,
    reshaped,
    reshaped_nodes,
)
from understudy.common.snapshot_tiers import (
    MemoryCopies,
    RollbackPoint,
    live_holders,
    rollback_point,
)
from understudy.common.states import NodeState


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
    #: the event's name, when not ``job-<state>``
    event: str = ""
    #: the job waits for standbys (:attr:`JobStatus.paused`)
    paused: bool = False


@dataclass(frozen=True)
class StartMigration:
    """Write a new migration (only if the job has no active one). ``absent``: the nodes whose
    loss the plan stands on (a recovery of their ranks); it is written only while none of them
    has a node record, so a node that joined again in the meantime keeps its ranks."""

    migration: Migration
    reason: str
    absent: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdvanceMigration:
    """Move the job's migration to ``phase``; with DONE, commit ``assignment`` in the same
    transaction (the joiners now hold the ranks, under the new epoch)."""

    job: str
    id: str
    phase: MigrationPhase
    reason: str
    assignment: Assignment | None = None


@dataclass(frozen=True)
class AddStandbys:
    """Replace the job's assignment by ``assignment`` (the same ranks and epoch, more standby
    nodes), if it is still the one the planner saw."""

    assignment: Assignment
    reason: str


Action = (MarkFailed | PruneEvents | AssignJob | SetJobState | StartMigration
          | AdvanceMigration | AddStandbys)


@dataclass(frozen=True)
class JobView:
    spec: JobSpec
    status: JobStatus | None = None
    assignment: Assignment | None = None
    #: exits of the current epoch's ranks, by rank
    exits: Mapping[int, RankExit] = field(default_factory=dict)
    #: exits under the migration's next epoch (a joiner that took its rank, then died)
    next_exits: Mapping[int, RankExit] = field(default_factory=dict)
    migration: Migration | None = None
    #: workers' progress reports for the current migration (``Report``): "bound/3", ...
    progress: frozenset[str] = frozenset()
    #: why the migration was called off, when a report says so
    abort_reason: str = ""
    #: rank -> the steps of its complete snapshots (the workers' ``<job>/snapshots/<rank>``)
    snapshots: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    #: rank -> the steps of its snapshots a holder keeps in memory, and which holder
    memory_snapshots: Mapping[int, MemoryCopies] = field(default_factory=dict)
    #: rank -> step of ``snapshots`` -> the epoch its writer held (the folder it is in);
    #: absent or None: an older worker's report, the old layout
    storage_epochs: Mapping[int, Mapping[int, int | None]] = field(default_factory=dict)
    #: the operator's resize request (``understudy resize``), if any
    resize: ResizeRequest | None = None
    #: the operator's stop request (``understudy stop``), if any
    stop: StopRequest | None = None
    #: rank -> its report of a collective it has waited in past half its timeout, under the
    #: current epoch (``worker/stuck.py``)
    stuck: Mapping[int, StuckReport] = field(default_factory=dict)

    @property
    def target_dp(self) -> int:
        """The data-parallel size the job is to train at: its ``--dp``, or what the operator
        resized it to (within 1 and its ``--dp``)."""
        return self.spec.dp if self.resize is None else max(1, min(self.resize.dp, self.spec.dp))


@dataclass(frozen=True)
class ClusterView:
    #: node name -> (registry entry, its mod revision)
    registry: Mapping[str, tuple[RegistryEntry, int]]
    #: node name -> live record (present only while the node's lease is alive)
    live: Mapping[str, NodeRecord]
    #: event keys, oldest first
    event_keys: tuple[str, ...] = ()
    jobs: Mapping[str, JobView] = field(default_factory=dict)
    #: node name -> deadline of its drain request, for nodes being drained
    drain_deadlines: Mapping[str, float] = field(default_factory=dict)
    #: seconds a migration may take from planned to its switch (``drain.migration_timeout``)
    migration_timeout: float = 120.0
    #: While ``now`` is before this, a node without a live record is not yet lost (no node
    #: marked failed, no rank recovered for it): the controller saw most of the cluster's
    #: leases lapse at once, as when a single etcd member paused past the TTL revokes them all
    #: on waking, and their daemons are joining again with their ranks (see the controller).
    hold_losses_until: float = 0.0
    #: node name -> when the controller first saw it without a live record (absent: long ago)
    absent_since: Mapping[str, float] = field(default_factory=dict)
    #: seconds a node must have been without a record to count as lost: etcd revokes the leases
    #: that expired together within moments, but a controller hears of them one record at a
    #: time, and must see the whole of a mass revocation before it acts on any of it
    loss_settle: float = 0.0
    #: node name -> why the controller revoked its lease (it found the node dead or silent:
    #: ``daemon/probe.py``). Such a node is lost as soon as its record is gone.
    evidence: Mapping[str, str] = field(default_factory=dict)

    # What the rounds' questions about free capacity are answered from, worked out once per
    # view: a round asks them for every job, and working them out each time made a round
    # O(jobs x nodes) (0.34 s at 4,096 nodes and 102 jobs; docs/benchmarks.md, "The
    # controller's round and re-list"). A view is never changed: the planner makes a new one
    # (``dataclasses.replace``) when a job's assignment changes within a round, and that one
    # works them out afresh.

    @functools.cached_property
    def placeable(self) -> tuple[NodeRecord, ...]:
        """Online nodes that may take new work, by name: not cordoned (the caller filters by
        state)."""
        return tuple(rec for name, rec in sorted(self.live.items())
                     if (entry := self.registry.get(name)) is None or not entry[0].cordoned)

    @functools.cached_property
    def placeable_names(self) -> frozenset[str]:
        return frozenset(rec.name for rec in self.placeable)

    @functools.cached_property
    def used_slots(self) -> Mapping[str, int]:
        """node -> ranks of running or pending jobs on it"""
        used: dict[str, int] = {}
        for job in self.jobs.values():
            if job.assignment is None or (job.status and job.status.state.ended):
                continue
            for node in job.assignment.ranks:
                used[node] = used.get(node, 0) + 1
        return used

    @functools.cached_property
    def reserved_standbys(self) -> frozenset[str]:
        """standby nodes of running or pending jobs"""
        return frozenset(n for job in self.jobs.values() if job.assignment is not None
                         and not (job.status and job.status.state.ended)
                         for n in job.assignment.standbys)


def lost(view: ClusterView, node: str, now: float) -> bool:
    """Whether ``node`` counts as gone: no live record, no mass disruption on hold, and either
    evidence that it is dead, or ``loss_settle`` seconds passed without a record.

    The probes' evidence waits out a hold too: when etcd wakes from a pause and revokes every
    lease, a daemon that joins again does so as a new incarnation, whose probe replies the old
    record's incarnation does not match; to the prober the old one went silent, although the
    node is alive and about to take its ranks back."""
    if node in view.live or now < view.hold_losses_until:
        return False
    return node in view.evidence or \
        now - view.absent_since.get(node, float("-inf")) >= view.loss_settle


def plan(view: ClusterView, now: float, max_events: int = 1000) -> list[Action]:
    """Decide what the controller does next. Deterministic in ``view`` and ``now``."""
    actions: list[Action] = []
    for name in sorted(view.registry):
        entry, rev = view.registry[name]
        if not lost(view, name, now) or entry.offline or entry.state == NodeState.FAILED:
            continue
        # The node record is bound to the node's lease: it is gone only when the lease expired
        # (or was revoked by a daemon that did not leave cleanly).
        why = view.evidence.get(name) or \
            f"lease expired: node was {entry.state} with no keep-alive for a full TTL"
        actions.append(MarkFailed(node=name, mod_revision=rev, reason=why))
    actions.extend(_plan_jobs(view, now))
    excess = len(view.event_keys) - max_events
    if excess > 0:
        actions.append(PruneEvents(view.event_keys[:excess],
                                   f"keeping the newest {max_events} events"))
    return actions


def place(spec: JobSpec, view: ClusterView, now: float) -> Assignment | str:
    """Ranks fill the free slots of active nodes in name order (so TP neighbours share a node
    when they can); standbys are free standby nodes. Returns the reason when it cannot."""
    used = view.used_slots
    ranks: list[str] = []
    for rec in view.placeable:
        if rec.state != NodeState.ACTIVE:
            continue
        free = rec.slots - used.get(rec.name, 0)
        take = min(free, spec.world_size - len(ranks))
        ranks.extend([rec.name] * max(take, 0))
    if len(ranks) < spec.world_size:
        return (f"needs {spec.world_size} slots on active nodes, {len(ranks)} are free")
    taken = view.reserved_standbys
    standbys = [rec.name for rec in view.placeable
                if rec.state == NodeState.STANDBY and rec.name not in taken][:spec.standby]
    if len(standbys) < spec.standby:
        return f"needs {spec.standby} standby nodes, {len(standbys)} are free"
    return Assignment(job=spec.name, epoch=1, ranks=tuple(ranks), standbys=tuple(standbys),
                      reason="initial placement", updated_at=now)


def _plan_jobs(view: ClusterView, now: float) -> list[Action]:
    """Each job's actions in name order. A job placed or given standbys in this round holds
    its nodes for the jobs after it: the next one's placement or refill sees them taken, not
    free, so two jobs pending in one round never land on the same slots or standbys."""
    actions: list[Action] = []
    for name in sorted(view.jobs):
        mine = _plan_job(name, view.jobs[name], view, now)
        actions.extend(mine)
        for act in mine:
            if isinstance(act, AssignJob | AddStandbys):
                job = view.jobs[name]
                view = dataclasses.replace(view, jobs={
                    **view.jobs, name: dataclasses.replace(job, assignment=act.assignment)})
    return actions


def _plan_job(name: str, job: JobView, view: ClusterView, now: float) -> list[Action]:
    state = job.status.state if job.status else JobState.PENDING
    if job.stop is not None and not state.ended:
        return _plan_stop(name, job, job.stop, view, now)
    if state == JobState.PENDING and job.assignment is None:
        placed = place(job.spec, view, now)
        if isinstance(placed, str):
            if job.status is None or job.status.reason != placed:
                return [SetJobState(name, JobState.PENDING, placed)]
            return []
        return [AssignJob(placed, "placed on " + ", ".join(sorted(set(placed.ranks))))]
    if state != JobState.RUNNING or job.assignment is None:
        return []
    try:
        current_layout(job.spec, job.assignment)
    except ValueError:
        return []  # a foreign assignment: nothing is planned on it
    if job.migration is not None and job.migration.active:
        return _advance_migration(job, job.migration, view, now)
    if job.spec.restart_only:
        return restarts().plan_restart_only(job, job.assignment, view, now)
    gone = _gone_ranks(job, job.assignment, view, now)
    if not gone and (hung := hung_ranks(job, job.assignment, now)):
        # A suspicion recovers a job, never fails or pauses it: without a replica or a
        # snapshot to recover from, the waiting ranks' own timeouts decide as before.
        recovery = _plan_recovery(job, job.assignment, hung, view, now)
        if any(isinstance(act, StartMigration) for act in recovery):
            return recovery
    if gone:
        ended = _end_after_finish(name, job, job.assignment, gone)
        if ended is not None:
            return ended
        return _plan_recovery(job, job.assignment, gone, view, now)
    migration = _plan_migration(job, job.assignment, view, now)
    if migration is not None:
        return [migration]
    if len(job.exits) == len(job.assignment.ranks):
        return [SetJobState(name, JobState.DONE, "every rank finished")]
    resize = _plan_resize(job, job.assignment, view, now)
    if resize is not None:
        return [resize]
    actions: list[Action] = []
    if job.status is not None and job.status.paused:
        actions.append(SetJobState(name, JobState.RUNNING, "resumed: every rank is held again",
                                   event="job-resumed"))
    refill = _refill_standbys(job, job.assignment, view, now)
    if refill is not None:
        actions.append(refill)
    return actions


def _plan_stop(name: str, job: JobView, stop: StopRequest, view: ClusterView,
               now: float) -> list[Action]:
    """A job the operator stops (``understudy stop``): its ranks agree on their last step among
    themselves (the step vote) and end, ``on_finish`` run; nothing is planned for it meanwhile
    (no migration, recovery or resize). Stopped once every rank has ended, or once one failed
    or its node went (the others cannot finish their step without it), or at the grace's end;
    the reason names the ranks that did not finish. The daemons then stop whatever is left and
    the job's nodes go back to the pool."""
    by = stop.requested_by or "the operator"
    a = job.assignment
    if a is None or job.status is None or job.status.state == JobState.PENDING:
        return [SetJobState(name, JobState.STOPPED, f"stopped by {by} {STOPPED_CLEANLY[1]}")]
    if job.spec.restart_only:
        return restarts().plan_stop_restart_only(name, job, stop, view, now)
    failed = sorted(e.rank for e in job.exits.values() if e.failed)
    lost_nodes = [r for r, n in enumerate(a.ranks) if r not in job.exits and lost(view, n, now)]
    unfinished = [r for r in range(len(a.ranks)) if r not in job.exits]
    if not unfinished and not failed:
        return [SetJobState(name, JobState.STOPPED, f"stopped by {by}: {STOPPED_CLEANLY[0]}")]
    if failed or lost_nodes:
        what = "; ".join([*(f"rank {r} failed" for r in failed),
                          *(f"rank {r}'s node {a.ranks[r]} is gone" for r in lost_nodes)])
        rest = f"; rank(s) {_ranks(unfinished)} stopped as they were" if unfinished else ""
        return [SetJobState(name, JobState.STOPPED,
                            f"stopped by {by}: {what} while stopping{rest}")]
    if now >= stop.requested_at + stop.grace:
        return [SetJobState(name, JobState.STOPPED,
                            f"stopped by {by}: rank(s) {_ranks(unfinished)} did not finish "
                            f"within the grace of {stop.grace:g} s and were stopped as they "
                            "were")]
    return []


def restarts() -> types.ModuleType:
    """``restarts.py``, a restart-only job's decisions. It builds on this module, so it is
    imported when first needed, once this one is whole."""
    from understudy.daemon import restarts as module
    return module


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _gone_ranks(job: JobView, a: Assignment, view: ClusterView,
                now: float) -> dict[int, str]:
    """Ranks of the current epoch whose process failed or whose node is gone -> why."""
    gone = {e.rank: f"rank {e.rank} failed on {e.node}: {e.description}"
            for e in job.exits.values() if e.failed}
    for r, n in enumerate(a.ranks):
        if lost(view, n, now) and r not in job.exits:
            gone[r] = f"node {n} holding rank {r} is gone"
    return dict(sorted(gone.items()))


#: a stuck report older than this (by its writer's clock against the controller's) is not
#: counted: its writer re-reports every few seconds while it waits
STUCK_REPORT_FRESH_S = 30.0


def hung_ranks(job: JobView, a: Assignment, now: float) -> dict[int, str]:
    """Ranks of the current epoch that hang -> why. A hung rank neither exits nor answers, so
    its peers' collective timeout would fail them instead (the job then recovered, or paused,
    on the wrong ranks). Each rank says when it has waited in one collective past half its
    timeout (``worker/stuck.py``); the ranks still held that do not, once the longest waiter
    has waited 3/4 of its timeout (every rank whose wait began up to a quarter of the timeout
    later has said so by then), are hung. They are never more than the ranks that wait (one
    rank waiting among four names no one)."""
    held = [r for r in range(len(a.ranks)) if r not in job.exits]
    waiting = {r: rep for r, rep in job.stuck.items()
               if r in held and rep.epoch == a.epoch and now - rep.at < STUCK_REPORT_FRESH_S}
    suspects = [r for r in held if r not in waiting]
    if not waiting or not suspects or len(suspects) > len(waiting):
        return {}
    longest = max(waiting.values(), key=lambda rep: rep.waited + max(0.0, now - rep.at))
    waited = longest.waited + max(0.0, now - longest.at)
    if waited < 1.5 * longest.after:
        return {}
    return {r: f"rank {r} on {a.ranks[r]} hangs: rank(s) {_ranks(sorted(waiting))} have waited "
               f"on it for {waited:.0f} s (in {longest.what})"
            for r in suspects}


def _finished(job: JobView) -> list[int]:
    """Ranks of the current epoch whose process ended cleanly: a rank ends so only once the
    job's last step is committed, by every rank (the step vote)."""
    return sorted(r for r, e in job.exits.items() if not e.failed)


def _end_after_finish(name: str, job: JobView, a: Assignment,
                      gone: dict[int, str]) -> list[Action] | None:
    """A job with ranks gone after one finished is at its end: its last step is committed,
    and no group can be rebuilt with a rank that left, so nothing is recovered. It ends once
    every rank finished or is gone: failed if a rank's process failed, done if the others'
    node went before it reported them (their last step is committed; what they did after it,
    ``on_finish``, is not known). None: no rank finished, a recovery is planned as usual."""
    finished = _finished(job)
    if not finished:
        return None
    if len(finished) + len(gone) < len(a.ranks):
        return []  # the others are finishing
    crashed = [r for r in gone if r in job.exits]
    if crashed:
        return [SetJobState(name, JobState.FAILED, f"{gone[crashed[0]]}, after rank "
                                                   f"{finished[0]} finished the job's last step")]
    return [SetJobState(name, JobState.DONE,
                        f"every rank reached the job's last step (rank {finished[0]} finished "
                        f"it); rank(s) {_ranks(list(gone))} went before reporting their exit: "
                        f"{'; '.join(gone.values())}")]


def _free_standbys(job: JobView, a: Assignment, view: ClusterView) -> list[str]:
    """The job's standby nodes that may take a rank now, a joiner of an attempt that was just
    called off last (it hung, or is being replaced)."""
    free = [n for n in a.standbys if n in view.placeable_names  # a cordoned one takes no rank
            and view.live[n].state == NodeState.STANDBY]
    last = job.migration
    if last is not None and last.phase == MigrationPhase.ABORTED:
        free.sort(key=lambda n: n in last.joiners)
    return free


def _pick_joiners(job: str, ranks: list[int], free: list[str], view: ClusterView,
                  layout: Layout) -> tuple[str, ...]:
    """One free standby per rank, in order; a standby whose worker has built the job for that
    very rank (its warmth says so) takes it first, then one built for a rank of the same role
    (stage type and TP index: its code paths are warm, its blocks the right shape)."""
    def warmed_rank(node: str) -> int | None:
        w = view.live[node].warmth.get(job) if node in view.live else None
        r = w.get("rank") if isinstance(w, dict) else None
        return r if isinstance(r, int) else None

    left = list(free)
    picks: dict[int, str] = {}
    for r in ranks:
        match = next((n for n in left if warmed_rank(n) == r), None)
        if match is not None:
            picks[r] = match
            left.remove(match)
    for r in ranks:
        if r in picks:
            continue
        match = next((n for n in left if (w := warmed_rank(n)) is not None
                      and 0 <= w < layout.world_size and layout.role(w) == layout.role(r)),
                     None)
        if match is not None:
            picks[r] = match
            left.remove(match)
    for r in ranks:
        if r not in picks:
            picks[r] = left.pop(0)
    return tuple(picks[r] for r in ranks)


def _after(layout: Layout, rank: int) -> list[int]:
    """``rank``'s data-parallel replicas, the next DP rank first and on around the group: a
    job that shards its optimizer state keeps each shard's copy on the next DP rank
    (``TrainingJob.replica_state``); for the others any replica will do."""
    replicas = [d for d in layout.replicas(rank) if d != rank]
    dp_index = layout.coordinates(rank)[1]
    return sorted(replicas, key=lambda d: (layout.coordinates(d)[1] - dp_index) % layout.dp)


def _plan_recovery(job: JobView, a: Assignment, gone: dict[int, str], view: ClusterView,
                   now: float) -> list[Action]:
    """Replace ranks whose process or node is gone by standbys, each taking the state of the
    last committed step from a live data-parallel replica (same TP index)."""
    name, layout = a.job, current_layout(job.spec, a)
    donors: list[int] = []
    snapshot_step = -1
    point: RollbackPoint | None = None
    # A recovery just called off because its donor keeps no copy of the lost rank's state
    # (the job shards it over DP, and the copy was lost too): no replica will do for them.
    last = job.migration
    no_copy = (last.outcome.removeprefix(NO_REPLICA_COPY) if last is not None
               and last.kind == MigrationKind.RECOVERY and last.phase == MigrationPhase.ABORTED
               and last.outcome.startswith(NO_REPLICA_COPY) else "")
    uncopied = set(last.ranks) if no_copy and last is not None else set()
    for r in gone:
        replicas = [] if r in uncopied else [
            d for d in _after(layout, r) if d not in gone and a.ranks[d] in view.live]
        if replicas:
            donors.append(replicas[0])
            continue
        point = rollback_point(layout.world_size, job.snapshots, job.memory_snapshots,
                               live_holders(name, {n: rec.warmth for n, rec in
                                                   view.live.items()}), job.storage_epochs)
        if point is None:
            held = no_copy if r in uncopied else "no live data-parallel replica holds its state"
            return [SetJobState(name, JobState.FAILED,
                                f"{gone[r]}, {held}, and no snapshot is held by every rank")]
        snapshot_step, donors = point.step, []
        break
    free = _free_standbys(job, a, view)
    what = "; ".join(gone.values())
    own = [r for r in gone if r in job.exits and job.exits[r].own_error]
    if own and len(free) < len(gone):
        # The job's own code failed: it is retried on the job's free standbys (each retry
        # takes one), never waited for; with none left the job fails with its cause.
        return [SetJobState(name, JobState.FAILED, f"{what}; the job's own code failed "
                                                   f"(rank {own[0]}) and no standby of its "
                                                   "pool is free to retry it")]
    if len(free) < len(gone):
        # A job short of standbys takes as many as it needs, whatever its --standby count
        # (0 included): its survivors wait with their state in memory until they come.
        refill = _refill_standbys(job, a, view, now, want=len(gone))
        if refill is not None:
            return [refill]  # capacity returned: the next round recovers onto it
        shrink = _plan_shrink(job, a, gone, view, now)
        if shrink is not None:
            return [shrink]
        reason = (f"{PAUSED}{what}; waiting for a standby to take over ({len(free)} free, "
                  f"{len(gone)} needed)")
        if job.status is None or job.status.reason != reason or not job.status.paused:
            return [SetJobState(name, JobState.RUNNING, reason, event="job-paused",
                                paused=True)]
        return []
    ranks = tuple(gone)
    absent = tuple(sorted({a.ranks[r] for r in ranks if a.ranks[r] not in view.live}))
    migration = Migration(
        job=name, id=f"e{a.epoch + 1}-{int(now * 1000)}", from_epoch=a.epoch,
        to_epoch=a.epoch + 1, ranks=ranks, leavers=tuple(a.ranks[r] for r in ranks),
        joiners=_pick_joiners(name, list(ranks), free, view, layout), phase=MigrationPhase.PLANNED,
        reason=what,
        created_at=now, deadline=now + view.migration_timeout, updated_at=now,
        timings={"planned": now},
        kind=MigrationKind.RECOVERY if snapshot_step < 0 else MigrationKind.ROLLBACK,
        donors=tuple(donors), snapshot_step=snapshot_step,
        snapshot_from=point.sources if point is not None else ())
    if point is not None:
        moves = ", ".join(f"rank {r} -> {j}" for r, j in
                          zip(migration.ranks, migration.joiners, strict=True))
        return [StartMigration(migration, f"rollback of every rank to the snapshot of step "
                                          f"{snapshot_step}: {moves}; copies from "
                                          f"{point.summary()}", absent)]
    moves = ", ".join(f"rank {r} -> {j} (state from rank {d})" for r, j, d in
                      zip(migration.ranks, migration.joiners, donors, strict=True))
    return [StartMigration(migration, f"recovery: {moves}", absent)]


def _plan_shrink(job: JobView, a: Assignment, gone: dict[int, str], view: ClusterView,
                 now: float, cause: str = "for want of a standby") -> StartMigration | None:
    """A job that may reshape (``--reshape``) with no standby for its lost ranks (or for its
    draining ones, or resized down): drop their whole replicas and train on with the others,
    renumbered densely, holding every slot between them (``docs/reshape.md``). None: it may
    not, no replica is left whole, or its ranks refused the last reshape (its job is not a
    slotted one); the job then pauses (a drain waits for its deadline)."""
    last = job.migration
    if not job.spec.reshape or (last is not None and last.kind == MigrationKind.RESHAPE
                                and last.phase == MigrationPhase.ABORTED
                                and last.outcome.startswith(CANNOT_RESHAPE)):
        return None
    layout = current_layout(job.spec, a)
    dropped = {layout.coordinates(r)[1] for r in gone}
    keep = tuple(d for d in range(layout.dp) if d not in dropped and all(
        a.ranks[r] in view.live for r in range(layout.world_size)
        if layout.coordinates(r)[1] == d))
    if not keep:
        return None
    what = "; ".join(dict.fromkeys(gone.values()))
    migration = Migration(
        job=a.job, id=f"e{a.epoch + 1}-{int(now * 1000)}", from_epoch=a.epoch,
        to_epoch=a.epoch + 1, ranks=(), leavers=(), joiners=(), phase=MigrationPhase.PLANNED,
        reason=what, created_at=now, deadline=now + view.migration_timeout, updated_at=now,
        timings={"planned": now}, kind=MigrationKind.RESHAPE, replicas=keep, from_dp=layout.dp)
    moves = ", ".join(f"{old}->{new}" for old, new in
                      migration.renumbering(layout.tp, layout.pp).items())
    absent = tuple(sorted({a.ranks[r] for r in gone if a.ranks[r] not in view.live}))
    return StartMigration(migration, f"reshape {cause}: DP {layout.dp} -> "
                                     f"{len(keep)}, replica(s) {sorted(dropped)} dropped, "
                                     f"ranks renumbered {moves}", absent)


def _advance_reshape(job: JobView, m: Migration, view: ClusterView,
                     now: float) -> list[Action]:
    """A reshape commits once every rank that stays holds its groups of the new shape (they
    came up with every member, the joiners included, after each joiner took its state); until
    then the ranks train on nothing and wait for the commit, so a failure of a rank that stays
    or of a joiner, a rank's refusal or the deadline call it off and nothing changed (its ranks
    wait for the next plan on the step they settled on). A grow's joiners bind first."""
    a = job.assignment
    assert a is not None
    layout = current_layout(job.spec, a)
    stay = m.renumbering(layout.tp, layout.pp)
    if all(Report.RESHAPED.of(r) in job.progress for r in stay):
        ranks = reshaped_nodes(layout, a.ranks, m.replicas, m.ranks, m.joiners)
        kept = tuple(n for n in a.standbys if n not in m.joiners)
        spare = _freed_by_reshape(a, ranks, view)
        after = Assignment(job=a.job, epoch=m.to_epoch, ranks=ranks, migration=m.id,
                           standbys=(*kept, *(n for n in spare if n not in kept)),
                           reason=f"reshape {m.id}: {m.reason}", updated_at=now)
        also = f"; {', '.join(spare)} stand by for it now" if spare else ""
        return [AdvanceMigration(m.job, m.id, MigrationPhase.DONE,
                                 f"every rank that stays holds the new shape "
                                 f"(DP {layout.dp} -> {len(m.replicas)}){also}",
                                 assignment=after)]
    gone = [n for n in m.joiners if lost(view, n, now)]
    if gone:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 f"joiner node {gone[0]} is gone")]
    if Report.ABORTED in job.progress:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 job.abort_reason or "a rank aborted the reshape")]
    failed = [why for r, why in _gone_ranks(job, a, view, now).items() if r in stay]
    if failed:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 f"{failed[0]} during the reshape")]
    if now > m.deadline:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 f"the deadline passed ({now - m.created_at:.1f} s after it "
                                 "was planned)")]
    if m.phase == MigrationPhase.PLANNED and m.ranks and \
            all(Report.BOUND.of(r) in job.progress for r in m.ranks):
        return [AdvanceMigration(m.job, m.id, MigrationPhase.PREPARING, "joiners are bound")]
    return []


def _freed_by_reshape(a: Assignment, ranks: tuple[str, ...], view: ClusterView) -> list[str]:
    """The nodes a shrink leaves without work that become standbys of the job, in the same
    write: the surviving nodes of a dropped replica (its lost rank's node gone or its process
    dead, the others alive), online, placeable (not cordoned) and active (not draining: a
    drained node leaves), holding no rank of the new shape or of another job, and no other
    job's standby. The job grows back onto them, with more, when capacity returns
    (``docs/reshape.md``)."""
    others = {n for other, j in view.jobs.items() if other != a.job
              and j.assignment is not None and not (j.status and j.status.state.ended)
              for n in (*j.assignment.ranks, *j.assignment.standbys)}
    return [n for n in dict.fromkeys(a.ranks)
            if n not in ranks and n not in others and n in view.placeable_names
            and view.live[n].state == NodeState.ACTIVE]


def _plan_resize(job: JobView, a: Assignment, view: ClusterView,
                 now: float) -> StartMigration | AddStandbys | None:
    """A ``--reshape`` job not at its target size (:attr:`JobView.target_dp`): above it (the
    operator resized it down), drop its last replicas; below it (it shrank after a loss, or
    the operator resized it up), grow while standbys are free: as many whole replicas as they
    make up, each rank taking the state of the same place in replica 0. Standbys are first
    taken into its pool from the free ones (:class:`AddStandbys`). None: nothing to do."""
    layout = current_layout(job.spec, a)
    target = job.target_dp
    if not job.spec.reshape or layout.dp == target or job.exits:
        return None
    if layout.dp > target:
        why = f"resized to DP {target} by {job.resize.requested_by or 'the operator'}" \
            if job.resize is not None else f"DP {target}"
        return _plan_shrink(job, a, {r: why for r in range(layout.world_size)
                                     if layout.coordinates(r)[1] >= target}, view, now,
                            "to the operator's size")
    per = layout.tp * layout.pp
    free = _free_standbys(job, a, view)
    if len(free) < per:
        return _refill_standbys(job, a, view, now, want=per * (target - layout.dp))
    # Only standbys whose worker is up (it reports its warmth once its imports are done): the
    # ranks stop when the grow is planned, and wait for its joiners.
    free = [n for n in free if isinstance(view.live[n].warmth.get(a.job), dict)]
    grow = min(target - layout.dp, len(free) // per)
    if grow < 1:
        return None
    new = reshaped(layout, layout.dp + grow)
    ranks = sorted(new.rank_of(t, d, s) for s in range(layout.pp)
                   for d in range(layout.dp, new.dp) for t in range(layout.tp))
    donors = []
    for r in ranks:
        t, _, s = new.coordinates(r)
        donors.append(new.rank_of(t, 0, s))
    migration = Migration(
        job=a.job, id=f"e{a.epoch + 1}-{int(now * 1000)}", from_epoch=a.epoch,
        to_epoch=a.epoch + 1, ranks=tuple(ranks), leavers=("",) * len(ranks),
        joiners=_pick_joiners(a.job, ranks, free, view, new), phase=MigrationPhase.PLANNED,
        reason=f"standbys free: DP {layout.dp} -> {new.dp} of {target}", created_at=now,
        deadline=now + view.migration_timeout, updated_at=now, timings={"planned": now},
        kind=MigrationKind.RESHAPE, replicas=(*range(layout.dp), *[NEW_REPLICA] * grow),
        from_dp=layout.dp, donors=tuple(donors))
    moves = ", ".join(f"rank {r} -> {j} (state from rank {d})" for r, j, d in
                      zip(migration.ranks, migration.joiners, donors, strict=True))
    return StartMigration(migration, f"reshape onto free standbys: DP {layout.dp} -> {new.dp}: "
                                     f"{moves}")


def _refill_standbys(job: JobView, a: Assignment, view: ClusterView, now: float,
                     want: int = 0) -> AddStandbys | None:
    """Give a job whose standbys were used up, or went offline, free standby nodes again
    (capacity returned): up to its ``--standby`` count, or ``want`` if more (the ranks a
    paused job must recover). Offline standbys leave the pool in the same write."""
    used = view.used_slots  # a joiner's node holds its rank before its state says active
    alive = tuple(n for n in a.standbys if n in view.live and n not in used)
    ready = [n for n in alive if n in view.placeable_names
             and view.live[n].state == NodeState.STANDBY]  # may take a rank now
    missing = max(job.spec.standby - len(alive), want - len(ready))
    if missing <= 0:
        return None
    taken = view.reserved_standbys
    fresh = [rec.name for rec in view.placeable if rec.state == NodeState.STANDBY
             and rec.name not in taken and rec.name not in used][:missing]
    if not fresh:
        return None
    return AddStandbys(dataclasses.replace(a, standbys=(*alive, *fresh),
                                           reason=f"standby pool refilled with "
                                                  f"{', '.join(fresh)}", updated_at=now),
                       f"{', '.join(fresh)} now stand by for job {a.job}")


def _plan_migration(job: JobView, a: Assignment, view: ClusterView,
                    now: float) -> StartMigration | None:
    """Pair every rank on a draining node with one of the job's free standbys."""
    leaving = [(r, n) for r, n in enumerate(a.ranks) if r not in job.exits  # finished: stays
               and n in view.live and view.live[n].state == NodeState.DRAINING]
    if not leaving:
        return None
    free = _free_standbys(job, a, view)
    if len(free) < len(leaving):
        # The drain cannot be satisfied live: a --reshape job drops the draining ranks'
        # replicas; any other waits for its deadline to stop them.
        return _plan_shrink(job, a, {r: f"drain of {n}" for r, n in leaving}, view, now)
    deadline = min((d for d in (view.drain_deadlines.get(n) for _, n in leaving) if d),
                   default=now + view.migration_timeout)
    deadline = min(deadline, now + view.migration_timeout)
    # One id per attempt: an aborted attempt's reports never count for the next one.
    mig_id = f"e{a.epoch + 1}-{int(now * 1000)}"
    migration = Migration(
        job=a.job, id=mig_id, from_epoch=a.epoch, to_epoch=a.epoch + 1,
        ranks=tuple(r for r, _ in leaving), leavers=tuple(n for _, n in leaving),
        joiners=_pick_joiners(a.job, [r for r, _ in leaving], free, view,
                              current_layout(job.spec, a)),
        phase=MigrationPhase.PLANNED,
        reason=f"drain of {', '.join(sorted({n for _, n in leaving}))}", created_at=now,
        deadline=deadline, updated_at=now, timings={"planned": now})
    moves = ", ".join(f"rank {r} {n} -> {j}" for r, n, j in
                      zip(migration.ranks, migration.leavers, migration.joiners, strict=True))
    return StartMigration(migration, moves)


def _advance_migration(job: JobView, m: Migration, view: ClusterView,
                       now: float) -> list[Action]:
    assert job.assignment is not None
    if m.kind == MigrationKind.RESHAPE:
        return _advance_reshape(job, m, view, now)
    if m.kind == MigrationKind.RESTART:
        return restarts().advance_restart(job, m, view, now)

    def reported(kind: Report, ranks: tuple[int, ...]) -> bool:
        return all(kind.of(r) in job.progress for r in ranks)

    if len(job.exits) == len(job.assignment.ranks) and \
            not any(e.failed for e in job.exits.values()):
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 "every rank finished the job first")]
    if m.recovery and (finished := _finished(job)):
        # Its loss came as the job ended (the plan raced the survivors' exit reports): no
        # group can be rebuilt with a rank that left; the next round ends the job.
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 f"rank {finished[0]} finished the job's last step: no group "
                                 "can be rebuilt with it")]
    # Phase 2: the ranks agreed on the switch step. This pass may be the first to see their
    # word (the phase still reads ready), and a leaver that dies streaming its state may be in
    # the same pass: the switch, not the record's phase, decides what a loss means.
    switching = m.phase == MigrationPhase.SWITCHING or (
        m.phase == MigrationPhase.READY and Report.SWITCHING in job.progress)
    gone = [n for n in m.joiners if lost(view, n, now)]
    if gone and not switching:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 f"joiner node {gone[0]} is gone")]
    assert job.assignment is not None
    # A rank that fails during a migration: a planned one is called off before its switch and
    # the next round recovers the job; a recovery starts over with the new loss included.
    failed = {r: why for r, why in _gone_ranks(job, job.assignment, view, now).items()
              if not (m.recovery and r in m.ranks)}
    if failed and not switching:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 f"{next(iter(failed.values()))} during the migration")]
    # In phase 2 only a leaver that died before its state reached the joiner stops it; the
    # others' losses are recovered once the joiners hold their ranks.
    dead_leavers = [r for r in failed
                    if r in m.ranks and Report.TRANSFERRED.of(r) not in job.progress]
    if dead_leavers and not m.recovery:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 f"{failed[dead_leavers[0]]} in phase 2, before its state "
                                 "reached the joiner")]
    # A member's own call to abort (its joiner gave up, a survivor's switch failed) comes after
    # the ranks' failures above: where a leaver died, that is the cause, not its joiner's leave.
    if Report.ABORTED in job.progress:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                 job.abort_reason or "the ranks aborted the switch")]
    # A joiner that dies in phase 2 once its leaver sent the state: the leaver has handed off
    # and the stayers switch, so the migration is committed and the rank, lost under the new
    # epoch, is recovered by the next round like any other. (Before that, the leaver's failed
    # send reports it and the migration is called off.)
    dead_joiners = {r for r, j in zip(m.ranks, m.joiners, strict=True)
                    if lost(view, j, now) or (r in job.next_exits and job.next_exits[r].failed)}
    if now > m.deadline and not switching:
        return [AdvanceMigration(
            m.job, m.id, MigrationPhase.ABORTED,
            f"the deadline passed ({m.phase} {now - m.created_at:.1f} s after it was planned)")]
    world = tuple(r for r in range(len(job.assignment.ranks))
                  if not (m.recovery and r in m.ranks))
    if m.phase == MigrationPhase.PLANNED and reported(Report.BOUND, m.ranks):
        return [AdvanceMigration(m.job, m.id, MigrationPhase.PREPARING, "joiners are bound")]
    if m.phase == MigrationPhase.PREPARING and reported(Report.PREPARED, world) \
            and reported(Report.JOINER_PREPARED, m.ranks):
        return [AdvanceMigration(m.job, m.id, MigrationPhase.READY, "every member prepared")]
    if m.phase == MigrationPhase.READY and Report.SWITCHING in job.progress:
        return [AdvanceMigration(m.job, m.id, MigrationPhase.SWITCHING,
                                 "the ranks agreed on the switch step")]
    took_over = all(Report.SWITCHED.of(r) in job.progress or (
        r in dead_joiners and Report.TRANSFERRED.of(r) in job.progress
        and m.phase == MigrationPhase.SWITCHING) for r in m.ranks)
    if (m.phase in (MigrationPhase.READY, MigrationPhase.SWITCHING) or (m.recovery
            and m.phase == MigrationPhase.PREPARING)) and took_over:
        a = job.assignment
        assert a is not None
        ranks = list(a.ranks)
        for r, joiner in zip(m.ranks, m.joiners, strict=True):
            ranks[r] = joiner
        new = Assignment(job=a.job, epoch=m.to_epoch, ranks=tuple(ranks), migration=m.id,
                         standbys=tuple(n for n in a.standbys if n not in m.joiners),
                         reason=f"migration {m.id}: {m.reason}", updated_at=now)
        return [AdvanceMigration(m.job, m.id, MigrationPhase.DONE, "the joiners took over",
                                 assignment=new)]
    return []
