"""The contract between a training script and the understudy worker runtime.

A training script implements :class:`TrainingJob`: six methods, and the runtime
(:mod:`understudy.worker.runtime`) owns the loop around them. It splits every step in two, and
votes in between, so that a step applies on every rank or on none::

    build(ctx)                         once: the model and optimizer, from the context
    loop, at each iteration boundary:  (the migration protocol may act here)
        compute(step)                  forward, backward, gradient synchronisation
        -- vote: did every rank's compute succeed? --
        apply(step)                    yes: the optimizer step; the step is committed
        discard(step)                  no: drop the gradients; the step is run again
    state() / load_state(state)        the rank's full state, to hand to a standby
    apply_inputs / load_apply_inputs   optional: what apply takes from compute, so that a
                                       joiner follows its leaver step by step (below)
    handed_off                         optional with them: what a leaver does instead of
                                       apply for the step its joiner took (default: apply)
    apply_landing                      optional with them: the joiner applies a step while
                                       its inputs land
    compute_slot / gradients           instead of compute, in a SlottedJob: the runtime owns
                                       the data-parallel sum, by slots (below)

A minimal data-parallel job (``examples/plain_torch/train.py`` adds tensor parallelism)::

    class Job(TrainingJob):
        def build(self, ctx: JobContext) -> None:
            self.ctx = ctx
            torch.manual_seed(ctx.seed)
            self.model = torch.nn.Linear(8, 1)
            self.opt = torch.optim.Adam(self.model.parameters())

        def compute(self, step: int) -> float:
            x, y = batch(self.ctx.seed, step, self.ctx.dp_index)  # the data position is the step
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in self.model.parameters()])
            sum_ = allreduce_options(dist.ReduceOp.SUM)
            self.ctx.wait(self.ctx.group("dp").allreduce([flat], sum_), "the DP all-reduce")
            ...  # copy flat / ctx.dp back into the gradients
            return loss.item()

        def apply(self, step: int) -> None:
            self.opt.step()

        def discard(self, step: int) -> None:
            self.opt.zero_grad()

        def state(self) -> dict[str, Any]:
            return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

        def load_state(self, state: dict[str, Any]) -> None:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])

    # On each rank (the runtime keeps the step counter and the process-global RNG states):
    groups = StaticGroups(store, rank=rank, world_size=4, tp=1)
    ctx = JobContext(job="demo", rank=rank, world_size=4, tp=1, groups=groups)
    runtime = Runtime(Job(), ctx)
    runtime.build()
    runtime.run(steps=1000)

**Rule: fetch groups at call time.** ``ctx.group("dp")`` returns the group's *current* version.
A migration replaces the communicator of every group that contained the leaving rank, at an
iteration boundary; a job that calls ``ctx.group(name)`` inside ``compute`` uses the new version
without noticing. A job that keeps a group from ``build`` keeps talking to the old one, which
hangs or fails. (Megatron-core modules hold their groups; their adapter deals with that.)

**A planned migration off the critical path (opt-in).** A job that implements
``apply_inputs`` and ``load_apply_inputs`` (the plain-torch example does) has its leaver send
its state while training goes on, during one step's compute (which must not change the state,
as for every job), then each committed step's apply inputs; its joiner applies each step as the
leaver did. The last step's inputs carry the RNG states and the step counters, and the leaver
leaves once its joiner holds them, calling ``handed_off`` rather than ``apply`` for that step
(the joiner applies it), so that the switch waits for no apply of the leaver's and the
joiner's last apply overlaps the survivors' own. A job that also implements
``apply_landing`` (the example's ``--hand-off landing``) applies each step on the joiner *as
its inputs land*, a range at a time, so that even that apply runs alongside the transfer: on a
GPU, where the apply does not take the transfer's CPU, the switch then waits for neither. A
job without them hands its whole state off at the switch, as before.

**Data-parallel slots (opt-in).** A :class:`SlottedJob` trains ``ctx.data_slots`` slots, its
DP degree at submission, on however many replicas it has: the runtime computes each slot the
rank's replica holds and sums the slots' gradients in slot order (:mod:`understudy.worker.
slots`), so the run is the same bit for bit on any number of replicas.

**Layout.** Ranks form a TP x DP x PP grid, TP fastest, PP slowest:
``rank = (pp_index * dp + dp_index) * tp + tp_index`` (:mod:`understudy.common.layout`). A TP
group is ``tp`` consecutive ranks; a DP group takes every ``tp``-th rank of one stage; a PP group
(``pp >= 2`` only) takes one rank of each stage, and :mod:`understudy.worker.pipeline` runs the
micro-batch schedule over it.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import torch
import torch.distributed as dist

from understudy.common.errors import UnderstudyError
from understudy.common.layout import LOGICAL, Layout
from understudy.groups import abortable
from understudy.groups.abortable import Work as Work
from understudy.groups.errors import CollectiveAborted as CollectiveAborted
from understudy.worker.slots import held

#: The groups a job can have. ``world`` is every rank of the job; ``pp`` (the stages of one
#: pipeline) exists only with pipeline parallelism.
GROUP_NAMES = LOGICAL


class TrainingError(UnderstudyError):
    """Base of the errors the worker runtime raises on purpose."""


class Communicator(Protocol):
    """A process group as this API uses it: a ``torch.distributed.ProcessGroup``, or a
    standalone backend such as ``ProcessGroupGloo`` (which needs no default group).

    Ranks are the group's own, from 0 to ``size() - 1``; point-to-point calls address peers by
    group rank. Jobs may call any collective the object has; this lists what the runtime uses.
    """

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> Any: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any: ...


class GroupsProvider(Protocol):
    """Hands out the current version of each of the job's groups."""

    def current(self, name: str) -> Communicator:
        """The current version of group ``name`` (one of :data:`GROUP_NAMES`) of this rank.

        Raises:
            ValueError: ``name`` is not a group of the job.
        """
        ...


