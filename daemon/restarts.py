"""The controller's decisions for restart-only jobs (``understudy run --restart-only``):
unmodified torch.distributed scripts that keep their own checkpoints (``docs/restart.md``).

Pure, as the rest of the planner (``planner.py`` calls in here): what etcd holds and ``now`` in,
actions out. Such a job never moves a rank live. A rank's failure, the loss of a node holding a
rank, or a drain of one, is a **restart** (a :class:`Migration` of kind ``restart``, phases
``planned -> done``): every daemon stops the job's ranks (SIGTERM, so the script can save;
SIGKILL after the stop grace), and once every rank of the old epoch has ended or lost its node,
the new assignment is committed (epoch + 1: the same nodes, a lost or draining node's ranks on
the job's free standbys) and the daemons start every rank afresh; the script resumes from its
latest checkpoint, as under torch elastic. :func:`torchrun_env` is what such a rank's process
is given, as torchrun's agent gives its workers.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping

from understudy.common import env
from understudy.common.records import (
    PAUSED,
    STOPPED_CLEANLY,
    Assignment,
    JobSpec,
    JobState,
    Migration,
    MigrationKind,
    MigrationPhase,
    Rendezvous,
    StopRequest,
)
from understudy.common.states import NodeState
from understudy.daemon.planner import (
    Action,
    AdvanceMigration,
    ClusterView,
    JobView,
    SetJobState,
    StartMigration,
    _free_standbys,
    _gone_ranks,
    _ranks,
    _refill_standbys,
    lost,
)

#: how long past a stop's grace the controller waits for the ranks' exits before it calls the
#: job stopped without them (their daemons SIGKILL them at the grace; this covers a daemon that
#: cannot report)
STOP_SLACK_S = 10.0


def plan_restart_only(job: JobView, a: Assignment, view: ClusterView,
                      now: float) -> list[Action]:
    """A running restart-only job with no restart in progress: restart it if a rank failed, a
    rank's node is gone or draining (or the last restart was called off); done once every rank
    ended cleanly; else, as any job, resumed after a pause and its standby pool refilled."""
    name = a.job
    last = job.migration
    again = last is not None and last.kind == MigrationKind.RESTART and \
        last.phase == MigrationPhase.ABORTED and last.from_epoch == a.epoch
    gone = _gone_ranks(job, a, view, now)
    draining = {r: f"drain of {n}" for r, n in enumerate(a.ranks)
                if r not in job.exits and n in view.live
                and view.live[n].state == NodeState.DRAINING}
    if not gone and not draining and not again:
        if len(job.exits) == len(a.ranks):
            return [SetJobState(name, JobState.DONE, "every rank finished")]
        actions: list[Action] = []
        if job.status is not None and job.status.paused:
            actions.append(SetJobState(name, JobState.RUNNING,
                                       "resumed: every rank is held again", event="job-resumed"))
        refill = _refill_standbys(job, a, view, now)
        if refill is not None:
            actions.append(refill)
        return actions
    if again and last is not None:
        # The ranks' exits since are those the called-off restart asked for, not failures.
        what, restarts = last.reason, last.restarts
    else:
        what = "; ".join(dict.fromkeys([*gone.values(), *draining.values()]))
        # As torch elastic: a failure (a rank's, or a node's) uses up a restart, a planned
        # change of membership (a drain) does not.
        restarts = a.restarts + 1 if gone else a.restarts
    if restarts > job.spec.max_restarts:
        return [SetJobState(name, JobState.FAILED,
                            f"{what}; restarted {a.restarts} time(s) after failures already, "
                            f"its --max-restarts is {job.spec.max_restarts}")]
    joiners = _placement(job, a, view, now)
    if isinstance(joiners, int):
        refill = _refill_standbys(job, a, view, now, want=joiners)
        if refill is not None:
            return [refill]  # capacity returned: the next round restarts onto it
        if not gone and not again:
            return []  # a drain waits for a standby, or its deadline stops the ranks
        reason = (f"{PAUSED}{what}; waiting for a standby to restart on "
                  f"({len(_free_standbys(job, a, view))} free)")
        if job.status is None or job.status.reason != reason or not job.status.paused:
            return [SetJobState(name, JobState.RUNNING, reason, event="job-paused",
                                paused=True)]
        return []
    migration = Migration(
        job=name, id=f"e{a.epoch + 1}-{int(now * 1000)}", from_epoch=a.epoch,
        to_epoch=a.epoch + 1, ranks=tuple(range(len(a.ranks))), leavers=a.ranks,
        joiners=joiners, phase=MigrationPhase.PLANNED, reason=what, created_at=now,
        deadline=now + view.migration_timeout, updated_at=now, timings={"planned": now},
        kind=MigrationKind.RESTART, restarts=restarts)
    moved = ", ".join(f"rank {r} {n} -> {j}" for r, (n, j) in
                      enumerate(zip(a.ranks, joiners, strict=True)) if n != j)
    absent = tuple(sorted({n for n in a.ranks if n not in view.live}))
    return [StartMigration(migration, f"restart of every rank from the script's checkpoint "
                                      f"(restart {restarts} of at most "
                                      f"{job.spec.max_restarts} after failures"
                                      f"{'; ' + moved if moved else ''})", absent)]


def _placement(job: JobView, a: Assignment, view: ClusterView,
               now: float) -> tuple[str, ...] | int:
    """Each rank's node after the restart: its node while that is online and active, else a
    free standby of the job's pool (filled up to its slots, in order). An int: the standby
    nodes the pool needs for it (more than it has free)."""
    free = _free_standbys(job, a, view)
    room = {n: max(1, view.live[n].slots) for n in free}
    out = []
    for n in a.ranks:
        if n in view.live and view.live[n].state == NodeState.ACTIVE and not lost(view, n, now):
            out.append(n)
            continue
        pick = next((s for s in free if room[s] > 0), None)
        if pick is None:
            return len(free) + 1
        room[pick] -= 1
        out.append(pick)
    return tuple(out)


def advance_restart(job: JobView, m: Migration, view: ClusterView, now: float) -> list[Action]:
    """A restart commits once every rank of the old epoch has ended (its daemon recorded the
    exit, whatever its code: they were asked to stop) or lost its node; its ranks then start
    afresh under the new epoch. A node chosen for it that is gone, or neither active nor a
    standby any more, calls it off; the next round plans it again."""
    a = job.assignment
    assert a is not None
    for n in dict.fromkeys(m.joiners):
        if n not in view.live or view.live[n].state not in (NodeState.ACTIVE,
                                                              NodeState.STANDBY):
            state = view.live[n].state if n in view.live else "gone"
            return [AdvanceMigration(m.job, m.id, MigrationPhase.ABORTED,
                                     f"node {n} chosen for the restart is {state}")]
    down = [r for r, n in enumerate(a.ranks) if r in job.exits or lost(view, n, now)]
    if len(down) < len(a.ranks):
        return []
    after = Assignment(job=a.job, epoch=m.to_epoch, ranks=m.joiners, migration=m.id,
                       standbys=tuple(n for n in a.standbys if n not in m.joiners),
                       reason=f"restart {m.id}: {m.reason}", updated_at=now,
                       restarts=m.restarts)
    return [AdvanceMigration(m.job, m.id, MigrationPhase.DONE,
                             f"every rank of epoch {a.epoch} ended; they start afresh",
                             assignment=after)]


def plan_stop_restart_only(name: str, job: JobView, stop: StopRequest, view: ClusterView,
                           now: float) -> list[Action]:
    """``understudy stop`` of a restart-only job: there is no step vote to agree on a last step,
    so each daemon sends its ranks SIGTERM (the script may save) and SIGKILL after the stop's
    grace; the job is stopped once every rank has ended or lost its node. Cleanly when every
    rank ended by itself (exit 0) or by the SIGTERM's default action."""
    a = job.assignment
    assert a is not None
    by = stop.requested_by or "the operator"
    running = [r for r, n in enumerate(a.ranks) if r not in job.exits and not lost(view, n, now)]
    if running:
        if now < stop.requested_at + stop.grace + STOP_SLACK_S:
            return []
        return [SetJobState(name, JobState.STOPPED,
                            f"stopped by {by}: no word of rank(s) {_ranks(running)} ending "
                            f"within the grace of {stop.grace:g} s")]
    cut = [f"rank {r} {e.description}" for r, e in sorted(job.exits.items())
           if e.returncode not in (0, -signal.SIGTERM)]
    cut += [f"rank {r}'s node {n} is gone" for r, n in enumerate(a.ranks) if r not in job.exits]
    if not cut:
        return [SetJobState(name, JobState.STOPPED, f"stopped by {by}: {STOPPED_CLEANLY[2]}")]
    return [SetJobState(name, JobState.STOPPED, f"stopped by {by}: {'; '.join(cut)}")]


