"""Abortable waits on collectives.

A collective whose peer is frozen (no TCP reset) would block its caller until the backend's
timeout, minutes with the defaults. Issue it with ``async_op=True`` and wait here instead: the
wait is cut into short slices, and between slices the caller's ``abort`` predicate (the daemon's
word that a peer is gone) or the deadline ends it. The stuck collective itself is not cancelled:
fence the group's version (``GroupSet.fence``) and build the next one; the old communicator is
released in the background when its backend gives up.

The wait watches the work's future rather than calling ``Work.wait(timeout)`` in a loop: no
exception per slice, no added latency when it completes, and no side effect on backends whose
``wait(timeout)`` aborts the communicator when it expires (NCCL).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from understudy.groups.errors import CollectiveAborted, CollectiveFailed, CollectiveTimeout

#: Default slice: how late an abort decision is noticed at most.
SLICE = 0.05


def wait(work: dist.Work, *, abort: Callable[[], bool] | None = None,
         timeout: float | None = None, slice_s: float = SLICE,
         clock: Callable[[], float] = time.monotonic) -> None:
    """Block until ``work`` completes, ``abort()`` returns true, or ``timeout`` seconds pass.

    Raises:
        CollectiveAborted: ``abort()`` returned true first.
        CollectiveTimeout: the deadline passed first.
        CollectiveFailed: the backend reported the collective failed (chained).
        ValueError: ``slice_s`` is not positive, or ``timeout`` is negative.
    """
    if not slice_s > 0:
        raise ValueError(f"slice must be a positive number of seconds, got {slice_s!r}")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    done = threading.Event()
    work.get_future().add_done_callback(lambda _fut: done.set())
    deadline = None if timeout is None else clock() + timeout
    while not done.wait(slice_s):
        if abort is not None and abort():
            raise CollectiveAborted("the collective was abandoned: a peer is gone")
        if deadline is not None and clock() >= deadline:
            raise CollectiveTimeout(f"the collective did not complete within {timeout:g}s")
    try:
        work.wait()
    except RuntimeError as exc:
        raise CollectiveFailed(f"the collective failed: {exc}") from exc
