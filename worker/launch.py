"""Running a training script under ``understudy run``.

The script builds its :class:`~understudy.worker.api.TrainingJob` and hands it to
:func:`main`; everything else comes from the environment the node daemon sets::

    from understudy.worker.launch import main

    if __name__ == "__main__":
        sys.exit(main(MyJob, steps=1000))

A worker started for a rank joins the job's groups (bootstrapped through its daemon, under the
assignment's epoch), runs the loop, and takes part in migrations through the boundary hook. A
worker started as a standby waits until a migration names its node, builds the job for the rank
it takes, joins the new group versions, receives the leaver's state, and carries on from the
step the leaver stopped at. ``on_finish(runtime)`` is called once the last step is committed
(for example to save the final state).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from understudy.common import env, failpoints
from understudy.common import logs as daemon_logs
from understudy.common.daemon_client import DaemonClient
from understudy.common.errorfile import record_error
from understudy.common.layout import Layout
from understudy.groups.groupset import GroupSet
from understudy.sandbox.manifest import CodeVersion
from understudy.sandbox.recording import Recorder, should_record
from understudy.sandbox.standby import (
    RECORDED_ITERATIONS,
    RECORDINGS,
    import_lazy_modules,
    sandboxed,
    warm_standby,
)
from understudy.worker.api import (
    CollectiveAborted,
    JobContext,
    TrainingJob,
)
from understudy.worker.errors import install_excepthook
from understudy.worker.lifeline import tie_to_daemon
from understudy.worker.migration import (
    JobGroups,
    Joiner,
    MigrationHook,
    group_members,
    member,
    wait_for_plan,
)
from understudy.worker.recovery import recover, wait_for_recovery, wait_while_replaced
from understudy.worker.runtime import Outcome, Runtime
from understudy.worker.snapshots import SNAPSHOTS, start_holder, start_snapshotter
from understudy.worker.transfer import TransferError


class LaunchError(RuntimeError):
    """The worker's environment is not one ``understudy run`` sets up."""


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise LaunchError(f"{name} is not set: start this script with `understudy run`")
    return value