def torchrun_env(spec: JobSpec, a: Assignment, rank: int, rdzv: Rendezvous,
                 inherited: Mapping[str, str]) -> dict[str, str]:
    """The variables torchrun's agent sets for a worker (``local_elastic_agent.py``), for
    ``rank`` of a restart-only job at ``a``'s epoch: one torchrun "node" per node holding ranks,
    in the order of their first rank. ``OMP_NUM_THREADS`` is 1 unless the job's or the
    daemon's environment (``inherited``) sets it, as torchrun does with several ranks a node."""
    node = a.ranks[rank]
    nodes = list(dict.fromkeys(a.ranks))
    local = a.ranks_on(node)
    world = str(len(a.ranks))
    out = {
        env.TORCH_RANK: str(rank), env.TORCH_WORLD_SIZE: world,
        env.TORCH_LOCAL_RANK: str(local.index(rank)), env.TORCH_LOCAL_WORLD_SIZE: str(len(local)),
        env.TORCH_GROUP_RANK: str(nodes.index(node)), env.TORCH_GROUP_WORLD_SIZE: str(len(nodes)),
        env.TORCH_ROLE_RANK: str(rank), env.TORCH_ROLE_WORLD_SIZE: world,
        env.TORCH_ROLE_NAME: "default",
        env.MASTER_ADDR: rdzv.addr, env.MASTER_PORT: str(rdzv.port),
        env.TORCHELASTIC_RESTART_COUNT: str(a.restarts),
        env.TORCHELASTIC_MAX_RESTARTS: str(spec.max_restarts),
        env.TORCHELASTIC_RUN_ID: spec.name,
        env.TORCHELASTIC_USE_AGENT_STORE: "False",
    }
    for name, default in ((env.OMP_NUM_THREADS, "1"), (env.TORCH_NCCL_ASYNC_ERROR_HANDLING, "1")):
        if name not in spec.env:
            out[name] = inherited.get(name, default)
    return out
