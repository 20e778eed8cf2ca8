"""``Work`` objects for collectives answered in Python (a replay group, a one-member group)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Public in torch's docs ("the preferred way of constructing Work objects when writing a custom
# ProcessGroup in python") but missing from its type stubs.
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]


def work_from_future(future: torch.futures.Future[Any]) -> dist.Work:
    """A ``Work`` that completes with ``future`` (torch's way for a Python ``ProcessGroup`` to
    answer a collective). Its ``wait()`` ignores a timeout and its ``source_rank()`` raises;
    the future's value must be a tensor or a list of tensors."""
    return _create_work_from_future(future)


def completed_work(result: list[torch.Tensor]) -> dist.Work:
    """A ``Work`` that is already complete, whose future holds ``result``: ``wait()`` returns
    at once."""
    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)