def main(make_job: Callable[[], TrainingJob], steps: int, *, seed: int = 0,
         on_finish: Callable[[Runtime], None] | None = None,
         collective_timeout: float = 60.0) -> int:
    """Run this worker's part of the job. Returns the process exit code."""
    install_excepthook()
    tie_to_daemon()  # no worker outlives its daemon
    daemon_logs.configure("info", "json")
    failpoints.check()  # a malformed UNDERSTUDY_FAILPOINTS fails the worker at start
    job = _env(env.JOB)
    node = _env(env.CHILD_NODE)
    world, tp = int(_env(env.WORLD_SIZE)), int(_env(env.TP))
    layout = Layout(world, tp, int(os.environ.get(env.PP) or 1))
    epoch = int(_env(env.EPOCH))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    control = DaemonClient(f"{job}/control", epoch=epoch)
    info = control.job()
    if info is None or info.get("assignment") is None:
        raise LaunchError(f"the daemon does not know job {job!r}")
    nodes = tuple(info["assignment"]["ranks"])
    log = daemon_logs.get(job=job, node=node)
    # A collective waiting on a lost peer is released as soon as the job is recovering.
    hooks: list[MigrationHook] = []
    recorder: Recorder | None = None

    def should_abort() -> bool:
        return bool(hooks) and (hooks[0].recovery() is not None or hooks[0].paused)

    # Recording for the standbys' sandbox: where a directory is given, unless the job opts out.
    recordings = os.environ.get(RECORDINGS)
    snapshots = Path(os.environ[SNAPSHOTS]) if os.environ.get(SNAPSHOTS) else None
    script = Path(sys.argv[0]).resolve()
    can_sandbox = recordings is not None and sandboxed(make_job())

    if _env(env.WORKER_ROLE) == "standby":
        log.info("Standby worker is up and waiting to be chosen as a joiner.")
        holder = start_holder(job, node, epoch)  # the ranks' snapshots, in this host's memory
        import_lazy_modules()
        control.warmth("imports", [], "imports done; the model is built once chosen",
                       holder=holder.id if holder is not None else None)
        warmed = None
        if can_sandbox:
            assert recordings is not None
            warmed, _ = warm_standby(make_job, control, node=node, stop=stop, job=job,
                                     layout=layout, seed=seed,
                                     recordings=Path(recordings), script=script,
                                     timeout=collective_timeout, should_abort=should_abort)
        found = wait_for_plan(control, node, stop)
        if found is None:
            if holder is not None:
                holder.close()
            return 0
        plan, rank = found
        log.info(f"Standby chosen to take over rank {rank}.", migration=plan.id)
        promoted = warmed is not None and warmed.report.rank == rank
        if promoted and warmed is not None and warmed.stand_ins is not None:
            # The job was built on this rank's stable groups: keep them, real versions next.
            groups = warmed.stand_ins
            groups.epoch = plan.to_epoch
        else:
            groups = GroupSet(job, member(rank, node), epoch=plan.to_epoch,
                              timeout=collective_timeout)
        # The group objects exist before their first version, so the model is built now,
        # while phase 1 runs, not inside the switch.
        for logical, name in layout.concrete(rank).items():
            ranks = layout.group_ranks(logical, rank)
            groups.reserve(name, ranks.index(rank), len(ranks))
        retargeted = None
        if promoted and warmed is not None:
            runtime = warmed.promote(JobGroups(groups, rank, layout))
            log.info(f"Promoting the standby warmed as rank {rank}: its model is built.")
        elif warmed is not None and (retargeted := warmed.retarget(JobGroups(groups, rank, layout),
                                                                   rank)) is not None:
            runtime = retargeted[0]
            log.info(f"Promoting the standby warmed as rank {warmed.report.rank} "
                     f"({layout.stage_type(warmed.report.rank)} stage) to rank {rank} "
                     f"({layout.stage_type(rank)} stage): {retargeted[1]}.")
        else:
            if warmed is not None:
                log.info(f"Warmed as rank {warmed.report.rank}, chosen for rank {rank}: "
                         "building that rank's job (imports are warm).")
                warmed.discard()
            runtime = _runtime(make_job, job, rank, layout, seed, groups,
                               collective_timeout, should_abort)
            runtime.build()
        joiner = Joiner(control, groups, plan, job=job, rank=rank, node=node, layout=layout,
                        nodes=nodes, timeout=collective_timeout)
        joiner.bound()
        try:
            names = joiner.prepare()
            if plan.rollback:
                joiner.restore(runtime, snapshots, holder)
                joiner.switch(names)
            else:
                runtime.load_state(joiner.receive(names))
        except TransferError as exc:
            # The migration was called off, or its state never arrived: the leaver keeps the
            # rank. This standby is spent (half-built groups, a partly written model); leave
            # at once, without tearing gloo down, and the daemon starts a fresh one.
            log.warning(f"Taking over rank {rank} failed: {exc}. This standby leaves.",
                        migration=plan.id)
            record_error(exc)  # the daemon says why in the migration's abort
            control.close()
            os._exit(0)
        failpoints.hit("joiner.switch")
        joiner.switched()
        if holder is not None:
            # A rank now: the survivors have their copies (they loaded before the switch),
            # the controller counts this holder no more (its warmth went with the promotion).
            holder.close()
            log.info(f"Snapshot holder {holder.id} closed: this standby holds rank {rank} now.")
        nodes = joiner.nodes
        if plan.recovery:
            runtime.announce = f"First step after recovery {plan.id}"
        finished: tuple[str, ...] = (plan.id,)
    else:
        rank = int(_env(env.RANK))
        groups = GroupSet(job, member(rank, node), epoch=epoch, timeout=collective_timeout)
        for name in layout.concrete(rank).values():
            groups.prepare(name, epoch, group_members(name, nodes, layout))
        groups.switch(groups.pending())
        if can_sandbox and epoch == 1 and should_record(rank, layout):
            assert recordings is not None
            recorder = Recorder(recordings, job=job, layout=layout, rank=rank,
                                iterations=RECORDED_ITERATIONS, code=CodeVersion.of(script))
        if recorder is not None:
            recorder.tap(JobGroups(groups, rank, layout))
        runtime = _runtime(make_job, job, rank, layout, seed, groups, collective_timeout,
                           should_abort)
        runtime.build()
        finished = ()

    # The boundary hook reads the job's view at every step: keep it current in the background.
    control.follow_job(lambda: groups.epoch)
    hook = MigrationHook(control, groups, job=job, rank=rank, node=node, layout=layout,
                         nodes=nodes, transfer_timeout=collective_timeout,
                         finished=finished, stop=stop)
    runtime.hook = hook if recorder is None else recorder.hook(hook)
    hooks.append(hook)
    snapshotter = start_snapshotter(runtime, job, lambda: groups.epoch)
    outcome = _train(runtime, hook, steps, stop, collective_timeout, log, snapshots)
    if snapshotter is not None:
        snapshotter.close()
    if recorder is not None:
        recorder.close(timeout=30)
    log.info(f"Rank {rank} finished: {outcome.value} at step {runtime.step}.", rank=rank)
    if outcome is Outcome.HANDED_OFF:
        # The joiner holds the state now; tearing down communicators whose peers moved on can
        # block, and there is nothing left to save: leave at once.
        control.close()
        os._exit(0)
    if outcome is Outcome.COMPLETED and on_finish is not None:
        on_finish(runtime)
    groups.close()
    control.close()
    return 0


