"""Live reshape: a slotted job's data parallelism changes size at a step boundary, and every
rank keeps its state in memory (issue 16; the design is ``docs/reshape.md``).

A job's *shape* is the ordered list of its physical data-parallel replicas: replica ``d`` of the
shape holds the slots ``held(slots, dp, d)`` and its ranks are ``layout.rank_of(t, d, s)`` for
each TP index ``t`` and stage ``s``. A reshape goes from one shape to the next at a step that
every rank of both has committed:

* a replica in both shapes keeps its state and its processes; its ranks may be renumbered
  (a replica before it left) and its slots re-dealt;
* a replica only in the old shape leaves (its processes end after the boundary);
* a replica only in the new one is new processes, each built as its rank of the new shape and
  given the state of the same place (TP index, stage) in a replica that stays, its *donor*
  (:func:`donors`), over a pair group, as a recovery's joiner is.

Every rank of the new shape builds all its groups afresh, as versions of the new epoch in a new
:class:`~understudy.groups.groupset.GroupSet` (a group's size may change, which a version of an
existing group cannot), switches them in, and points the job's groups provider at them
(:meth:`~understudy.worker.migration.JobGroups.retarget`); the runtime takes its new context
(:meth:`~understudy.worker.runtime.Runtime.reshape`). The slots make the arithmetic independent
of the shape (:mod:`understudy.worker.slots`), so the run stays bit for bit the one of the
submitted size.

What drives a reshape is a ``reshape`` plan of the controller (a replica lost with no standby
free, ``daemon/planner.py``), which a survivor follows in :func:`worker.recovery.reshape`; or
the caller, as ``tests/integration/reshape_run.py`` does (every process told the shapes and
their boundaries).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence

from understudy.common.layout import Layout
from understudy.groups.groupset import GroupSet
from understudy.worker.api import JobContext
from understudy.worker.migration import JobGroups
from understudy.worker.runtime import Runtime

#: The member name of a process, from its replica and its place in it (TP index, stage).
MemberName = Callable[[Hashable, int, int], str]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The physical replicas of a job, in data-parallel order, and its TP and PP degrees.

    Raises (at construction): ValueError: no replica, or one named twice.
    """

    replicas: tuple[Hashable, ...]
    tp: int
    pp: int = 1

    def __post_init__(self) -> None:
        if not self.replicas or len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"a shape needs distinct replicas, got {self.replicas}")

    @property
    def layout(self) -> Layout:
        return Layout(len(self.replicas) * self.tp * self.pp, self.tp, self.pp)

    def rank(self, replica: Hashable, tp_index: int, stage: int = 0) -> int:
        """The rank of ``replica``'s place ``(tp_index, stage)``.

        Raises: ValueError: ``replica`` is not in the shape.
        """
        return self.layout.rank_of(tp_index, self.replicas.index(replica), stage)

    def members(self, name: MemberName) -> tuple[str, ...]:
        """Every rank's member name, by rank."""
        out = []
        for r in range(self.layout.world_size):
            t, d, s = self.layout.coordinates(r)
            out.append(name(self.replicas[d], t, s))
        return tuple(out)


def donors(before: Shape, after: Shape) -> dict[Hashable, Hashable]:
    """Each replica new in ``after`` -> the replica it takes its state from: the first of
    ``after`` that was in ``before`` (each of its places sends to the same place of the new
    replica).

    Raises:
        ValueError: no replica stays (nothing holds the state), or the TP or PP degree changes.
    """
    if (before.tp, before.pp) != (after.tp, after.pp):
        raise ValueError(f"a reshape keeps TP and PP: TP {before.tp} x PP {before.pp} -> "
                         f"TP {after.tp} x PP {after.pp}")
    staying = [r for r in after.replicas if r in before.replicas]
    if not staying:
        raise ValueError(f"no replica of {before.replicas} stays in {after.replicas}: nobody "
                         "holds the state")
    return {r: staying[0] for r in after.replicas if r not in before.replicas}


def build_groups(groups: GroupSet, shape: Shape, rank: int, members: Sequence[str],
                 version: int) -> list[str]:
    """Build ``rank``'s groups of ``shape`` as version ``version`` in ``groups`` and switch
    them in; every member of each group does the same. Returns their concrete names.

    Raises: as :meth:`GroupSet.prepare` and :meth:`GroupSet.switch`.
    """
    layout = shape.layout
    names = list(layout.concrete(rank).values())
    for name in names:
        groups.prepare(name, version, [members[r] for r in layout.members(name)])
    groups.switch(names)
    return names


def reshape(runtime: Runtime, provider: JobGroups, old: GroupSet, new: GroupSet, shape: Shape,
            rank: int, members: Sequence[str], version: int) -> None:
    """This surviving rank's part of a reshape, at a step boundary: build its groups of
    ``shape`` in ``new`` (as rank ``rank``), point the job at them, take the new context, and
    close ``old`` in the background (a group whose peer died may take its backend's timeout
    to release; the next step does not wait for it).

    Raises:
        ValueError: as :meth:`Runtime.reshape`, checked before anything is built: nothing
            changed.
        GroupError: a group could not be built (a member did not come).
    """
    ctx = new_context(runtime, provider, shape, rank)
    build_groups(new, shape, rank, members, version)
    take_shape(runtime, provider, old, new, shape, ctx)


def new_context(runtime: Runtime, provider: JobGroups, shape: Shape, rank: int) -> JobContext:
    """This rank's context as ``rank`` of ``shape``.

    Raises:
        ValueError: :meth:`Runtime.reshape` would refuse it (the job is not slotted, ...).
    """
    # The slot count stays the job's: a context that left it to the replica count (0) says so.
    ctx = dataclasses.replace(runtime.ctx, rank=rank, world_size=shape.layout.world_size,
                              groups=provider, slots=runtime.ctx.data_slots)
    refusal = runtime.reshape_refusal(ctx)
    if refusal is not None:
        raise ValueError(refusal)
    return ctx


def take_shape(runtime: Runtime, provider: JobGroups, old: GroupSet, new: GroupSet,
               shape: Shape, ctx: JobContext) -> None:
    """Once ``new`` holds this rank's groups of ``shape``: point the job at them, take ``ctx``
    (:func:`new_context`), and close ``old`` in the background."""
    runtime.reshape(ctx)
    provider.retarget(new, ctx.rank, shape.layout)
    threading.Thread(target=old.close, name="understudy-close-old-shape", daemon=True).start()
