"""Starts the node's worker processes, sees each exit at once, and kills them on demand.

Children are started by fork+exec of a new program (``asyncio.create_subprocess_exec``; no Python
runs between fork and exec), never by a bare ``fork``: the daemon holds grpc channels, which are
not fork-safe. Each child leads its own session and process group, so signalling the group
reaches the whole tree (data-loader processes, compile workers); the group is also swept with
SIGKILL when its leader exits, so no orphan keeps a GPU busy.

A worker started with ``local_slots`` takes one of the node's worker slots (its GPUs): the
lowest index no live child holds, given to it as torchrun's ``LOCAL_RANK`` (and the slot count
as ``LOCAL_WORLD_SIZE``), from which a GPU job picks its device. The slot is the process's, not
the rank's: a standby promoted into a rank keeps its process and so its slot, and a slot is free
again once its child has exited (not merely been signalled: its memory may still be in use).

Each child writes its root cause to its own error file (``$UNDERSTUDY_ERROR_FILE``, see
:mod:`understudy.common.errorfile`); the supervisor reads it when it sees the exit and keeps the
first failure of the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import os
import re
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NamedTuple

from understudy.common import env as envvars
from understudy.common import logs
from understudy.common.errorfile import ErrorRecord, read_error
from understudy.common.errors import UnderstudyError

#: How long a child may take to die after SIGKILL before it is reported stuck (a process in
#: uninterruptible sleep, typically inside a GPU driver, ignores even SIGKILL until it wakes).
KILL_TIMEOUT_S = 5.0
#: How long ``close`` waits for the exit handlers (``on_exit``) still running before cancelling.
JOIN_TIMEOUT_S = 5.0

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class SpawnError(UnderstudyError):
    """A child could not be started (the program is missing, not executable...)."""


class ChildStuckError(UnderstudyError):
    """A child did not exit within the kill timeout after SIGKILL."""


class ChildState(enum.StrEnum):
    """A child process's lifecycle, as the supervisor sees it. Changed only by the child's waiter
    task, once, when the exit is seen (:attr:`ChildExit.state` decides which)::

        running -> exited    exit code 0, on its own or after being asked to stop
        running -> failed    non-zero exit code, or a signal the supervisor did not send
        running -> killed    the supervisor stopped it (stop, stop_all, kill_all_now) and it
                             ended by a signal or a non-zero code

    ``exited``, ``failed`` and ``killed`` are final; a new child of the same name is a new
    process with its own lifecycle. Only ``failed`` counts as a failure of the node.
    """

    RUNNING = "running"
    EXITED = "exited"
    FAILED = "failed"
    KILLED = "killed"


@dataclass
class ChildExit:
    """How one child ended. ``returncode`` is its exit code (None when a signal ended it),
    ``signal`` the signal that ended it (None when it exited); times are from the supervisor's
    clock."""

    name: str
    pid: int
    returncode: int | None
    signal: int | None
    started_at: float
    ended_at: float
    error: ErrorRecord | None
    stopped_by_us: bool

    @property
    def state(self) -> ChildState:
        if self.returncode == 0:
            return ChildState.EXITED
        if self.stopped_by_us:
            return ChildState.KILLED
        return ChildState.FAILED

    @property
    def failed(self) -> bool:
        return self.state == ChildState.FAILED

    def describe(self) -> str:
        """One sentence for operators, e.g. ``worker rank-3 (pid 123) failed with exit code 1:
        ValueError: bad batch (at train.py:42 in step)``."""
        who = f"worker {self.name} (pid {self.pid})"
        state = self.state
        if state == ChildState.EXITED:
            return f"{who} exited cleanly"
        if self.signal is not None:
            how = (f"was stopped by the daemon with {_signame(self.signal)}"
                   if state == ChildState.KILLED else f"was killed by {_signame(self.signal)}")
        else:
            how = (f"was stopped by the daemon and exited with code {self.returncode}"
                   if state == ChildState.KILLED else f"failed with exit code {self.returncode}")
        return f"{who} {how}: {self.error.summary()}" if self.error else f"{who} {how}"


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class ChildStatus(NamedTuple):
    pid: int
    state: ChildState


OnExit = Callable[[ChildExit], Awaitable[None] | None]


@dataclass(eq=False)
class _Child:
    name: str
    proc: asyncio.subprocess.Process
    error_file: Path
    started_at: float
    #: Set before the supervisor sends its first signal: the exit that follows is ours.
    stopping: bool = False
    exit: ChildExit | None = None
    #: Resolved with the exit as soon as it is known, before ``on_exit`` runs.
    done: asyncio.Future[ChildExit] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    waiter: asyncio.Task[None] | None = None
    #: The node's worker slot it holds (its ``LOCAL_RANK``), or None.
    slot: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


class Supervisor:
    """Owns the node's child processes.

    ``on_exit`` is called (and awaited, if it returns an awaitable) once per child, in that child's
    waiter task, after the exit is recorded; what it raises is logged and dropped. ``clock`` gives
    the wall-clock times in :class:`ChildExit`. Use from one event loop.
    """

    def __init__(self, run_dir: Path, on_exit: OnExit,
                 clock: Callable[[], float] = time.time,
                 kill_timeout: float = KILL_TIMEOUT_S, failpoints: bool = False) -> None:
        self.run_dir = Path(run_dir)
        #: the daemon's configuration enables failpoints: its children may arm them
        self.failpoints = failpoints
        self.error_dir = self.run_dir / "errors"
        self.on_exit = on_exit
        self.clock = clock
        self.kill_timeout = kill_timeout
        #: The node's first failure (state ``failed``) since the supervisor started.
        self.first_failure: ChildExit | None = None
        self.log = logs.get(component="supervisor")
        # The latest child of each name, live or ended.
        self._children: dict[str, _Child] = {}
        self._starting: set[str] = set()
        # Slots taken by children being started (not yet in ``_children``).
        self._starting_slots: set[int] = set()
        self._closed = False
        # Bumped by kill_all_now: a child whose start straddles a fence is killed at once.
        self._fences = 0

    # -- reading ---------------------------------------------------------------------------

    @property
    def children(self) -> dict[str, ChildStatus]:
        """The latest child of each name (live or ended): its pid and state."""
        return {name: ChildStatus(c.pid, c.exit.state if c.exit else ChildState.RUNNING)
                for name, c in self._children.items()}

    @property
    def running_count(self) -> int:
        return sum(1 for c in self._children.values() if c.exit is None)

    @property
    def slots_held(self) -> dict[str, int]:
        """The worker slot of each live child that holds one."""
        return {name: c.slot for name, c in self._children.items()
                if c.exit is None and c.slot is not None}

    def _free_slot(self) -> int:
        taken = set(self.slots_held.values()) | self._starting_slots
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def rename(self, old: str, new: str) -> None:
        """Give running child ``old`` the name ``new`` (a standby promoted into a rank keeps its
        process). Raises ValueError if ``old`` is not running or ``new`` is taken by a live
        child."""
        child = self._children.get(old)
        if child is None or child.exit is not None:
            raise ValueError(f"no running child named {old!r}")
        taken = self._children.get(new)
        if taken is not None and taken.exit is None:
            raise ValueError(f"a child named {new!r} is already running")
        del self._children[old]
        child.name = new
        self._children[new] = child
        self.log.info(f"Worker {old} is now {new}.", child=new, pid=child.pid)

    # -- starting --------------------------------------------------------------------------

    async def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                    cwd: str | os.PathLike[str] | None = None,
                    log_path: str | os.PathLike[str] | None = None,
                    output: int | None = None, local_slots: int | None = None) -> int:
        """Start ``argv`` as child ``name`` and return its pid.

        With ``local_slots`` (the node's worker slots) the child takes a slot: the lowest index
        no live child holds, as ``LOCAL_RANK``, with ``LOCAL_WORLD_SIZE=local_slots``. An
        ``env`` that sets ``LOCAL_RANK`` itself (a restart-only rank's torchrun variables)
        keeps it, and the child holds that slot. More live children than slots (which the
        planner does not make) get the next indexes, with a warning.

        The child gets the daemon's environment plus ``env``, plus ``UNDERSTUDY_CHILD=name``,
        ``UNDERSTUDY_ERROR_FILE`` (a fresh file under ``<run_dir>/errors``),
        ``UNDERSTUDY_DAEMON_PID`` (a worker dies with its daemon: ``worker.lifeline``) and
        ``UNDERSTUDY_FAILPOINTS_ENABLED`` (the daemon's decision, ``common/failpoints.py``; with
        failpoints off, the daemon's own ``UNDERSTUDY_FAILPOINTS`` is not passed on). Its stdin
        is /dev/null; stdout and stderr are the daemon's (the journal), or ``log_path``
        (appended), or the file descriptor ``output`` (a pipe the caller reads: the caller
        keeps it and closes it).

        Raises:
            ValueError: ``name`` is not a plain file-name-safe word, a child of that name is
                running, ``argv`` is empty, ``env`` sets a variable the supervisor owns, or the
                supervisor is closed.
            SpawnError: the program could not be started.
        """
        if not _NAME.fullmatch(name):
            raise ValueError(f"child name {name!r} must be 1-100 letters, digits, '.', '_' or "
                             "'-', starting with a letter or digit")
        if not argv:
            raise ValueError(f"child {name!r} has an empty argv")
        owned = {envvars.CHILD_NAME, envvars.CHILD_ERROR_FILE, envvars.DAEMON_PID,
                 envvars.FAILPOINTS_ENABLED} & set(env or {})
        if owned:
            raise ValueError(f"env of child {name!r} sets {sorted(owned)}, which the supervisor "
                             "sets itself")
        if self._closed:
            raise ValueError(f"cannot start child {name!r}: the supervisor is closed")
        live = self._children.get(name)
        if name in self._starting or (live is not None and live.exit is None):
            raise ValueError(f"a child named {name!r} is already running")

        slot, reserved = self._take_slot(name, env or {}, local_slots) if local_slots \
            else (None, False)
        slot_env = {} if slot is None else {envvars.TORCH_LOCAL_RANK: str(slot),
                                            envvars.TORCH_LOCAL_WORLD_SIZE: str(local_slots)}
        self._starting.add(name)
        fences = self._fences
        try:
            self.error_dir.mkdir(parents=True, exist_ok=True)
            error_file = self.error_dir / f"{name}-{uuid.uuid4().hex[:12]}.json"
            inherited = dict(os.environ)
            if not self.failpoints:  # the daemon ignored it (and said so): so do its workers
                inherited.pop(envvars.FAILPOINTS, None)
            child_env = {**inherited, **slot_env, **(env or {}), envvars.CHILD_NAME: name,
                         envvars.CHILD_ERROR_FILE: str(error_file),
                         envvars.DAEMON_PID: str(os.getpid()),
                         envvars.FAILPOINTS_ENABLED: "1" if self.failpoints else "0"}
            out: IO[bytes] | None = None
            try:
                if log_path is not None:
                    out = open(log_path, "ab")  # noqa: SIM115 - closed once the child holds it
                target: IO[bytes] | int | None = output if output is not None else out
                proc = await asyncio.create_subprocess_exec(
                    *argv, env=child_env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                    stdout=target, stderr=target, start_new_session=True, close_fds=True)
            except OSError as exc:
                raise SpawnError(f"could not start worker {name} ({argv[0]}): {exc}") from exc
            finally:
                if out is not None:
                    out.close()
            child = _Child(name=name, proc=proc, error_file=error_file,
                           started_at=self.clock(), slot=slot)
            self._children[name] = child
            child.waiter = asyncio.create_task(self._watch(child),
                                               name=f"supervisor-wait-{name}-{proc.pid}")
        finally:
            self._starting.discard(name)
            if reserved:
                self._starting_slots.discard(slot)
        self.log.info(f"Worker {name} started with pid {proc.pid}"
                      + ("." if slot is None else f" in slot {slot}."), child=name,
                      pid=proc.pid, slot=slot)
        if self._closed or self._fences != fences:
            # close() or kill_all_now() ran while this child was starting and could not see it.
            child.stopping = True
            self._signal_group(child, signal.SIGKILL)
        return proc.pid

    def _take_slot(self, name: str, env: Mapping[str, str],
                   local_slots: int) -> tuple[int | None, bool]:
        """The child's slot, and whether it is reserved here until the child is registered
        (not when the caller's ``env`` gave it)."""
        given = env.get(envvars.TORCH_LOCAL_RANK)
        if given is not None:
            return (int(given) if given.isdigit() else None), False
        slot = self._free_slot()
        if slot >= local_slots:
            self.log.warning(f"Worker {name} gets slot {slot}, past the node's {local_slots}: "
                             f"every slot is held ({self.slots_held}).", child=name, slot=slot)
        self._starting_slots.add(slot)
        return slot, True

    # -- the waiter: the one place a child's state changes -----------------------------------

    async def _watch(self, child: _Child) -> None:
        code = await child.proc.wait()
        ended = self.clock()
        # Sweep what the leader left in its group (orphaned grandchildren). The group's id
        # cannot be reused while any member lives, and the sweep follows the reap at once.
        self._signal_group(child, signal.SIGKILL)
        error: ErrorRecord | None = None
        try:
            error = read_error(child.error_file)
        except (OSError, ValueError) as exc:
            self.log.warning(f"Worker {child.name} left an unreadable error record: {exc}.",
                             child=child.name, path=str(child.error_file))
        exit_ = ChildExit(
            name=child.name, pid=child.pid,
            returncode=code if code >= 0 else None, signal=-code if code < 0 else None,
            started_at=child.started_at, ended_at=ended, error=error,
            stopped_by_us=child.stopping)
        child.exit = exit_
        if exit_.failed and self.first_failure is None:
            self.first_failure = exit_
        sentence = exit_.describe()
        log = self.log.error if exit_.failed else self.log.info
        log(sentence[:1].upper() + sentence[1:] + ".", child=child.name,
            pid=child.pid, state=str(exit_.state), returncode=exit_.returncode,
            signal=exit_.signal, runtime_s=round(ended - child.started_at, 3))
        child.done.set_result(exit_)
        try:
            result = self.on_exit(exit_)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.log.exception(f"The exit handler failed for worker {child.name}.",
                               child=child.name)

    # -- stopping --------------------------------------------------------------------------

    def _signal_group(self, child: _Child, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)

    async def stop(self, name: str, grace: float) -> ChildExit | None:
        """Stop child ``name``: SIGTERM to its process group, SIGKILL after ``grace`` seconds.

        Returns its exit (also when it had already ended), or None when no child has that name.
        Returns once the exit is known, possibly before ``on_exit`` has finished.

        Raises:
            ChildStuckError: it was still alive ``kill_timeout`` seconds after SIGKILL.
        """
        child = self._children.get(name)
        if child is None:
            return None
        if child.exit is not None:
            return child.exit
        child.stopping = True
        self._signal_group(child, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(child.done), max(0.0, grace))
        self.log.warning(f"Worker {name} (pid {child.pid}) did not stop within {grace:g} s of "
                         "SIGTERM; sending SIGKILL.", child=name, pid=child.pid)
        self._signal_group(child, signal.SIGKILL)
        try:
            return await asyncio.wait_for(asyncio.shield(child.done), self.kill_timeout)
        except TimeoutError:
            raise ChildStuckError(
                f"worker {name} (pid {child.pid}) did not exit within {self.kill_timeout:g} s "
                "of SIGKILL (stuck in the kernel?)") from None

    async def stop_all(self, grace: float) -> dict[str, ChildExit]:
        """Stop every running child concurrently (see :meth:`stop`); return their exits.
        A stuck child is logged and left out rather than raised."""
        names = [name for name, c in self._children.items() if c.exit is None]
        results = await asyncio.gather(*(self.stop(n, grace) for n in names),
                                       return_exceptions=True)
        exits: dict[str, ChildExit] = {}
        for name, result in zip(names, results, strict=True):
            if isinstance(result, ChildExit):
                exits[name] = result
            elif isinstance(result, ChildStuckError):
                self.log.error(f"{result}.", child=name)
            elif isinstance(result, BaseException):
                raise result
        return exits

    def kill_all_now(self) -> None:
        """SIGKILL every running child's process group at once, without awaiting (fencing).
        Follow with :meth:`wait_all` to see the exits."""
        self.kill_now(self._children)

    def kill_now(self, names: Iterable[str]) -> None:
        """SIGKILL these running children's process groups at once, without awaiting (fencing
        the ranks that were replaced); a start in progress is killed too."""
        self._fences += 1
        for name in names:
            child = self._children.get(name)
            if child is not None and child.exit is None:
                child.stopping = True
                self._signal_group(child, signal.SIGKILL)

    async def wait_all(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every running child to end; True if all did."""
        pending = [c for c in self._children.values() if c.exit is None]
        if not pending:
            return True
        futures = [asyncio.shield(c.done) for c in pending]
        _, still = await asyncio.wait(futures, timeout=timeout)
        for f in still:
            f.cancel()  # cancels the shield only; the child's own future stays
        stuck = [c for c in pending if c.exit is None]
        if stuck:
            self.log.error(f"{len(stuck)} worker(s) still alive {timeout:g} s after being "
                           "waited for: " + ", ".join(f"{c.name} (pid {c.pid})" for c in stuck)
                           + ".", children=[c.name for c in stuck])
        return not stuck

    async def close(self, grace: float) -> None:
        """Refuse new children, stop every running one (see :meth:`stop_all`), then join the
        waiter tasks, cancelling any still running after ``JOIN_TIMEOUT_S``."""
        self._closed = True
        await self.stop_all(grace)
        tasks = [c.waiter for c in self._children.values()
                 if c.waiter is not None and not c.waiter.done()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=JOIN_TIMEOUT_S)
        for task in pending:
            self.log.warning(f"Task {task.get_name()} did not finish in time; cancelling it.")
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
