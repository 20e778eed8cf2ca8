"""Copies of optimizer parts kept on the next data-parallel rank: the pieces of the protocol
that a job sharding its Adam state over DP (ZeRO-1) and keeping each rank's part on rank
``d + 1`` shares (``examples/plain_torch/train.py``'s ``ShardedJob``;
:class:`~understudy.worker.megatron.distributed.ShardedMegatronJob`).

A replacement rank starts with no copy of its predecessor's part: the donor of its state sends
only the lost rank's own part (``TrainingJob.replica_state``). So each step begins with
:func:`buddy_check`, and where a copy is missing the predecessor sends its part's values, Adam
moments and step count (:func:`adam_parts`) while the step computes; the receiver installs
them before apply (:func:`install_adam_parts`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from understudy.worker.api import JobContext, allreduce_options


def buddy_check(ctx: JobContext, missing: bool) -> tuple[bool, bool]:
    """The step's buddy check: a ``dp``-element all-reduce over the DP group of who misses its
    copy of its predecessor's part (``missing``: this rank does). Returns whether the next DP
    rank misses its copy of this rank's part, and whether this rank misses one."""
    dp, d = ctx.dp, ctx.dp_index
    flags = torch.zeros(dp, dtype=torch.int64)
    flags[d] = int(missing)
    ctx.wait(ctx.group("dp").allreduce([flags], allreduce_options(dist.ReduceOp.SUM)),
             "the buddy check")
    return bool(flags[(d + 1) % dp]), bool(flags[d])


def check_keeps_copy(ctx: JobContext, rank: int, buddy_index: int, *, kept: bool,
                     what: str = "shard", off: str = "") -> None:
    """For ``replica_state(rank)``: raise unless this rank keeps a copy of rank ``rank``'s
    optimizer ``what`` (it keeps DP rank ``buddy_index``'s; ``kept``: the job keeps copies at
    all, ``off`` says how they were turned off).

    Raises:
        ValueError: the copy is not here.
    """
    if not kept:
        raise ValueError(f"rank {rank}'s optimizer {what} exists nowhere else: the job keeps "
                         f"no copies of its {what}s{f' ({off})' if off else ''}")
    if ctx.layout.coordinates(rank)[1] != buddy_index:
        raise ValueError(f"rank {rank}'s optimizer {what} is not kept here: rank {ctx.rank} "
                         f"keeps DP rank {buddy_index}'s")


def adam_parts(value: torch.Tensor, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """``value``'s values, Adam moments and step count (a one-element float32 tensor on its
    device), as ``optimizer`` holds them: the moments themselves, zeros before a first step."""
    st = optimizer.state.get(value, {})
    if not st:
        return [value.detach(), torch.zeros_like(value), torch.zeros_like(value),
                torch.zeros(1, device=value.device)]
    return [value.detach(), st["exp_avg"], st["exp_avg_sq"],
            st["step"].reshape(1).to(device=value.device, dtype=torch.float32)]


def empty_adam_parts(value: torch.Tensor) -> list[torch.Tensor]:
    """Where :func:`adam_parts` of the predecessor's part land: ``value`` itself (the copy's
    values), new moments and a step count."""
    return [value.detach(), torch.empty_like(value), torch.empty_like(value),
            torch.empty(1, device=value.device)]


def install_adam_parts(optimizer: torch.optim.Optimizer, value: torch.Tensor,
                       parts: list[torch.Tensor]) -> None:
    """The received :func:`adam_parts` as ``value``'s Adam state (its values landed in place);
    none where the predecessor had not stepped yet."""
    _, exp_avg, exp_avg_sq, step = parts
    if step.item() > 0:
        optimizer.state[value] = {"step": step.reshape(()), "exp_avg": exp_avg,
                                  "exp_avg_sq": exp_avg_sq}
    else:
        optimizer.state.pop(value, None)


__all__ = ["adam_parts", "buddy_check", "check_keeps_copy", "empty_adam_parts",
           "install_adam_parts"]
