"""Numbered pieces of state moved to the members of a group that want them.

Two places move state this way: a job sharded by data-parallel slot moves its slots' states
over the DP group when the slots are re-dealt (:func:`understudy.worker.slots.redistribute`),
and a pipeline reshape moves whole layers along a replica's stages when their number changes
(:mod:`understudy.worker.restage`). Each member says, in one all-gather, which pieces it has
and which it wants; every member then makes the same plan from the same census: each piece a
member wants and lacks comes from the first member that has it, point to point, every send and
receive issued before any is waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from understudy.worker.api import JobContext


def exchange(ctx: JobContext, group: Any, states: dict[int, torch.Tensor], want: Sequence[int],
             count: int, empty: Callable[[int], torch.Tensor], *, tag: int,
             piece: str = "piece", where: str = "group") -> dict[int, torch.Tensor]:
    """Every member of ``group`` (a process group, or a versioned one) calls it at the same
    point, with the 1-D states of the pieces it has (``states``, numbered 0 to ``count - 1``)
    and the pieces it wants; a piece it wants and lacks is received into ``empty(x)`` from the
    first member that has it, under the message tag ``tag + x``. Returns exactly the wanted
    pieces' states (the received ones, and those it had); those not wanted are dropped.
    ``piece`` and ``where`` name them in errors and in what a wait reports.

    Raises:
        ValueError: a piece number is out of range, or a wanted piece is held by no member
            (the same on every member: they share the census).
        CollectiveAborted: the census, a send or a receive failed, timed out or was aborted.
    """
    wanted = sorted(set(want))
    if any(not 0 <= x < count for x in (*states, *wanted)):
        raise ValueError(f"{piece}s are 0 to {count - 1}: got states of {sorted(states)}, "
                         f"wanted {wanted}")
    size, me = group.size(), group.rank()
    census = torch.zeros(2 * count, dtype=torch.int64)
    census[list(states)] = 1
    census[[count + x for x in wanted]] = 1
    rows = [census]
    if size > 1:
        rows = [torch.empty_like(census) for _ in range(size)]
        ctx.wait(group.allgather([rows], [census]), f"the {piece} states' census")
    flags = [row.tolist() for row in rows]  # no per-element tensor indexing
    has = [{x for x in range(count) if row[x]} for row in flags]
    works: list[tuple[Any, str]] = []
    received: dict[int, torch.Tensor] = {}
    for q, row in enumerate(flags):
        for x in range(count):
            if not row[count + x] or x in has[q]:
                continue
            source = next((p for p in range(size) if x in has[p]), None)
            if source is None:
                raise ValueError(f"{piece} {x}'s state is held by no member of the {where} of "
                                 f"{size}: it is lost")
            if source == me:
                works.append((group.send([states[x]], q, tag + x), f"{piece} {x}'s state to {q}"))
            if q == me:
                received[x] = empty(x)
                works.append((group.recv([received[x]], source, tag + x),
                              f"{piece} {x}'s state from {source}"))
    for work, part in works:
        ctx.wait(work, f"the {piece} states' exchange: {part}")
    return {x: received[x] if x in received else states[x] for x in wanted}
