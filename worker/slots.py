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
its share. Small gradients (up to :data:`GATHER_ALL_BYTES` over all slots) take one all-gather
of every slot's whole gradient instead, and every replica makes the same additions. A job's own
all-reduce (gloo's ring) adds in an order that depends on the ring, which is why a job cannot
keep its results across a change of replica count with it.

A job may also shard state by slot (the optimizer state of ZeRO-1, cut at the slots' chunks of
the flat parameters: ``examples/plain_torch/train.py``, ``SlottedShardedJob``): a replica keeps
the state of the slots it holds, and a copy of others'. The slots' states then move with the
slots: :func:`redistribute`, called by every replica at the start of a step, gives each the
states it wants from a replica that has them (after a reshape re-dealt the slots, or a recovery
rebuilt a replica from a neighbour's state), and :func:`gather_slots` assembles a flat tensor
from every replica's slot chunks (the parameters, after each replica updated its own).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from understudy.worker import rng
from understudy.worker.exchange import exchange

if TYPE_CHECKING:
    from understudy.worker.api import JobContext, SlottedJob

#: The tags of the sum's two rounds on the DP group: the all-to-all's messages are
#: ``SCATTER_TAG + i`` for the sender's ``i``-th slot, the all-gather's ``GATHER_TAG``, a summed
#: slot chunk sent to a replica that wants it ``GATHER_TAG + slot`` (nothing else in understudy
#: sends point to point on a DP group but :func:`redistribute`).
SCATTER_TAG, GATHER_TAG = 0x51A70000, 0x51A80000
#: The tag of a slot's state sent by :func:`redistribute`: ``STATE_TAG + slot``.
STATE_TAG = 0x51A90000
#: Up to this many bytes of gradients over all slots, the sum gathers every slot's whole
#: gradient in one collective and each replica adds them all (:func:`_gathered_sum`): at 27 KB
#: of state the two rounds of point-to-point messages cost more than the data.
GATHER_ALL_BYTES = 1 << 20


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
        ValueError: the job's gradients changed size between slots, or mix dtypes.
    """
    flats: dict[int, torch.Tensor] = {}
    grads: list[torch.Tensor] = []
    for i, slot in enumerate(ctx.held_slots):
        rng.seed_all(slot_seed(ctx, step, slot))
        job.compute_slot(step, slot)
        grads = list(job.gradients())
        parts = [g.detach().reshape(-1) for g in grads]
        if len({p.dtype for p in parts}) > 1:
            raise ValueError("the slots are summed as one flat tensor: gradients() must return "
                             f"tensors of one dtype, got {sorted({str(p.dtype) for p in parts})}")
        numel = sum(p.numel() for p in parts)
        if flats and numel != next(iter(flats.values())).numel():
            raise ValueError(f"the slots' gradients differ in size ({numel} elements against "
                             f"{next(iter(flats.values())).numel()}): gradients() must return "
                             "the same tensors for every slot")
        flats[slot] = torch.cat(parts, out=_buffer(("slot", i), (numel,), parts[0]))
    dp = ctx.dp
    stops = dp > 1 and job.summed_slots(dp, 0) is not None
    total = canonical_sum(ctx, flats, (lambda q: job.summed_slots(dp, q) or ()) if stops
                          else None)
    offset = 0
    with torch.no_grad():
        for g in grads:
            g.copy_(total[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


#: Buffers kept from one step to the next, per thread (a rank's runtime runs on one; the tests
#: run ranks as threads): the slots' flat gradients, what the peers send, the sum. Large tensors
#: allocated anew each step cost their page faults every time (at 85 MB of gradients, the sum
#: took 178 ms that way against 68 ms reused, two ranks on this machine).
_local = threading.local()


def _buffer(name: tuple[Any, ...], shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    buffers: dict[tuple[Any, ...], torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    key = (*name, like.dtype, like.device)
    buf = buffers.get(key)
    if buf is None or buf.shape != shape:
        buf = buffers[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        if buf.device.type == "cpu":
            _raise_mmap_threshold()
    return buf


#: Just under glibc's largest dynamic mmap threshold (32 MiB on 64-bit), chunk header included.
_PRIMER_BYTES = 31 << 20
_primed = False


def _raise_mmap_threshold() -> None:
    """Free one large block, once per process, as a job's own all-reduce does every step.

    glibc serves a large allocation by a fresh ``mmap`` until a block that large has been
    freed: each free of an mmapped block raises the threshold to its size (up to 32 MiB), and
    from then on blocks below it come from the heap, whose pages stay mapped. A job's own
    all-reduce frees its gradient copy each step; the sum's buffers are kept, so without this
    every large temporary of the forward, backward and optimizer step stayed a fresh mapping
    whose pages faulted in again each step: at 64 MiB of state per rank the slotted step ran
    +10 % over the job's own, its sum 12 ms *faster* but its compute 20-25 ms slower
    (cProfile of both, two ranks; with ``MALLOC_MMAP_THRESHOLD_`` fixed the two computes
    matched). Other allocators (jemalloc, tcmalloc) are untouched by this."""
    global _primed
    if not _primed:
        _primed = True
        block = torch.empty(_PRIMER_BYTES, dtype=torch.uint8)
        del block


def canonical_sum(ctx: JobContext, flats: dict[int, torch.Tensor],
                  wanted: Callable[[int], Sequence[int]] | None = None) -> torch.Tensor:
    """The sum over every slot of the job of its flat gradient, added in slot order: ``flats``
    holds this replica's slots (:attr:`JobContext.held_slots`), each a 1-D tensor of the same
    size, dtype and device. Every replica of the DP group calls it with its own; each gets the
    same sum, bit for bit whatever the number of replicas. The result is a buffer this module
    reuses at the next call: the caller copies it out before then.

    With ``wanted`` (replica -> the slots whose chunks of the sum it reads, the same function on
    every replica: a job that shards its state by slot, :meth:`SlottedJob.summed_slots`), each
    replica sums the chunks of the slots it holds (``chunk(numel, slots, x)``) and sends each
    summed chunk only to the replicas that want it, instead of the all-gather: the rest of the
    result is left stale.

    Raises:
        CollectiveAborted: a send or receive failed, timed out or was aborted.
        ValueError: ``flats`` is not exactly this replica's slots.
    """
    slots, mine = ctx.data_slots, ctx.held_slots
    if sorted(flats) != list(mine):
        raise ValueError(f"replica {ctx.dp_index} holds slots {list(mine)}, got gradients for "
                         f"{sorted(flats)}")
    first = flats[mine.start]
    numel = first.numel()
    group = ctx.group("dp")
    dp, me = group.size(), group.rank()
    holders = [held(slots, dp, q) for q in range(dp)]
    total = _buffer(("total",), (numel,), first)
    if dp > 1 and numel * first.element_size() * slots <= GATHER_ALL_BYTES:
        return _gathered_sum(ctx, group, flats, holders, total)
    # What each replica sums: a dp-th of the tensor, or (``wanted``) its slots' chunks.
    parts = [chunk(numel, dp, q) if wanted is None else
             slice(b.start * numel // slots, b.stop * numel // slots)
             for q, b in enumerate(holders)]
    own = parts[me]
    own_len = own.stop - own.start
    # Round 1, all-to-all: to each peer its chunk of every slot held here (views: nothing is
    # copied), one message a slot; from each peer this replica's chunk of each slot it holds,
    # into a row of a reused buffer. All are issued before any is waited for.
    works: list[tuple[Any, str]] = []
    received: dict[int, torch.Tensor] = {}
    for q in range(dp):
        if q == me:
            continue
        part = parts[q]
        if part.stop > part.start:
            for i, slot in enumerate(mine):
                works.append((group.send([flats[slot][part]], q, SCATTER_TAG + i),
                              f"slot {slot}'s gradient to {q}"))
        if own_len:
            into = _buffer(("from", q), (len(holders[q]), own_len), first)
            received[q] = into
            for i, slot in enumerate(holders[q]):
                works.append((group.recv([into[i]], q, SCATTER_TAG + i),
                              f"slot {slot}'s gradient from {q}"))
    _wait_all(ctx, works, "the slots' gradient all-to-all")
    if own_len:
        rows = _rows_in_slot_order(flats, own, received, holders, me)
        acc = total[own]
        acc.copy_(rows[0])
        for row in rows[1:]:
            acc.add_(row)  # one rounding per slot, in slot order: the canonical sum
    if wanted is not None:
        _send_wanted(ctx, group, total, holders, wanted)
        return total
    # Round 2, all-gather: this replica's summed chunk to each peer, theirs into place.
    works = []
    for q in range(dp):
        if q == me:
            continue
        if own_len:
            works.append((group.send([total[own]], q, GATHER_TAG), f"the summed chunk to {q}"))
        part = parts[q]
        if part.stop > part.start:
            works.append((group.recv([total[part]], q, GATHER_TAG),
                          f"the summed chunk from {q}"))
    _wait_all(ctx, works, "the slots' gradient all-gather")
    return total


def _send_wanted(ctx: JobContext, group: Any, total: torch.Tensor, holders: Sequence[range],
                 wanted: Callable[[int], Sequence[int]]) -> None:
    """Round 2 of a sum that stops at the slots' chunks: each summed chunk of a slot held here
    to every other replica that wants it, one message a slot; those this replica wants from
    others into place."""
    numel, slots = total.numel(), ctx.data_slots
    dp, me = len(holders), group.rank()
    holder = {x: q for q, block in enumerate(holders) for x in block}
    works: list[tuple[Any, str]] = []
    for q in range(dp):
        for x in sorted(set(wanted(q))):
            part = chunk(numel, slots, x)
            if part.stop == part.start or holder[x] == q:
                continue
            if holder[x] == me:
                works.append((group.send([total[part]], q, GATHER_TAG + x),
                              f"slot {x}'s summed chunk to {q}"))
            elif q == me:
                works.append((group.recv([total[part]], holder[x], GATHER_TAG + x),
                              f"slot {x}'s summed chunk from {holder[x]}"))
    _wait_all(ctx, works, "the slots' summed chunks")


def _gathered_sum(ctx: JobContext, group: Any, flats: dict[int, torch.Tensor],
                  holders: Sequence[range], total: torch.Tensor) -> torch.Tensor:
    """The canonical sum of small gradients: one all-gather of every slot's whole gradient
    (each replica's block padded to the largest), then the same slot-order additions on every
    replica. One collective instead of two rounds of messages, whose latency dominates here."""
    first = next(iter(flats.values()))
    numel, width = first.numel(), max(len(b) for b in holders)
    mine = _buffer(("gather-in",), (width, numel), first)
    for i, slot in enumerate(sorted(flats)):
        mine[i].copy_(flats[slot])
    mine[len(flats):].zero_()  # the padding: sent, never added
    outs = [_buffer(("gather-out", q), (width, numel), first) for q in range(len(holders))]
    ctx.wait(group.allgather([outs], [mine]), "the slots' gradient all-gather (small)")
    rows = [outs[q][i] for q, block in enumerate(holders) for i in range(len(block))]
    total.copy_(rows[0])
    for row in rows[1:]:
        total.add_(row)  # as in the chunked sum: one rounding per slot, in slot order
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


def redistribute(ctx: JobContext, states: dict[int, torch.Tensor], want: Sequence[int],
                 empty: Callable[[int], torch.Tensor]) -> dict[int, torch.Tensor]:
    """Slot-sharded state moved where it is wanted: every replica of the DP group calls it at
    the same point with the 1-D state tensors of the slots it has (``states``) and the slots
    it wants; one all-gather tells each what the others have and want, then each slot a replica
    wants and lacks comes from the first replica that has it (point to point), into
    ``empty(slot)``. Returns exactly the wanted slots' states (those not wanted are dropped).
    Every replica computes the same plan, so a slot nobody has fails on every one alike.

    Raises:
        ValueError: a wanted slot's state is held by no replica (it is lost: two neighbours
            holding a slot and its copy went at once), or a slot number is out of range.
        CollectiveAborted: a collective, send or receive failed, timed out or was aborted.
    """
    # A ProcessGroup: the census all-gather is not in Communicator.
    return exchange(ctx, ctx.group("dp"), states, want, ctx.data_slots, empty, tag=STATE_TAG,
                    piece="slot", where="data-parallel group")


def gather_slots(ctx: JobContext, chunks: dict[int, torch.Tensor], out: torch.Tensor) -> None:
    """Every slot's chunk of a flat tensor into ``out``, from the replica that holds the slot:
    ``chunks`` holds this replica's (:attr:`JobContext.held_slots`), slot ``x``'s being
    ``out[chunk(out.numel(), slots, x)]`` as this replica has it. Every replica of the DP group
    calls it; one all-gather (each replica's chunks padded to the largest block).

    Raises:
        ValueError: ``chunks`` is not exactly this replica's slots.
        CollectiveAborted: the all-gather failed, timed out or was aborted.
    """
    slots, mine = ctx.data_slots, ctx.held_slots
    if sorted(chunks) != list(mine):
        raise ValueError(f"replica {ctx.dp_index} holds slots {list(mine)}, got chunks of "
                         f"{sorted(chunks)}")
    numel = out.numel()
    parts = [chunk(numel, slots, x) for x in range(slots)]
    group: Any = ctx.group("dp")
    dp = group.size()
    if dp == 1:
        for x in mine:
            out[parts[x]] = chunks[x]
        return
    holders = [held(slots, dp, q) for q in range(dp)]
    longest = max(p.stop - p.start for p in parts)
    width = max(len(b) for b in holders) * longest
    block = _buffer(("slots-in",), (width,), out)
    block.zero_()
    for i, x in enumerate(mine):
        n = parts[x].stop - parts[x].start
        block[i * longest:i * longest + n] = chunks[x]
    blocks = [_buffer(("slots-out", q), (width,), out) for q in range(dp)]
    ctx.wait(group.allgather([blocks], [block]), "the slots' chunks all-gather")
    for q, held_by in enumerate(holders):
        for i, x in enumerate(held_by):
            n = parts[x].stop - parts[x].start
            out[parts[x]] = blocks[q][i * longest:i * longest + n]


def _wait_all(ctx: JobContext, works: list[tuple[Any, str]], what: str) -> None:
    for work, part in works:
        ctx.wait(work, f"{what}: {part}")

