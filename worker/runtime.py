"""The worker runtime: the loop around a :class:`~understudy.worker.api.TrainingJob`.

One iteration of :meth:`Runtime.run`, for the step ``s`` after the last committed one:

1. **Boundary.** ``hook.on_boundary(s)`` answers an :class:`Action`: carry on, switch to the
   groups' next versions first, hand this rank's state off and leave, start sending the state
   ahead (a leaver whose job replays), or stop. This is where the migration protocol acts;
   nothing of step ``s`` has run yet.
2. **Compute.** ``job.compute(s)`` (a :class:`~understudy.worker.api.SlottedJob`: each slot the
   rank's replica holds, then the canonical sum of their gradients, :mod:`understudy.worker.
   slots`). An exception is recorded, not raised: this rank votes no.
3. **Vote.** An all-reduce (MIN) of ``[ok]`` over the world group, waited abortably.
4. **Commit or redo.** All ranks ok: ``hook.before_apply(s, job)`` if the hook has it (a
   leaver forwards the step's apply inputs there), ``job.apply(s)``, and ``s`` is committed.
   Otherwise ``job.discard(s)``, the process-global RNGs go back to where they were before
   compute, and step ``s`` runs again from the boundary, on every rank alike, since all saw
   the same vote.

If a collective of the step aborts (:class:`~understudy.groups.errors.CollectiveAborted`, from
compute or from the vote), the error propagates out of :meth:`Runtime.run`: the groups are
broken and only the recovery protocol can replace them. A rank that aborted in compute rolls the
step back as in 4. A rank that computed ``s`` and aborted in the vote cannot know whether its
peers received the result (a peer that died inside the all-reduce may have sent its part to
some ranks), so it keeps the step **pending**: its gradients and the generators' states on both
sides of compute. The recovery protocol learns the most advanced survivor's committed step and
calls :meth:`Runtime.settle` on every survivor: a pending ``s`` is applied if anyone committed
it (the vote was then all-ok), else discarded. Survivors differ by at most that one step: no
rank can reach the vote of ``s + 1`` before every rank voted on ``s``.

Jobs that implement :meth:`~understudy.worker.api.TrainingJob.reseed` get it called before every
attempt, so a rank's random streams follow from the step and a rank rebuilt from a replica's
state draws what the lost rank would have.
"""

from __future__ import annotations

import enum
import functools
import inspect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from understudy.common import failpoints, logs
from understudy.common.layout import Layout
from understudy.worker import rng, slots
from understudy.worker.api import (
    CollectiveAborted,
    Communicator,
    JobContext,
    Landing,
    TrainingError,
    TrainingJob,
    allreduce_options,
    interrupts,
    reseeds,
    restages,
    slotted,
)
from understudy.worker.interrupt import ComputeInterrupted, Tripwire, interruptible


class StepFailed(TrainingError):
    """A step's vote failed ``attempts`` times in a row, on every rank alike."""

    def __init__(self, message: str, *, step: int, attempts: int) -> None:
        super().__init__(message)
        self.step = step
        self.attempts = attempts


class Action(enum.Enum):
    """What the runtime does at an iteration boundary."""

    CONTINUE = "continue"
    """Run the step."""
    SWITCH_GROUPS = "switch-groups"
    """Call ``hook.switch_groups(step)``, then run the step on the groups' new versions."""
    HAND_OFF = "hand-off"
    """Call ``hook.hand_off(step, state)`` with :meth:`Runtime.state`, then leave the loop."""
    SEND_AHEAD = "send-ahead"
    """Call ``hook.send_ahead(step, state)`` with :meth:`Runtime.state` (the hook starts
    sending it and must be done with it before ``apply``), then run the step."""
    STOP = "stop"
    """Leave the loop without running the step."""


class Outcome(enum.Enum):
    """Why :meth:`Runtime.run` returned."""

    COMPLETED = "completed"
    STOPPED = "stopped"
    HANDED_OFF = "handed-off"