def _train(runtime: Runtime, hook: MigrationHook, steps: int, stop: threading.Event,
           timeout: float, log: Any, snapshots: Path | None = None) -> Outcome:
    """Run the loop; after a step aborted by a lost peer, take part in the job's recovery and
    run on. A step aborted with no recovery coming (and the job not paused waiting for a
    standby) fails this worker after ``timeout`` seconds: never a silent hang."""
    while True:
        try:
            return runtime.run(steps)
        except CollectiveAborted as exc:
            log.warning(f"Step {runtime.step} aborted: {exc}. Waiting for the job's recovery.",
                        rank=hook.rank)
            while True:
                plan = wait_for_recovery(hook, stop, timeout)
                if plan is None:
                    # Groups with a collective stuck on a lost peer would block the
                    # interpreter's teardown until the backend gives up: leave at once.
                    if stop.is_set():
                        log.info("Stopped while waiting for a recovery.", rank=hook.rank)
                        hook.control.close()
                        os._exit(0)
                    log.error(f"No recovery came within {timeout:g} s of the abort; this "
                              "worker fails.", rank=hook.rank)
                    record_error(exc)
                    hook.control.close()
                    os._exit(1)
                if hook.rank in plan.moves:
                    log.warning(f"Recovery {plan.id} replaces this rank: it takes no part and "
                                "waits to be stopped.", rank=hook.rank)
                    wait_while_replaced(hook, plan, stop)
                    continue
                if recover(runtime, hook, plan, timeout=timeout, snapshots=snapshots):
                    runtime.announce = f"First step after recovery {plan.id}"
                    break


def _runtime(make_job: Callable[[], TrainingJob], job: str, rank: int, layout: Layout,
             seed: int, groups: GroupSet, timeout: float,
             should_abort: Callable[[], bool]) -> Runtime:
    ctx = JobContext(job=job, rank=rank, world_size=layout.world_size, tp=layout.tp,
                     pp=layout.pp, groups=JobGroups(groups, rank, layout), seed=seed,
                     collective_timeout=timeout, should_abort=should_abort)
    return Runtime(make_job(), ctx)
