"""A standby's warmup: build the job on replay groups and run shadow iterations.

::

    target = SandboxTarget(job="gpt", world_size=4, tp=2, rank=1, script=Path(__file__))
    groups = GroupSet("gpt", member(1, node))  # the stable groups rank 1 will keep
    warmed = warm_up(make_job, target, recording_dir, iterations=2, groups=groups)
    log.info(warmed.report.summary())
    ...                                        # parked, warm, until chosen
    runtime = warmed.promote(JobGroups(groups, 1, layout))   # the stand-ins are fenced
    ...                                        # the joiner prepares and switches the groups
    runtime.load_state(state)                  # shadow results are overwritten here
    runtime.run(steps)

**Groups.** With ``groups`` (a :class:`~understudy.groups.groupset.GroupSet` of the rank the
standby warms as), each replay group stands in (:meth:`GroupSet.stand_in`) as version 0 of the
rank's stable :class:`~understudy.groups.versioned.VersionedGroup`, and the job is built on
those objects: a job that keeps its groups for the whole run (Megatron's ``parallel_state``)
keeps the ones the real versions are switched into after promotion. :meth:`Warmed.promote`
fences the stand-ins at once, so no collective reaches a replay group after it, and the groups
raise ``NoCurrentVersionError`` until the joiner's switch. Without ``groups`` the job is built
on the replay groups themselves, and ``ctx.group()`` reaches the real ones after promotion (a
job that looks its groups up at every use).

:func:`warm_up` imports nothing itself and builds the job through the worker
:class:`~understudy.worker.runtime.Runtime`, so the shadow iterations issue exactly the
collectives a real step does, the vote included. What gets warm: the imports the job's module
pulled in, the model and optimizer objects (built once, kept), the allocator pools, kernels
compiled or autotuned on first use, the data path of ``compute``; on a GPU, the CUDA context.

If the recording is missing, made for something else (:class:`RecordingMismatch`), or the job's
calls stop matching it (:class:`ReplayDiverged`), the warmup falls back to a **plain warm
start**: the job is built (on groups that exist only after promotion) and no shadow iteration
runs. It never fails for these reasons; other errors of the job propagate.

The warmed job keeps the :class:`~understudy.worker.api.JobContext` it was built with, so it can
take over only the rank it was warmed as; for another rank of the same role type, build a new
job after promotion (the process, its imports and kernels are still warm).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from understudy.common import logs
from understudy.common.layout import Layout
from understudy.groups.groupset import GroupSet
from understudy.sandbox.errors import RecordingError, RecordingMismatch, ReplayDiverged
from understudy.sandbox.manifest import CodeVersion, Expectation, RoleType
from understudy.sandbox.replay import Recording, ReplayGroups
from understudy.worker.api import (
    Communicator,
    GroupsProvider,
    JobContext,
    TrainingJob,
    reseeds,
)
from understudy.worker.migration import JobGroups
from understudy.worker.runtime import Runtime, compute


def _never() -> bool:
    return False


@dataclass(frozen=True)
class SandboxTarget:
    """Who the standby warms up as: the job, its layout, the rank (whose role type picks the
    recording) and the :class:`JobContext` fields. ``code`` defaults to the code version of
    ``script`` in this process.

    Raises (at construction):
        ValueError: as :class:`Layout`, or ``rank`` outside it.
    """

    job: str
    world_size: int
    tp: int
    rank: int
    script: Path
    pp: int = 1
    seed: int = 0
    #: JobContext.slots
    slots: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    collective_timeout: float = 60.0
    poll_interval: float = 0.05
    should_abort: Callable[[], bool] = _never
    code: CodeVersion | None = None

    def __post_init__(self) -> None:
        self.layout.coordinates(self.rank)

    @property
    def layout(self) -> Layout:
        return Layout(self.world_size, self.tp, self.pp)

    @property
    def role_type(self) -> RoleType:
        return RoleType.of(self.rank, self.layout)


class SandboxGroups:
    """The groups provider a standby's job is built on. In the sandbox it hands out the replay
    groups, or the stable groups they stand in for (``stable``: a provider of this rank's
    :class:`VersionedGroup` objects, each with its replay group as the current version); with
    no replay, after a fallback, every group is missing (``ValueError``, as for a group not
    switched in yet). After :meth:`promote` it defers to the real provider. Promotion is
    one-way."""

    def __init__(self, replay: ReplayGroups | None, stable: GroupsProvider | None = None) -> None:
        self.replay = replay
        self.stable = stable if replay is not None else None
        self._real: GroupsProvider | None = None

    @property
    def promoted(self) -> bool:
        return self._real is not None

    def current(self, name: str) -> Communicator:
        """Raises: ValueError: unknown group, or no group in the sandbox without a recording."""
        real = self._real
        if real is not None:
            return real.current(name)
        if self.replay is None:
            raise ValueError(f"group {name!r} does not exist in the sandbox: no recording "
                             "answers it (plain warm start); it exists after promotion")
        if self.stable is not None:
            return self.stable.current(name)
        return self.replay.current(name)

    def promote(self, real: GroupsProvider) -> None:
        """From now on every group comes from ``real``; the replay groups are dropped."""
        self._real = real
        if self.replay is not None:
            self.replay.close()
            self.replay = None


class WarmupOutcome(enum.Enum):
    SHADOWED = "shadow-iterations"
    """The job was built on replay groups and ran the shadow iterations."""
    PLAIN = "plain-warm-start"
    """The job was built, but no shadow iteration completed (see ``fallback_reason``)."""


@dataclass(frozen=True)
class WarmupReport:
    """What a warmup did. ``warmed`` names what is warm now, in words. Times are seconds;
    ``shadow_s`` holds one entry per shadow iteration that completed (the first is the slow
    one: lazy imports, first-use kernels, allocator growth), ``losses`` what ``compute``
    returned in each."""

    outcome: WarmupOutcome
    warmed: tuple[str, ...]
    role_type: str
    rank: int
    recording: str
    #: shadow iterations asked for (None: all recorded)
    requested: int | None
    iterations: int
    losses: tuple[float | None, ...]
    calls_answered: int
    inputs_differed: int
    load_s: float
    build_s: float
    shadow_s: tuple[float, ...]
    total_s: float
    fallback_reason: str | None = None

    def summary(self) -> str:
        """One sentence for the logs."""
        if self.outcome is WarmupOutcome.SHADOWED:
            return (f"Warmed up as rank {self.rank} ({self.role_type}): built in "
                    f"{self.build_s:.2f} s, {self.iterations} shadow iterations in "
                    f"{sum(self.shadow_s):.2f} s answered by {self.calls_answered} recorded "
                    f"collectives ({self.inputs_differed} with other inputs).")
        return (f"Plain warm start as rank {self.rank} ({self.role_type}): built in "
                f"{self.build_s:.2f} s, no shadow iteration, because {self.fallback_reason}.")


@dataclass
class Warmed:
    """A warmed-up standby: the built runtime (parked on :attr:`groups`), its report, and the
    :class:`GroupSet` whose stable groups the replay groups stand in for (if one was given)."""

    runtime: Runtime
    groups: SandboxGroups
    report: WarmupReport
    stand_ins: GroupSet | None = None

    def promote(self, real: GroupsProvider) -> Runtime:
        """Point the job at the real groups and hand back its runtime, to be given the real
        state with ``load_state`` before its first step. The stand-ins are retired first: the
        stable groups wait for the joiner's switch.

        Raises:
            RuntimeError: promoted already.
            ValueError: the job was built on stable groups and ``real`` hands out others (a
                job that keeps its groups would never see the real ones).
        """
        if self.groups.promoted:
            raise RuntimeError("this warmed standby was promoted already")
        stable = self.groups.stable
        if stable is not None:
            for name in self.runtime.ctx.layout.logical():
                try:
                    same = real.current(name) is stable.current(name)
                except ValueError:  # a group the job never had in the sandbox either
                    continue
                if not same:
                    raise ValueError(f"the real provider's {name} group is not the stable "
                                     "group the job was built on: promote onto the GroupSet "
                                     "the standby was warmed with")
        if self.stand_ins is not None:
            self.stand_ins.retire_stand_ins()
        self.groups.promote(real)
        return self.runtime

    def discard(self) -> None:
        """The standby takes another rank with a new job: retire the stand-ins and close the
        warmed rank's groups (nothing of them was ever connected)."""
        if self.stand_ins is not None:
            self.stand_ins.retire_stand_ins()
            self.stand_ins.close()
            self.stand_ins = None

    def retarget(self, real: GroupsProvider, rank: int) -> tuple[Runtime, str] | None:
        """Promote the standby to ``rank``, another rank than it was warmed as, if its job can
        take that role in place (:meth:`TrainingJob.retarget`): the real groups are ``rank``'s.
        Returns the runtime and what the job kept and allocated; None, with nothing changed,
        if the job cannot (build a new one: the process and its imports are still warm).

        Raises:
            RuntimeError: promoted already.
            ValueError: ``rank`` is outside the job.
        """
        if self.groups.promoted:
            raise RuntimeError("this warmed standby was promoted already")
        ctx = dataclasses.replace(self.runtime.ctx, rank=rank)
        what = self.runtime.job.retarget(ctx)
        if what is None:
            return None
        self.discard()
        self.groups.promote(real)
        self.runtime.rebind(ctx)
        return self.runtime, what


