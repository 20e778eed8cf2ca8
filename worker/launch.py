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

import contextlib
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from understudy.common import env, failpoints, logs
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.env import RECORDINGS, WorkerRole
from understudy.common.errorfile import record_error
from understudy.common.layout import Layout
from understudy.groups import abortable
from understudy.groups.errors import GroupBuildError
from understudy.groups.groupset import GroupSet
from understudy.sandbox.manifest import CodeVersion
from understudy.sandbox.recording import Recorder, should_record
from understudy.sandbox.standby import (
    RECORDED_ITERATIONS,
    import_lazy_modules,
    preload_of,
    sandboxed,
    warm_standby,
)
from understudy.sandbox.warmup import Warmed
from understudy.worker.api import (
    CollectiveAborted,
    JobContext,
    TrainingJob,
    replays,
)
from understudy.worker.errors import install_excepthook
from understudy.worker.holder import SnapshotHolder
from understudy.worker.lifeline import tie_to_daemon
from understudy.worker.migration import (
    JobGroups,
    Joiner,
    MigrationHook,
    Plan,
    group_members,
    member,
    report_downtime,
    wait_for_plan,
)
from understudy.worker.progress import ProgressReporter
from understudy.worker.recovery import recover, reshape, wait_for_recovery, wait_while_replaced
from understudy.worker.runtime import Outcome, Runtime
from understudy.worker.snapshots import SNAPSHOTS, start_holder, start_snapshotter
from understudy.worker.stuck import StuckReporter
from understudy.worker.telemetry import MetricsReporter
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
         collective_timeout: float = 60.0, slots: int = 0) -> int:
    """Run this worker's part of the job. Returns the process exit code. ``slots``: a
    :class:`~understudy.worker.api.SlottedJob`'s data-parallel slots (``JobContext.slots``)."""
    with _collector_paused():
        worker = _start(make_job, seed, collective_timeout, slots)
    if _env(env.WORKER_ROLE) == WorkerRole.STANDBY:
        seat = _run_standby(worker)
        if seat is None:
            return 0
    else:
        with _collector_paused():
            seat = _start_rank(worker)
    return _run_rank(worker, seat, steps, on_finish)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while the worker starts up. The first optimizer
    imports torch's compiler stack and the build makes the model: millions of objects that live
    as long as the process, and every full collection on the way rescans all of them (about a
    quarter of a CPU-second of each worker's start on this project's 2-core machine). Once the
    collector runs again, its first pass sees the survivors once. Nothing is frozen: a
    communicator built now and released at a migration must stay collectable. A script that
    turned the collector off keeps it off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class _Worker:
    """What every phase of this worker shares: who it is, its daemon, and its stop signal."""

    make_job: Callable[[], TrainingJob]
    job: str
    node: str
    layout: Layout
    epoch: int
    seed: int
    slots: int                   # JobContext.slots
    timeout: float               # the collective timeout, also the transfers'
    control: DaemonClient
    nodes: tuple[str, ...]       # the assignment's node of each rank
    stop: threading.Event        # set by SIGTERM
    log: Any
    script: Path
    #: where this job's sandbox recordings go; None when the job does not use the sandbox
    recordings: Path | None
    snapshots: Path | None
    #: what this worker tells its daemon's metrics (transfers from the start, steps once it
    #: holds a rank)
    metrics: MetricsReporter
    #: what a standby imports while it waits (``TrainingJob.preload``); () for a rank
    preload: tuple[str, ...] = ()
    #: the GPU its groups connect NCCL on as they are built, for a job that opts in
    #: (``TrainingJob.gpu``); None: NCCL (if any) connects at a group's first CUDA collective
    device: torch.device | None = None
    #: the rank's boundary hook, once it trains; set once
    hook: MigrationHook | None = None

    def should_abort(self) -> bool:
        """A collective waiting on a lost peer is released as soon as the job is recovering."""
        hook = self.hook
        return hook is not None and (hook.recovery() is not None or hook.paused)

    def runtime(self, rank: int, groups: GroupSet) -> Runtime:
        """A fresh runtime for ``rank`` on ``groups``, its job not built yet."""
        ctx = JobContext(job=self.job, rank=rank, world_size=self.layout.world_size,
                         tp=self.layout.tp, pp=self.layout.pp,
                         groups=JobGroups(groups, rank, self.layout), seed=self.seed,
                         slots=self.slots,
                         collective_timeout=self.timeout, should_abort=self.should_abort)
        return Runtime(self.make_job(), ctx)