class BoundaryHook(Protocol):
    """The migration protocol's seat in the loop. ``step`` is always the next step to run,
    i.e. the number of committed steps."""

    def on_boundary(self, step: int) -> Action:
        """Decide what happens before ``step``; called before every attempt of every step."""
        ...

    def switch_groups(self, step: int) -> None:
        """Make the groups' prepared next versions current (on :attr:`Action.SWITCH_GROUPS`)."""
        ...

    def hand_off(self, step: int, state: dict[str, Any]) -> bool:
        """Deliver this rank's state to its successor (on :attr:`Action.HAND_OFF`). True: the
        rank leaves the loop; False: the hand-off was called off and the rank runs the step."""
        ...

    def vote_flag(self, step: int) -> int:
        """A number this rank adds to the step's vote (the migration protocol agrees on its
        switch boundary this way)."""
        ...

    # Optional (the runtime looks them up): send_ahead(step, state) -> None, on
    # Action.SEND_AHEAD; before_apply(step, job, after) -> bool, once the vote committed
    # ``step`` and before ``job.apply(step)`` (a leaver forwards the step's apply inputs
    # there), ``after`` the runtime's counters once it applied (``state()["runtime"]``):
    # True when the joiner took the step with the rank, and this rank leaves without
    # applying it (``job.handed_off(step)`` instead; the run ends HANDED_OFF).

    def on_vote(self, step: int, flag: int) -> None:
        """The flag every rank gave for ``step`` if they all gave the same, else 0."""
        ...


class NoMigration:
    """The hook of a job without migrations: always :attr:`Action.CONTINUE`."""

    def on_boundary(self, step: int) -> Action:
        return Action.CONTINUE

    def switch_groups(self, step: int) -> None:
        raise NotImplementedError("NoMigration never asks to switch groups")

    def hand_off(self, step: int, state: dict[str, Any]) -> bool:
        raise NotImplementedError("NoMigration never asks to hand off")

    def vote_flag(self, step: int) -> int:
        return 0

    def on_vote(self, step: int, flag: int) -> None:
        return None


@dataclass(frozen=True)
class StepTiming:
    """One attempt at one step, in seconds. ``committed`` is the vote's outcome; ``error`` is
    this rank's compute error (``Type: message``), if it had one."""

    step: int
    attempt: int
    boundary: float
    compute: float
    vote: float
    apply: float
    committed: bool
    error: str | None = None
    #: what the boundary hook decided before this attempt (``switch-groups`` marks the step
    #: whose ``boundary`` holds a migration's phase 2)
    action: str = "continue"