class _Shadow(TrainingJob):
    """Runs the job for the shadow iterations, keeping the losses and the first error of
    ``compute``. A compute error would vote no, but the replayed vote says what the recorded
    rank voted; so apply is skipped after one, and the warmup falls back."""

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        self.losses: list[float | None] = []
        self.error: str | None = None

    def build(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.job.build(ctx)

    def compute(self, step: int) -> float | None:
        try:
            loss = compute(self.job, self.ctx, step)
        except ReplayDiverged:
            raise
        except Exception as exc:  # the job's own failure: recorded, decided on by warm_up
            self.error = self.error or f"the job's compute raised {type(exc).__name__}: {exc}"
            raise
        self.losses.append(loss)
        return loss

    def reseed(self, step: int) -> None:
        if reseeds(self.job):
            self.job.reseed(step)

    def apply(self, step: int) -> None:
        if self.error is None:
            self.job.apply(step)

    def discard(self, step: int) -> None:
        self.job.discard(step)

    def state(self) -> dict[str, Any]:
        return self.job.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.job.load_state(state)


def warm_up(make_job: Callable[[], TrainingJob], target: SandboxTarget,
            recording_dir: Path | str, iterations: int | None = None, *,
            groups: GroupSet | None = None, strict_inputs: bool = False,
            clock: Callable[[], float] = time.perf_counter) -> Warmed:
    """Build the job for ``target`` on the recording of its role type under
    ``recording_dir`` and run up to ``iterations`` shadow iterations (default: all that were
    recorded). With ``groups`` (``target.rank``'s, no version yet) the replay groups stand in
    for its stable groups. See the module docstring.

    Raises:
        ValueError: ``iterations`` is negative.
        Exception: whatever the job's ``build`` raises for reasons of its own.
    """
    if iterations is not None and iterations < 0:
        raise ValueError(f"iterations must not be negative, got {iterations}")
    log = logs.get("understudy.sandbox", job=target.job, rank=target.rank,
                                                          role_type=target.role_type.key)
    t0 = clock()
    code = target.code or CodeVersion.of(target.script)
    expect = Expectation(target.job, target.layout, target.role_type, code)
    folder = str(Path(recording_dir) / target.role_type.key)
    reason: str | None = None
    replay: ReplayGroups | None = None
    try:
        replay = ReplayGroups(Recording.load(recording_dir, target.role_type, expect),
                              strict_inputs=strict_inputs)
    except (RecordingMismatch, RecordingError) as exc:
        reason = f"the recording was refused: {exc}"
    t1 = clock()

    runtime, sandbox, shadow = _build(make_job, target, replay, groups)
    if replay is not None and replay.diverged is not None:
        reason = f"the job's build diverged from the recording: {replay.diverged}"
        if groups is not None:
            groups.retire_stand_ins()
        replay.close()
        replay = None
        runtime, sandbox, shadow = _build(make_job, target, None, groups)
    t2 = clock()

    shadow_s: list[float] = []
    if replay is not None:
        manifest = replay.recording.manifest
        wanted = manifest.iterations if iterations is None else min(iterations,
                                                                   manifest.iterations)
        runtime.step = manifest.first_step
        for _ in range(wanted):
            start = clock()
            try:
                runtime.run(runtime.step + 1)
            except ReplayDiverged as exc:
                reason = f"shadow iteration {len(shadow_s)} diverged from the recording: {exc}"
            if reason is None and replay.diverged is not None:
                reason = (f"shadow iteration {len(shadow_s)} diverged from the recording (the "
                          f"job went on after): {replay.diverged}")
            if reason is None and shadow.error is not None:
                reason = f"shadow iteration {len(shadow_s)} failed: {shadow.error}"
            if reason is not None:
                break
            shadow_s.append(clock() - start)
    # Shadow results never reach training: the runtime starts over, the state is loaded at
    # promotion, and the wrapper that watched the shadow steps goes.
    runtime.job = shadow.job
    runtime.step, runtime.redone = 0, 0
    runtime.timings.clear()
    shadow.job.forget_shadow_steps()
    outcome = WarmupOutcome.PLAIN if reason is not None else WarmupOutcome.SHADOWED
    warmed = ["imports of the job's modules", "the job's build: model, optimizer, data source"]
    if target.device.type == "cuda":
        warmed.append("the CUDA context")
    if outcome is WarmupOutcome.SHADOWED:
        warmed.append(f"{len(shadow_s)} shadow iterations: forward, backward, the collectives' "
                      "code paths, the vote and the optimizer step (kernels, allocator pools)")
    report = WarmupReport(
        outcome=outcome, warmed=tuple(warmed), role_type=target.role_type.key,
        rank=target.rank, recording=folder, requested=iterations,
        iterations=len(shadow_s) if outcome is WarmupOutcome.SHADOWED else 0,
        losses=tuple(shadow.losses[:len(shadow_s)]),
        calls_answered=replay.answered if replay is not None else 0,
        inputs_differed=replay.inputs_differed if replay is not None else 0,
        load_s=t1 - t0, build_s=t2 - t1, shadow_s=tuple(shadow_s), total_s=clock() - t0,
        fallback_reason=reason)
    if outcome is WarmupOutcome.PLAIN:
        log.warning(report.summary())
    else:
        log.info(report.summary())
    return Warmed(runtime, sandbox, report, groups)


def _build(make_job: Callable[[], TrainingJob], target: SandboxTarget,
           replay: ReplayGroups | None,
           groups: GroupSet | None) -> tuple[Runtime, SandboxGroups, _Shadow]:
    """A runtime for ``target`` with the job built on ``replay`` (through the stable groups of
    ``groups`` if given) or on no groups. A build that diverges is left half done; the caller
    checks ``replay.diverged`` and builds anew."""
    stable = None
    if replay is not None and groups is not None:
        for logical, concrete in target.layout.concrete(target.rank).items():
            with contextlib.suppress(ValueError):  # not recorded: missing in the sandbox too
                group = replay.current(logical)
                groups.stand_in(concrete, group.rank(), group.size(), group)
        stable = JobGroups(groups, target.rank, target.layout)
    sandbox = SandboxGroups(replay, stable)
    ctx = JobContext(job=target.job, rank=target.rank, world_size=target.world_size,
                     tp=target.tp, pp=target.pp, groups=sandbox, seed=target.seed,
                     slots=target.slots, device=target.device,
                     collective_timeout=target.collective_timeout,
                     poll_interval=target.poll_interval, should_abort=target.should_abort)
    shadow = _Shadow(make_job())
    runtime = Runtime(shadow, ctx)
    try:
        runtime.build()
    except ReplayDiverged:
        if replay is None or replay.diverged is None:
            raise
    return runtime, sandbox, shadow
