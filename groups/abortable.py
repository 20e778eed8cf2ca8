"""Abortable waits on collectives: the one implementation (``JobContext.wait`` and
``worker.api.wait_abortable`` use it).

A collective whose peer is frozen (no TCP reset) would block its caller until the backend's
timeout, minutes with the defaults. Issue it with ``async_op=True`` and wait here instead: the
wait is cut into short slices, and between slices the caller's ``abort`` predicate (the daemon's
word that a peer is gone) or the deadline ends it. The stuck collective itself is not cancelled:
fence the group's version (``GroupSet.fence``) and build the next one; the old communicator is
released in the background when its backend gives up.

The wait watches the work's future rather than calling ``Work.wait(timeout)`` in a loop: no
exception per slice, no added latency when it completes, and no side effect on backends whose
``wait(timeout)`` aborts the communicator when it expires (NCCL). Gloo's send and recv have no
future (torch 2.13): a thread waits on those instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from understudy.groups.errors import CollectiveAborted, CollectiveFailed, CollectiveTimeout

#: Default slice: how late an abort decision is noticed at most.
SLICE = 0.05

#: thread id -> (time.monotonic() at its start, what) of every wait in progress in this
#: process: what a worker's stuck reporter reads (``worker/stuck.py``)
_waiting: dict[int, tuple[float, str]] = {}
#: every wait in progress in this process: :func:`nudge` wakes them to ask ``abort`` again
_nudges: set[threading.Event] = set()
_nudges_lock = threading.Lock()
#: set when a wait that lasted over ``LONG_WAIT_S`` ends: a stuck reporter withdraws its report
#: at once instead of at its next look (short waits, every collective of a step, set nothing)
long_wait_ended = threading.Event()
LONG_WAIT_S = 1.0


def waiting() -> tuple[float, str] | None:
    """The longest-running wait in progress in this process, as (``time.monotonic()`` at its
    start, what it waits for); None when none is."""
    now = list(_waiting.values())
    return min(now) if now else None


def nudge() -> None:
    """Wake every wait in progress in this process to ask its ``abort`` predicate at once
    instead of at the end of its slice: call it when what the predicates read has changed (the
    job's view brought a recovery plan)."""
    with _nudges_lock:
        for news in _nudges:
            news.set()


class Work(Protocol):
    """What a wait needs from an asynchronous collective's handle (``torch.distributed.Work``)."""

    def get_future(self) -> torch.futures.Future[Any]: ...

    def wait(self) -> Any: ...


def wait(work: Work, *, abort: Callable[[], bool] | None = None,
         timeout: float | None = None, slice_s: float = SLICE, what: str = "the collective",
         clock: Callable[[], float] = time.monotonic) -> None:
    """Block until ``work`` completes, ``abort()`` returns true, or ``timeout`` seconds pass
    (plus one slice at most). Returns as soon as the work completes, not at the end of a slice.
    ``what`` names the collective in the errors.

    Raises:
        CollectiveAborted: ``abort()`` returned true first.
        CollectiveTimeout: the deadline passed first (a ``CollectiveAborted``).
        CollectiveFailed: the backend reported the collective failed (a ``CollectiveAborted``,
            chained from the backend's error).
        ValueError: ``slice_s`` is not positive, or ``timeout`` is negative.
    """
    if not slice_s > 0:
        raise ValueError(f"slice must be a positive number of seconds, got {slice_s!r}")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    done = threading.Event()
    news = threading.Event()  # the work completed, or a nudge: look again
    failed: list[BaseException] = []
    threaded = False
    future: Any = None

    def completed(_: Any = None) -> None:  # on the communicator's (or the waiter's) thread
        done.set()
        news.set()

    try:
        future = work.get_future()
    except RuntimeError:
        # No future: a thread waits instead. If the wait is abandoned, the thread stays blocked
        # until the peer's connection breaks or the communicator's own timeout; it holds
        # nothing else.
        def waiter() -> None:
            try:
                work.wait()
            except Exception as exc:  # the communicator's error, whatever its type
                failed.append(exc)
            finally:
                completed()

        threaded = True
        threading.Thread(target=waiter, name=f"wait: {what}", daemon=True).start()
    else:
        future.add_done_callback(completed)  # it only sets flags
    start = clock()
    me = threading.get_ident()
    _waiting[me] = (time.monotonic(), what)
    with _nudges_lock:
        _nudges.add(news)
    try:
        _wait(work, done, news, failed, threaded, future, abort, timeout, slice_s, what,
              clock, start)
    finally:
        with _nudges_lock:
            _nudges.discard(news)
        began = _waiting.pop(me, (time.monotonic(), what))[0]
        if time.monotonic() - began > LONG_WAIT_S:
            long_wait_ended.set()


def _wait(work: Work, done: threading.Event, news: threading.Event,
          failed: list[BaseException], threaded: bool, future: Any,
          abort: Callable[[], bool] | None, timeout: float | None, slice_s: float, what: str,
          clock: Callable[[], float], start: float) -> None:
    def give_up_if_told() -> None:
        waited = clock() - start
        if abort is not None and abort():
            raise CollectiveAborted(f"{what} aborted after {waited:.2f} s: told to abort",
                                    what=what, waited=waited)
        if timeout is not None and waited >= timeout:
            raise CollectiveTimeout(f"{what} timed out after {waited:.2f} s (timeout "
                                    f"{timeout:g} s): a peer did not take part", what=what,
                                    waited=waited)

    while not done.is_set():
        news.wait(slice_s)  # a slice, or less: the work completed, or a nudge came
        news.clear()
        if done.is_set():
            break
        give_up_if_told()
    # NCCL's future completes once the collective is enqueued, not once it ran (its value
    # carries the stream's events): a peer that never joins leaves the kernel spinning on the
    # GPU with the future done, and the host would block at its next sync, where nothing
    # checks ``abort``. So wait for the work itself, with a pause that grows from 50 us to a
    # slice: a collective about to end costs no slice. Gloo's work is complete by now (a CPU
    # future completes with it). Found by scripts/gpu-selftest's crash check on an H200.
    completed: Callable[[], bool] = getattr(work, "is_completed", lambda: True)
    on_gpu = not threaded and _on_gpu(future)
    pause = 5e-5
    while on_gpu and not completed():
        give_up_if_told()
        time.sleep(pause)
        pause = min(2 * pause, slice_s)
    try:
        if failed:
            raise failed[0]
        if not threaded:  # the thread has waited already; gloo's works are waited on once
            work.wait()
    except Exception as exc:  # the communicator's error, whatever its type
        waited = clock() - start
        raise CollectiveFailed(f"{what} failed after {waited:.2f} s: {exc}", what=what,
                               waited=waited) from exc


def _on_gpu(future: torch.futures.Future[Any]) -> bool:
    """Whether ``future`` carries GPU tensors (a CUDA future: complete once enqueued)."""
    try:
        value = future.value()
    except Exception:  # it failed: work.wait() raises the backend's error next
        return False
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in values)
