"""Data-parallel slots: a job's data parallelism as submitted, whatever the physical one.

A job that opts in (:class:`~understudy.worker.api.SlottedJob`) trains ``slots`` data-parallel
*slots*, its DP degree at submission, on however many physical replicas it has: replica ``i``
of ``dp`` holds the contiguous block :func:`held` gives, and computes each of its slots in turn.
A slot's micro-batch and random streams are keyed by the slot, never by the replica, and the
sum of the slots' gradients is taken in one fixed order (slot 0 + slot 1, + slot 2, ...), so a
step's arithmetic, and so the run, is the same bit for bit whatever the physical DP size.

The runtime owns that sum (:func:`canonical_sum`): the flat gradient is cut into one chunk per
replica; an all-to-all of point-to-point sends gives each replica its chunk of every slot's
gradient; it adds them in slot order; an all-gather gives every replica the whole sum. The bytes
moved per replica are those of a ring all-reduce (its chunk of each slot held elsewhere in, its
sum out to each peer) at one slot per replica; a replica holding ``k`` slots sends ``k`` times
its share. A job's own all-reduce (gloo's ring) adds in an order that depends on the ring, which
is why a job cannot keep its results across a change of replica count with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from understudy.worker import rng

if TYPE_CHECKING:
    from understudy.worker.api import JobContext, SlottedJob

#: The tags of the sum's two rounds on the DP group (one point-to-point stream per pair of
#: replicas and round; nothing else in understudy sends point to point on a DP group).
SCATTER_TAG, GATHER_TAG = 0x51A7, 0x51A8


def held(slots: int, dp: int, dp_index: int) -> range:
    """The slots replica ``dp_index`` of ``dp`` holds: a contiguous block, the blocks' sizes
    differing by one at most (the first replicas hold the smaller ones).

    Raises:
        ValueError: ``dp`` is not between 1 and ``slots``, or ``dp_index`` is outside it.
    """
    if not 1 <= dp <= slots:
        raise ValueError(f"{dp} data-parallel replicas cannot hold {slots} slots: each needs "
                         "one at least")
    if not 0 <= dp_index < dp:
        raise ValueError(f"replica {dp_index} is outside a data-parallel group of {dp}")
    return range(dp_index * slots // dp, (dp_index + 1) * slots // dp)


def chunk(numel: int, parts: int, index: int) -> slice:
    """Elements ``index`` of ``parts`` of a flat tensor of ``numel``: the chunk that replica
    ``index`` sums."""
    return slice(index * numel // parts, (index + 1) * numel // parts)


def slot_seed(ctx: JobContext, step: int, slot: int) -> int:
    """The seed of the process-global generators for ``slot`` of ``step`` on this rank: from the
    job's seed, the rank's place in its replica (TP index, stage) and the slot, never the
    replica it is computed on."""
    place = ctx.pp_index * ctx.tp + ctx.tp_index
    return (((ctx.seed * 1_000_003 + place) * 1_000_033 + slot) * 1_000_037 + step) % 2**63


def compute_step(job: SlottedJob, ctx: JobContext, step: int) -> None:
    """One step's compute of a slotted job: each slot this replica holds, in order, its
    generators seeded by :func:`slot_seed`; then the canonical sum of their gradients, written
    back into ``job.gradients()``.

    Raises:
        CollectiveAborted: from a collective of the job's or of the sum.
        ValueError: the job's gradients changed shape between slots.
    """
    flats: dict[int, torch.Tensor] = {}
    grads: list[torch.Tensor] = []
    for slot in ctx.held_slots:
        rng.seed_all(slot_seed(ctx, step, slot))
        job.compute_slot(step, slot)
        grads = list(job.gradients())
        flats[slot] = torch.cat([g.detach().reshape(-1) for g in grads])
    shapes = {f.shape for f in flats.values()}
    if len(shapes) != 1:
        raise ValueError(f"the slots' gradients differ in size ({sorted(s[0] for s in shapes)} "
                         "elements): gradients() must return the same tensors for every slot")
    total = canonical_sum(ctx, flats)
    offset = 0
    with torch.no_grad():
        for g in grads:
            g.copy_(total[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def canonical_sum(ctx: JobContext, flats: dict[int, torch.Tensor]) -> torch.Tensor:
    """The sum over every slot of the job of its flat gradient, added in slot order: ``flats``
    holds this replica's slots (:attr:`JobContext.held_slots`), each a 1-D tensor of the same
    size, dtype and device. Every replica of the DP group calls it with its own; each gets the
    same sum, bit for bit whatever the number of replicas.

    Raises:
        CollectiveAborted: a send or receive failed, timed out or was aborted.
        ValueError: ``flats`` is not exactly this replica's slots.
    """
    slots, mine = ctx.data_slots, ctx.held_slots
    if sorted(flats) != list(mine):
        raise ValueError(f"replica {ctx.dp_index} holds slots {list(mine)}, got gradients for "
                         f"{sorted(flats)}")
    first = flats[mine.start]
    numel, dtype, device = first.numel(), first.dtype, first.device
    group = ctx.group("dp")
    dp, me = group.size(), group.rank()
    holders = [held(slots, dp, q) for q in range(dp)]
    own = chunk(numel, dp, me)
    # Round 1, all-to-all: to each peer its chunk of every slot held here; from each peer this
    # replica's chunk of every slot it holds. All are issued before any is waited for.
    works: list[tuple[Any, str]] = []
    keep: list[torch.Tensor] = []  # what is being sent, alive until the sends complete
    received: dict[int, torch.Tensor] = {}
    own_len = own.stop - own.start
    for q in range(dp):
        if q == me:
            continue
        part = chunk(numel, dp, q)
        if part.stop > part.start:
            out = torch.stack([flats[s][part] for s in mine])
            keep.append(out)
            works.append((group.send([out], q, SCATTER_TAG), f"the slots' gradients to {q}"))
        if own_len:
            into = torch.empty((len(holders[q]), own_len), dtype=dtype, device=device)
            received[q] = into
            works.append((group.recv([into], q, SCATTER_TAG),
                          f"the slots' gradients from {q}"))
    _wait_all(ctx, works, "the slots' gradient all-to-all")
    total = torch.empty(numel, dtype=dtype, device=device)
    if own_len:
        rows = _rows_in_slot_order(flats, own, received, holders, me)
        acc = total[own]
        acc.copy_(rows[0])
        for row in rows[1:]:
            acc.add_(row)  # one rounding per slot, in slot order: the canonical sum
    # Round 2, all-gather: this replica's summed chunk to each peer, theirs into place.
    works = []
    for q in range(dp):
        if q == me:
            continue
        if own_len:
            works.append((group.send([total[own]], q, GATHER_TAG), f"the summed chunk to {q}"))
        part = chunk(numel, dp, q)
        if part.stop > part.start:
            works.append((group.recv([total[part]], q, GATHER_TAG),
                          f"the summed chunk from {q}"))
    _wait_all(ctx, works, "the slots' gradient all-gather")
    return total


def _rows_in_slot_order(flats: dict[int, torch.Tensor], own: slice,
                        received: dict[int, torch.Tensor], holders: Sequence[range],
                        me: int) -> list[torch.Tensor]:
    """This replica's chunk of every slot's gradient, slot 0 first."""
    rows: list[torch.Tensor] = []
    for q, block in enumerate(holders):
        for i, slot in enumerate(block):
            rows.append(flats[slot][own] if q == me else received[q][i])
    return rows


def _wait_all(ctx: JobContext, works: list[tuple[Any, str]], what: str) -> None:
    for work, part in works:
        ctx.wait(work, f"{what}: {part}")

