"""Failpoints: named places where a process misbehaves on purpose, for fault tests.

The idea is etcd's gofail and TiKV's fail-rs: a fault test needs a real process to fail at an
exact point (a joiner killed in the middle of the state stream, a controller that dies between
two writes), which no timing from outside can hit reliably. The code marks the point::

    failpoints.hit("joiner.receive.chunk")

and the environment of the process under test arms it::

    UNDERSTUDY_FAILPOINTS="joiner.receive.chunk=sleep(30);controller.plan=exit(3)"

Actions:

``sleep(S)``
    block the calling thread for ``S`` seconds (the test then kills or freezes the process
    while it sits exactly there; the log line below tells the test it arrived);
``exit(N)``
    ``os._exit(N)`` at once: no cleanup, no flushing, as a crash would;
``raise``
    raise :class:`FailpointFired` (a ``RuntimeError``): a bug at exactly that point.

``N*action`` (etcd gofail's form) fires the action at the first ``N`` hits instead of the first
only: ``controller.round=10*raise`` breaks ten rounds in a row.

Each armed failpoint fires once per process (``N`` times, so armed) and logs
``failpoint <name> fired: <action>`` (warning) first. Nothing is armed unless the variable is
set; an unarmed ``hit`` is one dict lookup. A malformed value raises :class:`FailpointError`
naming the part that is wrong, at the first ``hit`` (or at :func:`configure` / :func:`check`,
which entry points call at start-up).

**Off unless the daemon's configuration enables them.** Failpoints are a test facility compiled
into production binaries (as gofail's are only in test builds), so the variable alone arms
nothing. The daemon decides at start from its configuration (``failpoints_enabled = true``, or
``understudyd --enable-failpoints``; :func:`configure`), and gives its decision to every worker
it starts in ``UNDERSTUDY_FAILPOINTS_ENABLED`` (``"1"`` or ``"0"``, set by the supervisor after
the job's environment, which cannot set it), which :func:`check` reads in the worker. With
failpoints off, ``UNDERSTUDY_FAILPOINTS`` in a process's environment logs one warning and
arms nothing; the daemon does not pass its own copy on to its workers then.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from dataclasses import dataclass

from understudy.common import env, logs

_ACTION = re.compile(r"^(?:([1-9][0-9]*)\*)?(?:(sleep|exit)\(([0-9]+(?:\.[0-9]+)?)\)|(raise))$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class FailpointError(ValueError):
    """``UNDERSTUDY_FAILPOINTS`` is malformed."""


class FailpointFired(RuntimeError):
    """Raised by a failpoint armed with ``raise``."""


@dataclass(frozen=True)
class Action:
    kind: str  # "sleep" | "exit" | "raise"
    arg: float
    #: how many hits fire it (``N*action``); once by default
    times: int = 1

    def __str__(self) -> str:
        what = self.kind if self.kind == "raise" else f"{self.kind}({self.arg:g})"
        return what if self.times == 1 else f"{self.times}*{what}"


def parse(spec: str) -> dict[str, Action]:
    """``name=action[;name=action...]`` -> {name: action}."""
    armed: dict[str, Action] = {}
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, sep, action = (s.strip() for s in part.partition("="))
        if not sep or not _NAME.match(name):
            raise FailpointError(f"{env.FAILPOINTS}: {part!r} is not name=action")
        m = _ACTION.match(action)
        if m is None:
            raise FailpointError(f"{env.FAILPOINTS}: {action!r} (for {name}) is not sleep(S), "
                                 f"exit(N) or raise, each with an optional N* before it")
        if m[2] == "exit" and not m[3].isdigit():
            raise FailpointError(f"{env.FAILPOINTS}: exit takes a whole number, got {m[3]}")
        if name in armed:
            raise FailpointError(f"{env.FAILPOINTS}: {name} is armed twice")
        times = int(m[1] or 1)
        armed[name] = Action("raise", 0.0, times) if m[4] else Action(m[2], float(m[3]), times)
    return armed


_lock = threading.Lock()
_armed: dict[str, Action] | None = None


def configure(enabled: bool, decided_by: str) -> dict[str, Action]:
    """Decide what this process arms: with ``enabled``, what ``UNDERSTUDY_FAILPOINTS`` says;
    without, nothing, and one warning if the variable is set anyway. ``decided_by`` names the
    decision's source in that warning. Returns what is armed.

    Raises:
        FailpointError: failpoints are enabled and the variable is malformed.
    """
    with _lock:
        return dict(_decide(enabled, decided_by))


def check() -> dict[str, Action]:
    """What this process arms, decided once: by an earlier :func:`configure` (the daemon's), or
    else from the environment a daemon gives its workers (armed only where
    ``UNDERSTUDY_FAILPOINTS_ENABLED`` is ``"1"``). Raises FailpointError."""
    with _lock:
        if _armed is None:
            return dict(_decide(os.environ.get(env.FAILPOINTS_ENABLED) == "1",
                                f"the daemon that started this process "
                                f"(${env.FAILPOINTS_ENABLED})"))
        return dict(_armed)


def _decide(enabled: bool, decided_by: str) -> dict[str, Action]:
    global _armed
    spec = os.environ.get(env.FAILPOINTS, "")
    _armed = parse(spec) if enabled else {}
    if not enabled and spec.strip():
        logs.get().warning(f"{env.FAILPOINTS} is set, but failpoints are not enabled by "
                           f"{decided_by}: nothing is armed.", failpoints=spec, pid=os.getpid())
    return _armed


def hit(name: str) -> None:
    """Fire failpoint ``name`` if it is armed and has not fired in this process as many times
    as it was armed for (once, or ``N``)."""
    action = _take(name)
    if action is not None and action.kind == "sleep":
        time.sleep(action.arg)


async def ahit(name: str) -> None:
    """:func:`hit` for a coroutine on an event loop: ``sleep(S)`` suspends the caller only
    (the daemon's other tasks, its lease among them, run on meanwhile)."""
    action = _take(name)
    if action is not None and action.kind == "sleep":
        await asyncio.sleep(action.arg)


def _take(name: str) -> Action | None:
    """The action of failpoint ``name`` if it fires now (one hit fewer left); ``exit`` and
    ``raise`` act here, ``sleep`` is the caller's."""
    if _armed is None:
        check()
    assert _armed is not None
    if name not in _armed:
        return None
    with _lock:
        action = _armed.pop(name, None)
        if action is not None and action.times > 1:  # armed for more hits: one fewer now
            _armed[name] = Action(action.kind, action.arg, action.times - 1)
    if action is None:
        return None
    logs.get().warning(f"failpoint {name} fired: {action}", failpoint=name, pid=os.getpid())
    if action.kind == "exit":
        os._exit(int(action.arg))
    if action.kind == "raise":
        raise FailpointFired(f"failpoint {name}")
    return action