@dataclass
class _Seat:
    """A rank this worker holds, built and ready to train, however it came to hold it."""

    rank: int
    groups: GroupSet
    runtime: Runtime
    nodes: tuple[str, ...]
    #: the migration this worker completed as its joiner, if it took the rank over
    finished: tuple[str, ...] = ()
    recorder: Recorder | None = None
    #: a rank whose first groups were cut short by the job's recovery (``_first_groups``):
    #: it trains only once it took part in that recovery
    interrupted: CollectiveAborted | None = None


def _start(make_job: Callable[[], TrainingJob], seed: int, timeout: float,
           slots: int) -> _Worker:
    """Tie this process to its daemon and read who it is from the environment.

    Raises:
        LaunchError: the environment is not one ``understudy run`` sets up, or the daemon does
            not know the job.
    """
    install_excepthook()
    tie_to_daemon()  # no worker outlives its daemon
    logs.configure("info", "json")
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
    # Recording for the standbys' sandbox: where a directory is given, unless the job opts out.
    recordings = os.environ.get(RECORDINGS)
    standby = _env(env.WORKER_ROLE) == WorkerRole.STANDBY
    # What the job opts in to: an instance made to be asked (never built), only where there
    # is a question (a sandbox to record for, a GPU to train on, what a standby preloads).
    probe = (make_job() if recordings is not None or standby or torch.cuda.is_available()
             else None)
    try:
        preload = preload_of(probe) if standby and probe is not None else ()
    except TypeError as exc:
        raise LaunchError(str(exc)) from None
    return _Worker(
        make_job=make_job, job=job, node=node, layout=layout, epoch=epoch, seed=seed,
        slots=slots, timeout=timeout, control=control,
        nodes=tuple(info["assignment"]["ranks"]), stop=stop,
        log=logs.get(job=job, node=node), script=Path(sys.argv[0]).resolve(),
        recordings=(Path(recordings) if probe is not None and recordings is not None
                    and sandboxed(probe) else None),
        snapshots=Path(os.environ[SNAPSHOTS]) if os.environ.get(SNAPSHOTS) else None,
        metrics=MetricsReporter(job, epoch), preload=preload,
        device=worker_gpu(probe) if probe is not None else None)


def worker_gpu(job: TrainingJob) -> torch.device | None:
    """The GPU of a worker whose job opts in (``TrainingJob.gpu``), made the current device:
    ``LOCAL_RANK``'s (the node slot the daemon gave this process), modulo the GPUs there are.
    None for a job that does not opt in, or without CUDA (the job's build says what it
    needs)."""
    if not getattr(job, "gpu", False) or not torch.cuda.is_available():
        return None
    index = int(os.environ.get(env.TORCH_LOCAL_RANK) or 0) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _run_standby(w: _Worker) -> _Seat | None:
    """Warm up (in the sandbox, where the job uses it) and wait to be chosen as a joiner; then
    take over the rank the migration names. None: stopped before any migration chose it."""
    w.log.info("Standby worker is up and waiting to be chosen as a joiner.")
    holder = start_holder(w.job, w.node, w.epoch)  # the ranks' snapshots, in this host's memory
    with _collector_paused():
        failed = import_lazy_modules(w.preload)
    for name, why in failed.items():
        w.log.warning(f"Standby could not preload {name} (TrainingJob.preload): {why}")
    w.control.warmth("imports", [], "imports done; the model is built once chosen",
                     holder=holder.id if holder is not None else None)
    warmed = None
    if w.recordings is not None:
        with _signs_of_life(w.control), _collector_paused():
            warmed, _ = warm_standby(w.make_job, w.control, node=w.node, stop=w.stop,
                                     job=w.job, layout=w.layout, seed=w.seed,
                                     slots=w.slots,
                                     recordings=w.recordings, script=w.script,
                                     timeout=w.timeout, should_abort=w.should_abort,
                                     device=w.device)
    found = wait_for_plan(w.control, w.node, w.stop)
    if found is None:
        if holder is not None:
            holder.close()
        return None
    plan, rank = found
    if _follow_shape(w, plan) and warmed is not None:
        w.log.info("The job changed shape since this standby warmed up: building the rank "
                   "afresh.")
        warmed.discard()
        warmed = None
    with _collector_paused():
        return _take_over(w, plan, rank, warmed, holder)