class Runtime:
    """Runs a job step by step (see the module docstring).

    ``max_attempts`` bounds how often one step is tried before :class:`StepFailed`;
    ``keep_timings`` how many :class:`StepTiming` records :attr:`timings` keeps (the newest);
    every ``log_every`` committed steps a line says so (0: never).
    """

    def __init__(self, job: TrainingJob, ctx: JobContext, *, hook: BoundaryHook | None = None,
                 max_attempts: int = 3, keep_timings: int = 100_000, log_every: int = 50,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.job = job
        self.ctx = ctx
        self.hook: BoundaryHook = hook or NoMigration()
        self.max_attempts = max_attempts
        self.log_every = log_every
        self.timings: deque[StepTiming] = deque(maxlen=keep_timings)
        #: The next step to run: the number of committed steps.
        self.step = 0
        #: Attempts that the vote rejected, over the runtime's life.
        self.redone = 0
        self._clock = clock
        self._built = False
        self._last_error: str | None = None  # this rank's compute error in the last attempt
        #: said in the log with the next committed step (the end of a recovery's downtime)
        self.announce: str | None = None
        #: called with the runtime after every committed step (snapshots)
        self.after_commit: list[Callable[[Runtime], None]] = []
        #: this rank handed its last committed step off with its state (``before_apply``
        #: said so): it left the run, its own state one step behind
        self.left = False
        #: a step computed here whose vote aborted: (step, RNG before compute, RNG after)
        self.pending: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        self._log = logs.get("understudy.worker", job=ctx.job, rank=ctx.rank)

    def build(self) -> None:
        """``job.build(ctx)``; call it once, before :meth:`load_state` or :meth:`run`."""
        if self._built:
            raise RuntimeError("the job is built already")
        self.job.build(self.ctx)
        self._built = True

    def state(self) -> dict[str, Any]:
        """The job's state, the process-global RNG states and the runtime's counters."""
        self._require_built()
        return self._with_counters(self.job.state())

    def replica_state(self, rank: int) -> dict[str, Any]:
        """:meth:`state` as data-parallel peer ``rank`` would give it (the job's
        :meth:`~understudy.worker.api.TrainingJob.replica_state`): what a recovery's donor
        sends the lost rank's replacement. The RNG states are this rank's: a job that
        recovers from a replica re-keys them to the step (``reseed``).

        Raises:
            ValueError: the job keeps no copy of ``rank``'s state here.
        """
        self._require_built()
        return self._with_counters(self.job.replica_state(rank))

    def _with_counters(self, job_state: dict[str, Any]) -> dict[str, Any]:
        return {"job": job_state, "rng": rng.capture(),
                "runtime": {"step": self.step, "redone": self.redone}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Take a state :meth:`state` returned, on this rank or one with the same role.

        Raises:
            ValueError: ``state`` lacks one of its parts.
        """
        self._require_built()
        missing = {"job", "rng", "runtime"} - state.keys()
        if missing:
            raise ValueError(f"runtime state lacks {sorted(missing)} (keys: {sorted(state)})")
        self.job.load_state(state["job"])
        rng.restore(state["rng"])  # last: the job's loading must not shift the generators
        self.step = int(state["runtime"]["step"])
        self.redone = int(state["runtime"]["redone"])

    def replay(self, step: int, inputs: dict[str, Any]) -> None:
        """A joiner following its leaver: apply ``step`` as the leaver committed it, from its
        apply inputs (:meth:`~understudy.worker.api.TrainingJob.apply_inputs`).

        Raises:
            ValueError: ``step`` is not the next step to apply here.
        """
        self._next_to_replay(step)
        self.job.load_apply_inputs(step, inputs)
        self.job.apply(step)
        self.step = step + 1

    def replay_landing(self, step: int, inputs: dict[str, Any], landing: Landing) -> None:
        """:meth:`replay` from apply inputs still landing (``landing``), on a thread of the
        joiner's own, for a job that implements
        :meth:`~understudy.worker.api.TrainingJob.apply_landing`.

        Raises:
            ValueError: ``step`` is not the next step to apply here.
            TransferError: the transfer failed (from ``landing``).
        """
        self._next_to_replay(step)
        self.job.apply_landing(step, inputs, landing)
        self.step = step + 1

    def _next_to_replay(self, step: int) -> None:
        self._require_built()
        if step != self.step:
            raise ValueError(f"step {step} cannot be replayed here: the next step is "
                             f"{self.step}")

    def load_counters(self, rng_state: dict[str, Any], counters: dict[str, Any]) -> None:
        """A joiner at the switch, its job's state already exact: take the leaver's RNG states
        and counters (the ``rng`` and ``runtime`` parts of :meth:`state`).

        Raises:
            ValueError: the leaver has committed a different number of steps than this runtime
                has applied.
        """
        self._require_built()
        if int(counters["step"]) != self.step:
            raise ValueError(f"the leaver has committed {counters['step']} steps, this "
                             f"joiner applied {self.step}")
        rng.restore(rng_state)
        self.redone = int(counters["redone"])

    def run(self, steps: int) -> Outcome:
        """Run until ``steps`` steps are committed, the hook stops the loop, or this rank hands
        its state off.

        Raises:
            CollectiveAborted: a collective of the step aborted; the step is rolled back.
            StepFailed: the vote rejected the same step ``max_attempts`` times.
        """
        self._require_built()
        attempt = 0
        while self.step < steps:
            step = self.step
            t0 = self._clock()
            action = self.hook.on_boundary(step)
            if action is Action.STOP:
                self._log.info("the boundary hook stopped the run", step=step)
                return Outcome.STOPPED
            if action is Action.HAND_OFF:
                if self.hook.hand_off(step, self.state()):
                    self._log.info("this rank handed its state off and leaves the run",
                                   step=step)
                    return Outcome.HANDED_OFF
                self._log.info("the hand-off was called off; this rank keeps training",
                               step=step)
            if action is Action.SEND_AHEAD:
                self.hook.send_ahead(step, self.state())  # type: ignore[attr-defined]
            if action is Action.SWITCH_GROUPS:
                self.hook.switch_groups(step)
                self._log.info("switched to the groups' next versions", step=step)
            failpoints.hit(f"rank.step.{step}")  # a fault test's rank that hangs here
            attempt += 1
            if self._attempt(step, attempt, t0, action.value):
                attempt = 0
                if self.left:
                    return Outcome.HANDED_OFF
            elif attempt >= self.max_attempts:
                last = self._last_error
                mine = (f"this rank's last error was {last}" if last else
                        "this rank computed it; another rank failed (see its logs)")
                raise StepFailed(f"step {step} failed its vote {attempt} times in a row; {mine}",
                                 step=step, attempts=attempt)
        return Outcome.COMPLETED

    def reshape(self, ctx: JobContext) -> None:
        """Take ``ctx``, this rank's new place after its job's data parallelism changed shape
        (:mod:`understudy.worker.reshape`), at a step boundary: the next step computes the
        slots ``ctx.held_slots`` names, on the groups ``ctx`` reaches. The job's own ``ctx``
        attribute, where it keeps one, is replaced too (a slotted job reads its held slots
        there). Only a :class:`~understudy.worker.api.SlottedJob` can: its arithmetic does not
        depend on the number of replicas; any other job's would change.

        Raises:
            ValueError: the job is not slotted, or ``ctx`` changes more than the data-parallel
                shape (the job, seed, TP or PP degree, slot count, or this rank's TP index or
                stage, which its random streams are keyed by).
            RuntimeError: a step is pending (settle first), or the job is not built.
        """
        self._require_built()
        refusal = self.reshape_refusal(ctx)
        if refusal is not None:
            raise ValueError(refusal)
        if self.pending is not None:
            raise RuntimeError(f"step {self.pending[0]} is pending: settle it before a reshape")
        self._take(ctx)

    def _take(self, ctx: JobContext) -> None:
        old = self.ctx
        self.ctx = ctx
        if getattr(self.job, "ctx", None) is old:
            self.job.ctx = ctx  # type: ignore[attr-defined]
        self._log = logs.get("understudy.worker", job=ctx.job, rank=ctx.rank)
        self._log.info("Took a new place in the job.", step=self.step, dp=ctx.dp,
                       dp_index=ctx.dp_index, slots=list(ctx.held_slots), pp=ctx.pp,
                       stage=ctx.pp_index, was_rank=old.rank, was_dp=old.dp, was_pp=old.pp)

    def restage(self, ctx: JobContext, units: dict[int, Any], step: int) -> None:
        """Take ``ctx``, this rank's place after its job's number of pipeline stages changed
        (:mod:`understudy.worker.restage`), at a step boundary, ``step`` steps committed: the
        job keeps the units of state it still holds, takes ``units`` (those that came from
        other ranks) and drops the rest (:meth:`SlottedJob.restage`). A rank new to the job
        (built for ``ctx``, nothing committed) takes the step count too.

        Raises:
            ValueError: as :meth:`restage_refusal`: nothing changed.
            RuntimeError: a step is pending, the job is not built, or this rank has committed
                another number of steps than ``step``.
        """
        self._require_built()
        refusal = self.restage_refusal(ctx)
        if refusal is not None:
            raise ValueError(refusal)
        if self.pending is not None:
            raise RuntimeError(f"step {self.pending[0]} is pending: settle it before a reshape")
        if self.step not in (0, step):
            raise RuntimeError(f"this rank has committed {self.step} steps, the reshape is at "
                               f"{step}")
        assert restages(self.job)
        self.job.restage(ctx, units, step)
        self.step = step
        self._take(ctx)

    def restage_refusal(self, ctx: JobContext) -> str | None:
        """Why :meth:`restage` would refuse ``ctx`` (None: it would not), checked before any
        unit moves or any group of the new shape is built: the job cannot move its layers
        between stages, ``ctx`` changes more than the pipeline (the job, seed, TP degree or
        index, slot count, data-parallel size or place), or the job cannot be laid out on it."""
        if not restages(self.job):
            return (f"{type(self.job).__name__} cannot move its layers between pipeline stages "
                    "(a SlottedJob that implements stage_units can)")
        changed = self._changed(ctx, ("job", "seed", "tp", "data_slots", "tp_index", "dp",
                                      "dp_index"))
        if changed:
            return f"a pipeline reshape changes the number of stages only; this one {changed}"
        try:
            self.job.stage_units(ctx)
        except ValueError as exc:
            return str(exc)
        return None

    def rebind(self, ctx: JobContext) -> None:
        """Take ``ctx`` as this runtime's context, its log lines naming ``ctx``'s rank: a
        standby's job retargeted to another rank (``sandbox.warmup``) already took it."""
        self.ctx = ctx
        self._log = logs.get("understudy.worker", job=ctx.job, rank=ctx.rank)

    def reshape_refusal(self, ctx: JobContext) -> str | None:
        """Why :meth:`reshape` would refuse ``ctx`` (None: it would not), checked before any
        group of the new shape is built."""
        if not slotted(self.job):
            return (f"{type(self.job).__name__} is not a SlottedJob: only a job that trains "
                    "data-parallel slots keeps its results when the number of replicas changes")
        changed = self._changed(ctx, ("job", "seed", "tp", "pp", "data_slots", "tp_index",
                                      "pp_index"))
        if changed:
            return f"a reshape changes the data-parallel shape only; this one {changed}"
        return None

    def _changed(self, ctx: JobContext, kept: tuple[str, ...]) -> str:
        """The words "also changes a, b" for the fields of ``kept`` that ``ctx`` changes;
        empty if none."""
        changed = [k for k in kept if getattr(ctx, k) != getattr(self.ctx, k)]
        return f"also changes {', '.join(changed)}" if changed else ""

    def settle(self, committed: int) -> None:
        """After an abort, take the survivors' word: ``committed`` steps are committed (the
        most advanced survivor's count). Applies or discards a pending step to match.

        Raises:
            RuntimeError: this rank cannot reach ``committed`` (it is more than the pending
                step away, or ahead of it): the survivors' reports are inconsistent.
        """
        self._require_built()
        pending, self.pending = self.pending, None
        if pending is not None:
            step, before, after = pending
            if committed == step + 1:
                rng.restore(after)
                self.job.apply(step)
                self.step = step + 1
                self._log.info("applied the step whose vote aborted: a peer committed it",
                               step=step)
            else:
                self._roll_back(step, before)
        if self.step != committed:
            raise RuntimeError(f"this rank has committed {self.step} steps and cannot settle "
                               f"on {committed}")

    def _attempt(self, step: int, attempt: int, t0: float, action: str = "continue") -> bool:
        """Run ``step`` once; True if it was committed."""
        if self.pending is not None:
            raise RuntimeError(f"step {self.pending[0]} is pending: call settle() first")
        if reseeds(self.job):  # looked up each time: a promoted standby's job is swapped in
            self.job.reseed(step)
        before = rng.capture()
        t1 = self._clock()
        error: Exception | None = None
        wire: Tripwire | None = None
        try:
            if interrupts(self.job) and self.ctx.aborts:
                with interruptible(self.ctx.should_abort, poll_s=self.ctx.poll_interval) as wire:
                    compute(self.job, self.ctx, step)
                if wire.tripped:
                    # The job caught the interruption and went on: what it computed is not the
                    # step. No vote: a peer could commit the step with this rank's gradients.
                    raise ComputeInterrupted("compute stopped: the job is recovering (the job "
                                             "caught the interruption)",
                                             what="the step's compute")
            else:
                compute(self.job, self.ctx, step)
        except CollectiveAborted:
            self._roll_back(step, before)
            raise
        except Exception as exc:  # any failure of user code is this rank's "no" (style #6)
            if wire is not None and wire.tripped:  # the job caught the interruption and raised
                self._roll_back(step, before)
                raise ComputeInterrupted(f"compute stopped: the job is recovering (the job "
                                         f"raised {type(exc).__name__}: {exc})",
                                         what="the step's compute") from exc
            error = exc
            self._log.warning("compute failed on this rank; voting no", step=step,
                              attempt=attempt, error=f"{type(exc).__name__}: {exc}")
        t2 = self._clock()
        try:
            committed = self._vote(ok=error is None, step=step)
        except CollectiveAborted:
            if error is None:  # a peer may have committed it: keep it (see settle)
                self.pending = (step, before, rng.capture())
            else:
                self._roll_back(step, before)
            raise
        t3 = self._clock()
        if committed:
            if self._before_apply(step):
                # The joiner took this step's inputs with the rank: this rank leaves without
                # the update (its state is nobody's now; run() ends HANDED_OFF).
                self.job.handed_off(step)
                self.step = step + 1
                self.left = True
                self._log.info("this rank handed the committed step off with its state and "
                               "leaves the run", step=step)
            else:
                self.job.apply(step)
                self.step = step + 1
                if self.log_every and self.step % self.log_every == 0:
                    self._log.info(f"{self.step} steps committed on rank {self.ctx.rank}")
                if self.announce is not None:
                    self._log.info(f"{self.announce}: step {step} committed on rank "
                                   f"{self.ctx.rank}.", step=step)
                    self.announce = None
                for callback in self.after_commit:
                    callback(self)
        else:
            self._roll_back(step, before)
            self.redone += 1
            self._log.warning("the vote failed; the step will be redone", step=step,
                              attempt=attempt)
        t4 = self._clock()
        self._last_error = None if error is None else f"{type(error).__name__}: {error}"
        self.timings.append(StepTiming(
            step=step, attempt=attempt, boundary=t1 - t0, compute=t2 - t1, vote=t3 - t2,
            apply=t4 - t3, committed=committed, error=self._last_error, action=action))
        return committed

    def _before_apply(self, step: int) -> bool:
        """The hook's ``before_apply``, if it has one: True if this rank leaves without
        applying ``step``. A hook written for the two-argument form (step, job) still works."""
        before_apply = getattr(self.hook, "before_apply", None)
        if before_apply is None:
            return False
        method = getattr(before_apply, "__func__", None)  # its signature asked once, not each step
        takes_after = (_positional(method) >= 4 if method is not None  # (self, step, job, after)
                       else len(inspect.signature(before_apply).parameters) >= 3)
        if not takes_after:
            before_apply(step, self.job)
            return False
        return bool(before_apply(step, self.job, {"step": step + 1, "redone": self.redone}))

    def _vote(self, *, ok: bool, step: int) -> bool:
        # One all-reduce carries the commit decision and the hook's flag: MIN of [ok, f, -f]
        # gives min(ok), min(f) and -max(f); the flag counts only if every rank gave the same.
        flag = self.hook.vote_flag(step)
        votes = torch.tensor([1 if ok else 0, flag, -flag], dtype=torch.int64,
                             device=self.ctx.device)
        work = self.ctx.group("world").allreduce([votes], allreduce_options(dist.ReduceOp.MIN))
        self.ctx.wait(work, f"the vote on step {step}")
        low, high = int(votes[1]), -int(votes[2])
        self.hook.on_vote(step, low if low == high else 0)
        return bool(votes[0])

    def _roll_back(self, step: int, before: dict[str, Any]) -> None:
        self.job.discard(step)
        rng.restore(before)

    def _require_built(self) -> None:
        if not self._built:
            raise RuntimeError("call Runtime.build() first")


@functools.cache
def _positional(fn: Callable[..., Any]) -> int:
    """How many parameters ``fn`` takes (a hook's method, self included), asked once."""
    return len(inspect.signature(fn).parameters)


def compute(job: TrainingJob, ctx: JobContext, step: int) -> float | None:
    """The compute of ``step``: ``job.compute(step)``, or for a
    :class:`~understudy.worker.api.SlottedJob` its slots and their canonical sum
    (:func:`understudy.worker.slots.compute_step`; no loss returned)."""
    if slotted(job):
        slots.compute_step(job, ctx, step)
        return None
    return job.compute(step)


class StaticGroups:
    """The job's groups built once, as standalone gloo groups bootstrapped through ``store``
    (no default process group needed). Each group's keys live under ``prefix/<name><index>``,
    where the index tells apart the groups of one name (``tp0``, ``tp1``...). Versions never
    change: for jobs without migrations, and for tests.

    Every rank of the job must construct it at the same time; it blocks until each of the
    rank's groups is connected, or ``timeout`` (which then also bounds every collective).
    """

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, tp: int,
                 timeout: float = 60.0, prefix: str = "understudy/groups", pp: int = 1) -> None:
        layout = Layout(world_size, tp, pp)
        self._groups: dict[str, Communicator] = {}
        # The same order on every rank, so that no two ranks wait crosswise.
        for name, concrete in layout.concrete(rank).items():
            ranks = layout.group_ranks(name, rank)
            index = concrete.rpartition("-")[2] if "-" in concrete else "0"
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/{name}{index}", store),
                                       ranks.index(rank), len(ranks), timedelta(seconds=timeout))
            # torch's stubs do not declare a backend's collectives; it has them at run time.
            self._groups[name] = cast(Communicator, pg)

    def close(self) -> None:
        """Release the groups now, while the interpreter is whole. Left to the interpreter's
        teardown, a gloo group sometimes ends the process with SIGABRT ("terminate called
        without an active exception") once its peers have exited: 3 of 54 two-rank runs of the
        example here. Using a group afterwards raises ValueError."""
        self._groups.clear()

    def current(self, name: str) -> Communicator:
        """Group ``name`` of this rank.

        Raises:
            ValueError: ``name`` is not one of the job's groups.
        """
        try:
            return self._groups[name]
        except KeyError:
            raise ValueError(f"unknown group {name!r}: this job's groups are "
                             f"{', '.join(self._groups)}") from None