def _never() -> bool:
    return False


def allreduce_options(op: Any) -> dist.AllreduceOptions:
    """Options for ``allreduce(tensors, opts)`` with reduction ``op`` (``dist.ReduceOp.SUM``,
    ``MIN``...): the form that both process groups and standalone backends take."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(op)
    return opts


@dataclass(frozen=True)
class JobContext:
    """What a job learns about its place in the run, and how it reaches its peers.

    ``collective_timeout`` bounds every :meth:`wait` (seconds); ``should_abort`` is polled every
    ``poll_interval`` seconds while waiting, and a true answer releases the wait at once (the
    daemon's word that a peer is gone). Both must be cheap and must not raise.
    """

    job: str
    rank: int
    world_size: int
    tp: int
    groups: GroupsProvider
    seed: int = 0
    pp: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    collective_timeout: float = 60.0
    poll_interval: float = 0.05
    should_abort: Callable[[], bool] = _never
    #: the job's data-parallel slots (:class:`SlottedJob`): its DP degree at submission, which
    #: stays when the physical one changes; 0: as many as there are replicas
    slots: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        dp = Layout(self.world_size, self.tp, self.pp).dp  # raises on a tp or pp that misfits
        if self.slots and self.slots < dp:
            raise ValueError(f"{self.slots} data-parallel slots cannot fill {dp} replicas: "
                             "each replica holds one slot at least")
        if self.collective_timeout <= 0 or self.poll_interval <= 0:
            raise ValueError(f"collective_timeout ({self.collective_timeout}) and poll_interval "
                             f"({self.poll_interval}) must be positive")

    @property
    def aborts(self) -> bool:
        """Whether anything tells this rank to abort (``should_abort`` was given)."""
        return self.should_abort is not _never

    @property
    def layout(self) -> Layout:
        """Raises: ValueError: ``tp * pp`` does not divide the world."""
        return Layout(self.world_size, self.tp, self.pp)

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def data_slots(self) -> int:
        """The job's data-parallel slots: :attr:`slots`, or the DP degree when it is 0."""
        return self.slots or self.dp

    @property
    def held_slots(self) -> range:
        """The slots this rank's replica computes each step (:func:`understudy.worker.slots.held`:
        a contiguous block, the same for every rank of the replica)."""
        return held(self.data_slots, self.dp, self.dp_index)

    @property
    def tp_index(self) -> int:
        """This rank's place in its TP group (its group rank there)."""
        return self.rank % self.tp

    @property
    def dp_index(self) -> int:
        """This rank's place in its DP group: which data-parallel replica it belongs to."""
        return self.layout.coordinates(self.rank)[1]

    @property
    def pp_index(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return self.layout.coordinates(self.rank)[2]

    @property
    def first_stage(self) -> bool:
        return self.pp_index == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_index == self.pp - 1

    def group(self, name: str) -> Communicator:
        """The current version of group ``name``: call it at each use, do not keep the result
        (see the module docstring).

        Raises:
            ValueError: ``name`` is not a group of the job.
        """
        return self.groups.current(name)

    def wait(self, work: Work, what: str, timeout: float | None = None) -> None:
        """Wait for an asynchronous collective, abortably (see :func:`wait_abortable`).

        ``timeout`` defaults to ``collective_timeout``. Every wait is also a place where a
        step stops: a collective issued once the job is recovering (``should_abort()``, a peer
        is known to be gone) is not waited for at all. So a survivor whose own collectives still
        complete (the other replica of a TP x DP job, its TP pair intact) stops at its next one
        instead of computing on to the step's end first: at 1 GiB of state per rank here, a
        step's compute of 9 s would otherwise delay the whole recovery by whatever was left of
        it.

        Raises:
            CollectiveAborted: as :func:`wait_abortable`, or at once while the job recovers.
        """
        if self.should_abort():
            raise CollectiveAborted(f"{what} not waited for: the job is recovering", what=what)
        wait_abortable(work, what=what,
                       timeout=self.collective_timeout if timeout is None else timeout,
                       should_abort=self.should_abort, poll_interval=self.poll_interval)


def wait_abortable(work: Work, *, what: str, timeout: float, should_abort: Callable[[], bool],
                   poll_interval: float = 0.05,
                   clock: Callable[[], float] = time.monotonic) -> None:
    """Wait for ``work`` in slices of ``poll_interval`` seconds; between slices, give up if
    ``should_abort()`` or if ``timeout`` seconds have passed. Returns as soon as the work
    completes, not at the end of a slice.

    A frozen peer sends no reset, so a blocking wait would last the communicator's own timeout
    (30 minutes by default); this one lasts ``timeout`` at most, plus one slice. The collective
    itself is not cancelled: the group must not be used again.

    Raises:
        CollectiveAborted: the collective failed, timed out or was aborted; chained from the
            communicator's error when it failed (``groups/abortable.py``).
    """
    abortable.wait(work, abort=should_abort, timeout=timeout, slice_s=poll_interval, what=what,
                   clock=clock)


class TrainingJob(abc.ABC):
    """A training script, split where the runtime needs to see it. All methods run on the
    runtime's thread, one at a time.

    Compute must be repeatable: when the vote fails, the runtime calls :meth:`discard` and then
    ``compute(step)`` again, and the second attempt must do what the first would have. The
    runtime restores the process-global RNGs (see :mod:`understudy.worker.rng`) before the
    second attempt; anything else ``compute`` consumes (batches, private generators) must be
    derived from the step or rewound by :meth:`discard`. An exception from ``compute`` fails the
    step on every rank (the runtime records it and votes no); it must not be raised while a peer
    still waits in one of this rank's collectives, or that peer waits until its timeout.
    """

    #: Opt in to having ``compute`` stopped at its next autograd operation (forward or
    #: backward) once the job is recovering, rather than at its next collective
    #: (:mod:`understudy.worker.interrupt`): the survivors of a failure then stop within one
    #: operation, however far their next collective is. The job must bear an exception at any
    #: tensor operation its compute records for autograd; :meth:`discard` is called after it.
    interruptible: bool = False

    #: Opt in to training on this worker's GPU under the daemons: the launcher makes
    #: ``LOCAL_RANK``'s GPU (the node slot the daemon gave the process, modulo the GPUs there
    #: are) the current device before the job is built, and each of the job's groups connects
    #: its NCCL communicator there as it is built (a migration's in phase 1, before the
    #: switch), not at its first CUDA collective. ``ctx.device`` stays the CPU (the runtime's
    #: vote goes over gloo). A job that does not opt in places itself (``LOCAL_RANK`` is set
    #: for every worker), and its groups' NCCL communicators, if it uses any, connect lazily.
    gpu: bool = False

    #: Modules the job's build or first steps import lazily, which a standby worker imports
    #: while it waits to be chosen, before it reports ``imports`` warmth: none of that import
    #: then falls between being chosen and taking over. By default ``torch._dynamo``, which the
    #: constructor of any ``torch.optim`` optimizer pulls in (about 1.3 CPU-s, and 0.5 more at
    #: the process's exit). A job that builds no ``torch.optim`` optimizer (torch's functional
    #: ``adam``, for example) can say ``()``; one whose build imports more lazily (an extension,
    #: a compiler backend) can name it.
    preload: tuple[str, ...] = ("torch._dynamo",)

    @abc.abstractmethod
    def build(self, ctx: JobContext) -> None:
        """Build the model, optimizer and data source for the role ``ctx`` describes."""

    @abc.abstractmethod
    def compute(self, step: int) -> float | None:
        """Forward, backward and gradient synchronisation of ``step``, leaving the gradients
        ready for :meth:`apply`. Returns the loss, or None. Must not change the parameters,
        the optimizer state or anything else :meth:`state` returns."""

    @abc.abstractmethod
    def apply(self, step: int) -> None:
        """Every rank computed ``step``: apply it (optimizer step, schedule step)."""

    @abc.abstractmethod
    def discard(self, step: int) -> None:
        """Some rank failed ``step``: drop what :meth:`compute` left (gradients) so that it can
        run again."""

    @abc.abstractmethod
    def state(self) -> dict[str, Any]:
        """This rank's full training state, after the last committed step: parameters,
        optimizer, schedule, data position, and RNGs the job owns beyond the process-global
        ones. Tensors may be the live ones; the caller is done with them before the next step.

        What it may hold (what a joiner loads from its peer, ``worker/safe_unpickle.py``, and
        what ``torch.load(weights_only=True)`` loads for the snapshots): dense tensors in
        dicts, lists and tuples; ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``,
        ``str``, ``bytes``, ``bytearray``, ``int``, ``float``, ``bool``, ``None``, ``complex``,
        ``collections.OrderedDict``, ``torch.Size``, ``torch.device`` and torch dtypes. So
        ``module.state_dict()``, ``optimizer.state_dict()``, an LR scheduler's or a grad
        scaler's ``state_dict()`` all fit; a namedtuple, a dataclass or a numpy array does not
        (a migration of such a state is called off, with a sentence naming the type).
        """

    @abc.abstractmethod
    def load_state(self, state: dict[str, Any]) -> None:
        """Take a state :meth:`state` returned on a rank with the same role. Called after
        :meth:`build`, before the first step."""

    def replica_state(self, rank: int) -> dict[str, Any]:
        """The state that data-parallel peer ``rank`` (same TP index and stage) held after the
        last committed step, as its own :meth:`state` would give it, from what this rank
        holds: the recovery of a lost ``rank`` sends it to the rank's replacement. Default:
        :meth:`state` itself, since the replicas of a job that does not shard its state hold
        the same one. A job that shards its optimizer state over DP overrides it to rebuild a
        peer's shard from a redundant copy (``examples/plain_torch/train.py``, ``ShardedJob``);
        the controller asks the rank after the lost one in the DP group first.

        Raises:
            ValueError: this rank keeps no copy of ``rank``'s state.
        """
        return self.state()

    def retarget(self, ctx: JobContext) -> str | None:
        """Take the role ``ctx`` describes in place of the one this job was built for, keeping
        what fits (a warm standby built as one stage, chosen for another, keeps its blocks and
        allocates only the layers the new stage has in addition). The state is loaded next, so
        values do not matter, only shapes. Returns what was kept and allocated, in words; None
        when the job cannot (then a new job is built: the default).
        """
        return None

    def forget_shadow_steps(self) -> None:
        """The sandbox ran shadow iterations on this job, steps that never happened in the
        run: forget what the job noted about them beyond its state (logged losses, counters).
        The state itself is replaced by :meth:`load_state` before the first real step. Default:
        nothing to forget."""
        return None

    def reseed(self, step: int) -> None:
        """Key this rank's random streams to ``step``: seed the process-global generators (and
        any the job owns whose state differs between data-parallel replicas) from the job's
        seed, this rank's coordinates and ``step`` alone. The runtime calls it before every
        attempt at every step.

        A job that implements it can lose a rank and have it rebuilt from a data-parallel
        replica's state: what the replicas share (parameters, optimizer, schedule, a
        tensor-parallel RNG tracker) travels, and what is the rank's own (its dropout stream)
        follows from the step. A job that does not is not recoverable from a replica.
        """
        raise NotImplementedError(f"{type(self).__name__} does not key its random streams to "
                                  "the step")


    def apply_inputs(self, step: int) -> dict[str, Any]:
        """What :meth:`apply` of ``step`` takes from :meth:`compute`, once the vote committed
        it and before :meth:`apply` runs: the reduced gradients, and anything else apply reads
        that compute left (a loss scale, a found-inf flag). A tree like :meth:`state`'s; tensors
        may be the live ones, and :meth:`apply` must not change them.

        With :meth:`load_apply_inputs` it lets a planned migration move the rank's state off
        the switch's critical path: the leaver sends its state while training goes on, then
        each committed step's inputs, and the joiner applies each step as the leaver did, so
        that only the RNGs and counters cross at the switch. Both or neither; a job that has
        neither hands its whole state off at the switch. ``apply`` must then be a function of
        the state and these inputs alone (no draw from the process-global RNGs).
        """
        raise NotImplementedError(f"{type(self).__name__} does not expose its apply inputs")

    def load_apply_inputs(self, step: int, inputs: dict[str, Any]) -> None:
        """On a joiner following its leaver: put the leaver's :meth:`apply_inputs` of ``step``
        in place, so that :meth:`apply` of ``step``, called next, does what it did there. The
        tensors are the joiner's to keep until the next call (they may become the gradients).
        Side effects of that apply outside the state (a log line per committed step) are the
        leaver's, already done: a job skips them for a step loaded this way."""
        raise NotImplementedError(f"{type(self).__name__} does not load apply inputs")

    def handed_off(self, step: int) -> None:
        """Optional, with :meth:`apply_inputs`: called *instead of* :meth:`apply` on a leaver
        whose joiner took ``step``'s inputs with the rank (the vote agreed the switch after
        it): this process leaves without training again, so the update is wasted work (on a
        shared machine, work the survivors wait for). Do what :meth:`apply` does besides
        changing the state (a log line for the committed step), or nothing. The default
        applies the step, as before."""
        self.apply(step)

    def apply_landing(self, step: int, inputs: dict[str, Any], landing: Landing) -> None:
        """Optional, with :meth:`apply_inputs`: on a joiner following its leaver, apply
        ``step`` from the leaver's apply inputs *while they land*, instead of
        :meth:`load_apply_inputs` and :meth:`apply` once the last byte is through, so that the
        joiner's apply runs alongside the transfer rather than after it. ``inputs`` is the
        tree :meth:`apply_inputs` returned on the leaver, its tensors allocated but not yet
        written: before reading a tensor's elements, wait for them with
        ``landing.wait(tensor)``, or take them in order, a range at a time, with ``for lo, hi
        in landing.pieces(tensor)`` (flat element ranges). It runs on a thread of its own; a
        TransferError from ``landing`` means the transfer failed (let it propagate: the joiner
        then cannot take the rank).

        It must leave the job exactly as :meth:`load_apply_inputs` then :meth:`apply` would,
        bit for bit (an element-wise optimizer such as Adam can be applied range by range),
        keep the tensors as :meth:`load_apply_inputs` does, and not write to them.
        """
        raise NotImplementedError(f"{type(self).__name__} does not apply inputs as they land")


class Landing(Protocol):
    """The apply inputs of a step as they land on a joiner (:meth:`TrainingJob.apply_landing`;
    :class:`understudy.worker.transfer.Landing`)."""

    def pieces(self, tensor: torch.Tensor) -> Iterator[tuple[int, int]]:
        """The flat element ranges ``[lo, hi)`` of ``tensor``, in order and covering it, each
        once it has landed. Raises TransferError: the transfer failed."""
        ...

    def wait(self, tensor: torch.Tensor) -> None:
        """Until all of ``tensor`` has landed. Raises TransferError: the transfer failed."""
        ...


class SlottedJob(TrainingJob):
    """A job whose data parallelism the runtime owns, by slots (opt-in; :mod:`understudy.worker.
    slots`). The job's DP degree at submission is its slot count (``JobContext.data_slots``);
    each step the runtime calls :meth:`compute_slot` for every slot this rank's replica holds,
    in order, with the process-global generators seeded from the slot (never from the replica),
    then puts the sum of every slot's gradients, added in slot order, into the tensors
    :meth:`gradients` returns. :meth:`apply` follows as for any job. So the run is the same bit
    for bit whatever the number of physical replicas: a job that draws its micro-batch from
    ``slot`` and scales its loss by ``1 / ctx.data_slots`` (for the mean) trains identically on
    DP 4, 2 or 1. :meth:`compute` is not called.

    A slotted job does no data-parallel collective of its own (tensor- and pipeline-parallel
    ones as usual), and its random streams beyond the process-global ones must follow from the
    step and the slot. ``reseed`` is the runtime's (per slot), so a slotted rank can always be
    rebuilt from a data-parallel replica's state.
    """

    def compute(self, step: int) -> float | None:
        raise TypeError(f"{type(self).__name__} is a SlottedJob: the runtime calls "
                        "compute_slot for each of its slots, never compute")

    @abc.abstractmethod
    def compute_slot(self, step: int, slot: int) -> float | None:
        """Forward and backward of ``slot``'s micro-batch of ``step``, from zeroed gradients
        (zero them first), leaving the slot's gradients in :meth:`gradients`. Returns the
        slot's loss, or None. Must not change the state."""

    @abc.abstractmethod
    def gradients(self) -> list[torch.Tensor]:
        """The gradient tensors (``[p.grad for p in params]``), the same ones after every
        :meth:`compute_slot`: the runtime reads each slot's from them and writes the sum over
        every slot into them before :meth:`apply`."""

    def reseed(self, step: int) -> None:
        return None  # the runtime seeds the generators for each slot (slots.slot_seed)

    def summed_slots(self, dp: int, replica: int) -> Sequence[int] | None:
        """The slots whose chunks of the summed gradient (``slots.chunk(numel, slots, x)`` of
        the flat gradients) replica ``replica`` of ``dp`` reads in :meth:`apply`; None (the
        default): the whole sum, on every replica. A job that shards its state by slot (it
        updates only the chunks of the slots it keeps) names them: the sum then stops at those
        chunks, each sent only to the replicas that want it, and the rest of
        :meth:`gradients` is left stale. The same answer on every replica."""
        return None

    # A job whose layers can move between pipeline stages (opt-in; worker/restage.py).

    def stage_units(self, ctx: JobContext) -> Sequence[int] | None:
        """The units of state (whole layers, with their optimizer state) that the rank
        ``ctx`` describes holds, numbered by the job from 0 in model order; None (the
        default): the job's layers cannot move between stages. A job that answers can change
        its number of pipeline stages at a step boundary (:mod:`understudy.worker.restage`):
        the runtime moves each unit whose stage changes, whole, from the rank that held it to
        the one that will (:meth:`unit_state`, :meth:`empty_unit`), then calls
        :meth:`restage`. Its arithmetic must not depend on the stage a layer runs on: its
        random streams keyed by the layer, not the stage; the micro-batch count kept.

        Raises:
            ValueError: the job cannot be laid out on ``ctx`` (its layers do not split over
                ``ctx.pp`` stages, its streams are keyed by the stage): a reshape to it is
                refused before anything moves.
        """
        return None

    def unit_state(self, unit: int) -> torch.Tensor:
        """Unit ``unit``'s state on this rank, which holds it, as one 1-D tensor (its values
        and optimizer state), the size and dtype of :meth:`empty_unit`'s."""
        raise NotImplementedError(f"{type(self).__name__} does not move units between stages")

    def empty_unit(self, unit: int) -> torch.Tensor:
        """A tensor to receive unit ``unit``'s :meth:`unit_state` into."""
        raise NotImplementedError(f"{type(self).__name__} does not move units between stages")

    def restage(self, ctx: JobContext, units: dict[int, torch.Tensor], step: int) -> None:
        """Become the rank ``ctx`` describes, ``step`` steps committed: keep the units this
        rank holds that ``stage_units(ctx)`` names, take ``units`` (the others it names, as
        :meth:`unit_state` gave them on the ranks that held them), drop the rest. On a rank
        new to the job (built for ``ctx``, nothing trained) every unit comes in ``units``."""
        raise NotImplementedError(f"{type(self).__name__} does not move units between stages")


def slotted(job: TrainingJob) -> TypeGuard[SlottedJob]:
    """Whether the runtime computes ``job``'s steps slot by slot (:class:`SlottedJob`)."""
    return isinstance(job, SlottedJob)


def restages(job: TrainingJob) -> TypeGuard[SlottedJob]:
    """Whether ``job``'s layers can move between pipeline stages (a :class:`SlottedJob` that
    implements :meth:`SlottedJob.stage_units`)."""
    return slotted(job) and type(job).stage_units is not SlottedJob.stage_units


def reseeds(job: TrainingJob) -> bool:
    """Whether ``job`` implements :meth:`TrainingJob.reseed`."""
    return type(job).reseed is not TrainingJob.reseed


def interrupts(job: TrainingJob) -> bool:
    """Whether ``job``'s compute may be stopped at an autograd operation
    (:attr:`TrainingJob.interruptible`)."""
    return getattr(job, "interruptible", False) is True


def replays(job: TrainingJob) -> bool:
    """Whether ``job`` implements :meth:`TrainingJob.apply_inputs` and
    :meth:`TrainingJob.load_apply_inputs`, so that a joiner can follow its leaver step by
    step."""
    return (type(job).apply_inputs is not TrainingJob.apply_inputs
            and type(job).load_apply_inputs is not TrainingJob.load_apply_inputs)


def applies_landing(job: TrainingJob) -> bool:
    """Whether ``job`` replays (:func:`replays`) and implements
    :meth:`TrainingJob.apply_landing`, so that a joiner applies each step as its inputs land."""
    return replays(job) and type(job).apply_landing is not TrainingJob.apply_landing