def _follow_shape(w: _Worker, plan: Plan) -> bool:
    """Take the job's nodes and shape as ``plan`` found them (the assignment of its
    ``from_epoch``), not as they were when this standby started: ranks moved meanwhile, and a
    reshape changes the data-parallel size; a reshape's joiner takes a rank of the shape after
    it. True if the shape this worker builds for changed."""
    layout = w.layout
    try:
        a = (w.control.job() or {}).get("assignment") or {}
        if a.get("epoch") == plan.from_epoch:
            nodes = tuple(a["ranks"])
            layout = Layout(len(nodes), w.layout.tp, w.layout.pp)
            w.nodes = nodes
    except (DaemonError, KeyError, TypeError, ValueError):
        pass  # the start's view stands
    if plan.reshape:
        layout = plan.reshaped_layout(w.layout.tp, w.layout.pp)
    changed = layout != w.layout
    w.layout = layout
    return changed


@contextlib.contextmanager
def _signs_of_life(control: DaemonClient, every: float = 2.0) -> Iterator[None]:
    """Ping the daemon every ``every`` seconds while the body runs: a warm-up that builds a
    model of gigabytes and runs shadow iterations on it sends no request for longer than the
    daemon waits before it replaces a silent standby (seen at 1 GiB per rank: replaced every
    10 s, never warm)."""
    done = threading.Event()

    def ping() -> None:
        while not done.wait(every):
            with contextlib.suppress(DaemonError):
                control.ping()

    thread = threading.Thread(target=ping, name="understudy-signs-of-life", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(every + control.timeout)


def _take_over(w: _Worker, plan: Plan, rank: int, warmed: Warmed | None,
               holder: SnapshotHolder | None) -> _Seat:
    """As the standby ``plan`` chose for ``rank``: build the rank's job (or promote the one
    warmed), take the state, and switch to the new groups. A take-over that fails leaves the
    process at once (see :func:`_take_state`)."""
    w.log.info(f"Standby chosen to take over rank {rank}.", migration=plan.id)
    if warmed is not None and warmed.report.rank == rank and warmed.stand_ins is not None:
        # The job was built on this rank's stable groups: keep them, real versions next.
        groups = warmed.stand_ins
        groups.epoch = plan.to_epoch
    else:
        groups = GroupSet(w.job, member(rank, w.node), epoch=plan.to_epoch, timeout=w.timeout,
                          device=w.device)
    # The group objects exist before their first version, so the model is built now,
    # while phase 1 runs, not inside the switch.
    for logical, name in w.layout.concrete(rank).items():
        ranks = w.layout.group_ranks(logical, rank)
        groups.reserve(name, ranks.index(rank), len(ranks))
    runtime = _joiner_runtime(w, rank, groups, warmed)
    joiner = Joiner(w.control, groups, plan, job=w.job, rank=rank, node=w.node, layout=w.layout,
                    nodes=w.nodes, timeout=w.timeout)
    joiner.bound()
    _take_state(w, joiner, plan, rank, runtime, holder)
    failpoints.hit("joiner.switch")
    joiner.switched()
    if plan.reshape and not joiner.committed():
        # The ranks that stay keep the old shape: this standby is spent, as after a failed
        # take-over (see _take_state).
        w.log.warning(f"Reshape {plan.id} was called off after this standby took rank {rank}'s "
                      "state. This standby leaves.")
        w.control.close()
        os._exit(0)
    if holder is not None:
        # A rank now: the survivors have their copies (they loaded before the switch),
        # the controller counts this holder no more (its warmth went with the promotion).
        holder.close()
        w.log.info(f"Snapshot holder {holder.id} closed: this standby holds rank {rank} now.")
    if plan.recovery:
        runtime.announce = (f"First step after {'reshape' if plan.reshape else 'recovery'} "
                            f"{plan.id}")
    return _Seat(rank, groups, runtime, joiner.nodes, finished=(plan.id,))


def _joiner_runtime(w: _Worker, rank: int, groups: GroupSet,
                    warmed: Warmed | None) -> Runtime:
    """The runtime of the rank taken over, built: the warmed one, promoted as it is or
    retargeted to this rank where it can be, else a new one (imports are warm)."""
    if warmed is not None and warmed.report.rank == rank:
        runtime = warmed.promote(JobGroups(groups, rank, w.layout))
        w.log.info(f"Promoting the standby warmed as rank {rank}: its model is built.")
        return runtime
    if warmed is not None:
        retargeted = warmed.retarget(JobGroups(groups, rank, w.layout), rank)
        if retargeted is not None:
            w.log.info(f"Promoting the standby warmed as rank {warmed.report.rank} "
                       f"({w.layout.stage_type(warmed.report.rank)} stage) to rank {rank} "
                       f"({w.layout.stage_type(rank)} stage): {retargeted[1]}.")
            return retargeted[0]
        w.log.info(f"Warmed as rank {warmed.report.rank}, chosen for rank {rank}: "
                   "building that rank's job (imports are warm).")
        warmed.discard()
    runtime = w.runtime(rank, groups)
    runtime.build()
    return runtime


def _own_state(w: _Worker, runtime: Runtime) -> Any:
    """The joiner's own state tree, for the leaver's tensors to land in place (the joiner then
    never holds a second copy of the state); None, and fresh tensors, where the job cannot give
    its state before one is loaded (the Megatron adapter, when its groups were missing at
    build, makes its model in ``load_state``)."""
    try:
        return runtime.state()
    except Exception as exc:  # the job's own code: any failure only costs the in-place landing
        w.log.info(f"The job gave no state before loading one ({exc}); the leaver's state "
                   "lands in fresh tensors.")
        return None


def _take_state(w: _Worker, joiner: Joiner, plan: Plan, rank: int, runtime: Runtime,
                holder: SnapshotHolder | None) -> None:
    """Load the rank's state: the leaver's, or the snapshot a rollback names. If it cannot be
    had, this standby leaves the process at once."""
    try:
        names = joiner.prepare()
        if plan.rollback:
            joiner.restore(runtime, w.snapshots, holder)
            joiner.switch(names)
        else:
            joiner.receive(names, runtime, into=_own_state(w, runtime))
    except TransferError as exc:
        # The migration was called off, or its state never arrived: the leaver keeps the
        # rank. This standby is spent (half-built groups, a partly written model); leave
        # at once, without tearing gloo down, and the daemon starts a fresh one.
        w.log.warning(f"Taking over rank {rank} failed: {exc}. This standby leaves.",
                      migration=plan.id)
        record_error(exc)  # the daemon says why in the migration's abort
        w.control.close()
        os._exit(0)


def _start_rank(w: _Worker) -> _Seat:
    """As a worker started for a rank: join the rank's groups at this epoch and build its job,
    recording its first iterations for the standbys' sandbox where this rank is one that
    records."""
    rank = int(_env(env.RANK))
    failpoints.hit("rank.first-groups")  # started, not yet in any group: lost as the job starts
    groups = GroupSet(w.job, member(rank, w.node), epoch=w.epoch, timeout=w.timeout,
                      device=w.device)
    for name in w.layout.concrete(rank).values():
        groups.prepare(name, w.epoch, group_members(name, w.nodes, w.layout))
    interrupted = _first_groups(w, groups, rank)
    recorder = None
    if w.recordings is not None and w.epoch == 1 and should_record(rank, w.layout):
        recorder = Recorder(w.recordings, job=w.job, layout=w.layout, rank=rank,
                            iterations=RECORDED_ITERATIONS, code=CodeVersion.of(w.script))
        recorder.tap(JobGroups(groups, rank, w.layout))
    runtime = w.runtime(rank, groups)
    runtime.build()
    return _Seat(rank, groups, runtime, w.nodes, recorder=recorder, interrupted=interrupted)


#: How often a rank whose first groups are still building asks its daemon whether the job is
#: recovering from this epoch already (a peer lost as the job started).
FIRST_GROUPS_POLL_S = 0.1


def _first_groups(w: _Worker, groups: GroupSet, rank: int) -> CollectiveAborted | None:
    """Switch in ``rank``'s first group versions, prepared in ``groups``, once they are built.

    A peer lost as the job starts (its node failed, its process died in its imports) never
    joins them, and waiting out the group timeout would fail this rank too, with the job's
    only copy of the state it was about to build. So while they build, the rank watches its job:
    once a recovery from this epoch is planned, it switches in what did build, keeps the rest
    as groups without a version (``GroupSet.reserve``), and returns the interruption. The rank
    then builds its job and takes part in the recovery as a survivor of an aborted step 0 (the
    recovery rebuilds every group a member holds no version of). None: every group is in.

    Raises:
        GroupBuildError: a build failed, or did not finish within the timeout with no recovery
            planned (as before any recovery existed: the worker fails).
    """
    names = groups.pending()
    t0 = time.monotonic()
    deadline = t0 + w.timeout
    asked = 0.0
    while not groups.ready(names) and time.monotonic() < deadline:
        if time.monotonic() - asked >= FIRST_GROUPS_POLL_S:
            asked = time.monotonic()
            if _recovering_from(w.control, w.epoch):
                break
        time.sleep(0.01)
    else:
        groups.switch(names, timeout=max(0.0, deadline - time.monotonic()))
        return None
    built = []
    for name in names:
        if groups.ready([name]):
            with contextlib.suppress(GroupBuildError):  # a build that failed: not built
                groups.switch([name], timeout=0)
                built.append(name)
    unbuilt = [n for n in names if n not in built]
    for name in unbuilt:
        members = group_members(name, w.nodes, w.layout)
        groups.reserve(name, members.index(member(rank, w.node)), len(members))
    groups.abandon(unbuilt)
    waited = time.monotonic() - t0
    w.log.warning(f"The job began a recovery while this rank's first groups were building: "
                  f"{unbuilt} not built; taking part in it from step 0.", rank=rank,
                  built=built, waited=round(waited, 3))
    return CollectiveAborted("a peer was lost while the rank's first groups were building",
                             what="the first group builds", waited=waited)


def _recovering_from(control: DaemonClient, epoch: int) -> bool:
    """Whether ``control``'s job is recovering from ``epoch`` (a daemon that does not answer
    says no: the caller's own timeout still bounds its wait)."""
    try:
        info = control.job()
    except DaemonError:
        return False
    plan = Plan.from_info(info or {})
    return plan is not None and plan.recovers_from(epoch)


def _run_rank(w: _Worker, seat: _Seat, steps: int,
              on_finish: Callable[[Runtime], None] | None) -> int:
    """Train the rank to ``steps``, taking part in migrations and recoveries, then tear down.
    A rank handed off to a joiner leaves the process at once."""
    runtime = seat.runtime
    hook = MigrationHook(w.control, seat.groups, job=w.job, rank=seat.rank, node=w.node,
                         layout=w.layout, nodes=seat.nodes, transfer_timeout=w.timeout,
                         finished=seat.finished, stop=w.stop, send_ahead=replays(runtime.job))
    # The boundary hook reads the job's view at every step: keep it current in the background.
    # (A reshape gives the hook a group set of the new epoch: read it there.)
    # A change of the view (a recovery planned) wakes the waits on collectives at once, to
    # ask their abort predicates, instead of at the end of their 50 ms slices.
    w.control.follow_job(lambda: hook.groups.epoch, on_change=abortable.nudge)
    runtime.hook = hook if seat.recorder is None else seat.recorder.hook(hook)
    w.hook = hook
    snapshotter = start_snapshotter(runtime, w.job, lambda: hook.groups.epoch)
    progress = ProgressReporter(w.job, lambda: (hook.rank, hook.groups.epoch),
                                lambda: runtime.step)
    # Past half the collective timeout, a wait is reported: the controller finds a hung peer.
    stuck = StuckReporter(w.job, lambda: (hook.rank, hook.groups.epoch), lambda: runtime.step,
                          after=w.timeout / 2)
    w.metrics.bind(lambda: (hook.rank, hook.groups.epoch), lambda: runtime.timings)

    def reshaped() -> None:
        # The snapshots of a rank are its number's: a rank renumbered starts a new series.
        nonlocal snapshotter
        w.layout = hook.layout
        if snapshotter is not None:
            snapshotter.close()
            snapshotter = start_snapshotter(runtime, w.job, lambda: hook.groups.epoch)

    outcome = _train(runtime, hook, steps, w.stop, w.timeout, w.log, w.snapshots, reshaped,
                     interrupted=seat.interrupted)
    if snapshotter is not None:
        snapshotter.close()
    if seat.recorder is not None:
        seat.recorder.close(timeout=30)
    w.log.info(f"Rank {hook.rank} finished: {outcome.value} at step {runtime.step}.",
               rank=hook.rank)
    stuck.close()
    progress.close(final=outcome is not Outcome.HANDED_OFF)
    w.metrics.close()  # a leaver's too: what it sent its joiner counts
    if outcome is Outcome.HANDED_OFF:
        # The joiner holds the state now; tearing down communicators whose peers moved on can
        # block, and there is nothing left to save: leave at once.
        w.control.close()
        os._exit(0)
    # A stop every rank agreed on (``understudy stop``) ends the run as its last step did.
    if on_finish is not None and (outcome is Outcome.COMPLETED or
                                  (outcome is Outcome.STOPPED and hook.stop_agreed)):
        on_finish(runtime)
    hook.groups.close()
    w.control.close()
    return 0


def _report_recovered(hook: MigrationHook, plan: Plan, aborted: float, first: int) -> None:
    """The first survivor (``first``, numbered as now) says how long the job stood still,
    from its step's abort to its recovered groups (the controller's downtime per event)."""
    if hook.rank == first:
        report_downtime(hook.job, plan.id, plan.to_epoch, hook.rank,
                        time.monotonic() - aborted, hook.log)


def _train(runtime: Runtime, hook: MigrationHook, steps: int, stop: threading.Event,
           timeout: float, log: Any, snapshots: Path | None = None,
           reshaped: Callable[[], None] = lambda: None,
           interrupted: CollectiveAborted | None = None) -> Outcome:
    """Run the loop; after a step aborted by a lost peer, take part in the job's recovery (or
    reshape: then ``reshaped()``) and run on. A step aborted with no recovery coming (and the
    job not paused waiting for a standby) fails this worker after ``timeout`` seconds: never a
    silent hang. A rank of a replica a reshape drops waits for its daemon to stop it.
    ``interrupted``: the rank's first groups were cut short by a recovery (``_first_groups``);
    it takes part in that before its first step."""
    while True:
        try:
            if interrupted is not None:  # before the first step: to the recovery at once
                cut, interrupted = interrupted, None
                raise cut
            return runtime.run(steps)
        except CollectiveAborted as exc:
            aborted = time.monotonic()
            log.warning(f"Step {runtime.step} aborted: {exc}. Waiting for the job's recovery.",
                        rank=hook.rank)
            called_off: str | None = None  # the plan this rank last saw called off
            while True:
                plan = wait_for_recovery(hook, stop, timeout, called_off)
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
                if hook.rank in plan.moves or (
                        plan.reshape and hook.rank not in plan.stays(hook.layout)):
                    log.warning(f"{'Reshape' if plan.reshape else 'Recovery'} {plan.id} "
                                "replaces this rank: it takes no part and waits to be stopped.",
                                rank=hook.rank)
                    wait_while_replaced(hook, plan, stop)
                    continue
                if plan.reshape:
                    if reshape(runtime, hook, plan, timeout=timeout):
                        reshaped()
                        runtime.announce = f"First step after reshape {plan.id}"
                        _report_recovered(hook, plan, aborted, 0)
                        break
                    called_off = plan.id
                    continue
                if recover(runtime, hook, plan, timeout=timeout, snapshots=snapshots):
                    runtime.announce = f"First step after recovery {plan.id}"
                    _report_recovered(hook, plan, aborted,
                                      min(r for r in range(hook.layout.world_size)
                                          if r not in plan.moves))
                    break
                called_off = plan.id
