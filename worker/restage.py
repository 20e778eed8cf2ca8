"""Pipeline reshape: a job's number of stages changes at a step boundary, its layers moving
whole between the ranks of each replica's pipeline (issue 16, item 6; ``docs/reshape.md``).

A job opts in with :meth:`~understudy.worker.api.SlottedJob.stage_units`: its state is cut
into *units* (whole layers with their optimizer state, numbered in model order), and the rank
at stage ``s`` of ``p`` holds the units the job's partitioning gives it. Going from ``p`` to
``p'`` stages keeps the replicas and the TP split; along each replica's pipeline at each TP
index, the process at *position* ``k`` is stage ``k`` in every shape with more than ``k``
stages:

* a position in both shapes keeps its process and the units it still holds, takes those its
  new stage adds, drops the others, and is renumbered (``layout.rank_of(t, d, k)``);
* a position only in the old shape (fewer stages) sends its units to where they go and leaves;
* a position only in the new one (more stages) is a new process, built as its rank of the new
  shape, which takes every unit it holds from the old positions, and the step count.

The units move over one group per pipeline (the old and new positions of a replica at a TP
index: the longer of the two pipelines), by :func:`~understudy.worker.exchange.exchange`: a
census of who has and wants which unit, then point-to-point sends, each unit crossing once.
Replicas hold the same units at the same places (slotted jobs keep identical state), so every
pipeline moves its own and the pipelines run side by side. Then every rank of the new shape
builds all its groups afresh (as a data-parallel reshape does:
:func:`~understudy.worker.reshape.build_groups`), takes its new context
(:meth:`~understudy.worker.runtime.Runtime.restage`) and trains on from the same step.

A layer's forward and backward do not depend on the stage that runs it, the GPipe schedule
(:mod:`understudy.worker.pipeline`) adds a layer's gradient over the micro-batches in one order
on any partitioning, and a job that keys its random streams by the layer draws the same masks
on any, so the run stays bit for bit the one of the submitted shape.

Not built: the controller does not plan a pipeline reshape (no ``understudy resize --pp``), and
the units cross at the boundary, on the critical path (they could be sent ahead and kept
current as a drain's state is). ``tests/integration/restage_run.py`` drives it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable
from typing import Any

import torch

from understudy.groups.groupset import GroupSet
from understudy.worker.api import restages
from understudy.worker.exchange import exchange
from understudy.worker.migration import JobGroups
from understudy.worker.reshape import MemberName, Shape, build_groups
from understudy.worker.runtime import Runtime

#: The message tag of unit ``x`` sent along a pipeline: ``UNIT_TAG + x``.
UNIT_TAG = 0x5E570000


def check_shapes(before: Shape, after: Shape) -> None:
    """Raises: ValueError: ``after`` changes more than the number of stages of ``before``."""
    if (before.replicas, before.tp) != (after.replicas, after.tp):
        raise ValueError(f"a pipeline reshape keeps the replicas and the TP degree: replicas "
                         f"{before.replicas} x TP {before.tp} -> {after.replicas} x TP "
                         f"{after.tp}")


def pipeline_members(before: Shape, after: Shape, replica: Hashable, tp_index: int,
                     name: MemberName) -> list[str]:
    """The processes of ``replica``'s pipeline at ``tp_index`` in either shape, by position."""
    return [name(replica, tp_index, k) for k in range(max(before.pp, after.pp))]


def restage(runtime: Runtime, provider: JobGroups, old: GroupSet | None, new: GroupSet,
            before: Shape, after: Shape, replica: Hashable, tp_index: int, position: int,
            name: MemberName, version: int) -> bool:
    """This process's part of a pipeline reshape from ``before`` to ``after`` at a step
    boundary: it is place ``position`` of ``replica``'s pipeline at ``tp_index``. A process of
    ``before`` has committed the boundary's step and holds the units of its stage; one new in
    ``after`` has its runtime built as its rank there (its groups provider on ``new``) and
    nothing committed. Builds the pipeline's group in ``new``, moves the units, then (in
    ``after``) builds this rank's groups of ``after``, points ``provider`` at them and takes
    the new context; closes ``old`` (in the background, unless the process leaves). Returns
    whether the process has a place in ``after`` (False: it leaves).

    Raises:
        ValueError: the shapes differ in more than the stages, or the runtime refuses the new
            place (checked on this process before anything moves); a unit is held by no
            process.
        GroupError: a group could not be built (a member did not come).
        CollectiveAborted: the census or a unit's transfer failed.
        RuntimeError: as :meth:`Runtime.restage`.
    """
    check_shapes(before, after)
    job = runtime.job
    if not restages(job):
        raise ValueError(runtime.restage_refusal(runtime.ctx))
    stays, joins = position < after.pp, position >= before.pp
    ctx = None
    if stays:
        ctx = dataclasses.replace(runtime.ctx, rank=after.rank(replica, tp_index, position),
                                  world_size=after.layout.world_size, pp=after.pp,
                                  groups=provider, slots=runtime.ctx.data_slots)
        refusal = runtime.restage_refusal(ctx)
        if refusal is not None:
            raise ValueError(refusal)
    held = [] if joins else list(job.stage_units(runtime.ctx) or ())
    wanted = list(job.stage_units(ctx) or ()) if ctx is not None else []
    group = new.create(f"pipeline-{replica}.{tp_index}",
                       pipeline_members(before, after, replica, tp_index, name), version=version)
    # One census for every process: as wide as the largest unit number any of them names.
    count = _largest(runtime, group, max([*held, *wanted, -1]) + 1)
    units = exchange(runtime.ctx, group, {u: job.unit_state(u) for u in held}, wanted, count,
                     job.empty_unit, tag=UNIT_TAG, piece="unit", where="pipeline")
    step = _largest(runtime, group, -1 if joins else runtime.step)
    if ctx is not None:
        build_groups(new, after, ctx.rank, after.members(name), version)
        runtime.restage(ctx, {u: t for u, t in units.items() if u not in held}, step)
        provider.retarget(new, ctx.rank, after.layout)
    if old is not None and ctx is None:
        old.close()  # a leaver has nothing else to do
    elif old is not None:
        threading.Thread(target=old.close, name="understudy-close-old-shape",
                         daemon=True).start()
    return ctx is not None


def _largest(runtime: Runtime, group: Any, value: int) -> int:
    """The largest of every member's ``value`` (one all-gather on ``group``)."""
    if group.size() == 1:
        return value
    mine = torch.tensor([value], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(group.size())]
    runtime.ctx.wait(group.allgather([rows], [mine]), "the pipeline reshape's census")
    return max(int(r) for r in rows)
