"""Each rank's own output in a file of its own (``common/ranklogs.py`` names them).

A worker's stdout and stderr are one pipe; the daemon reads it on its event loop and appends
what comes to the process's file, rotating it at ``rank_logs.max_bytes`` (``<file>.1``,
``<file>.2``...; ``rank_logs.files`` kept). The daemon, not the child, writes the file: so the
cap holds to the byte, a promoted standby or a renumbered rank continues in a file under its
new name, and the end of the pipe says the file is complete (``understudy logs --follow``
stops there). The pipe's buffer is raised to 1 MiB, so a daemon busy for a moment does not
stall a rank's print. A worker dies with its daemon anyway (``worker.lifeline``); a write after
that fails with a broken pipe, not into the journal.

The daemon's own log (the journal) carries none of this. Each rank's file is indexed in etcd
(:class:`LogFile` under ``logs/files/``) when the process takes the rank, so the CLI knows
which node to ask for which process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from understudy.common import logs
from understudy.common.config import Config
from understudy.common.errors import StoreError
from understudy.common.keys import Keys
from understudy.common.ranklogs import LogFile, rank_file, rotated, standby_file
from understudy.common.store import EtcdStore, wait_any

#: Linux's F_SETPIPE_SZ (not in Python's fcntl before 3.12's constants on every build)
_F_SETPIPE_SZ = 1031
PIPE_BYTES = 1024 * 1024
#: after a process ends, how long its pipe may stay open (a grandchild that left its process
#: group still holds it) before the file is closed anyway
EOF_GRACE_S = 2.0


class RotatingFile:
    """Appends to ``path``; once it holds ``max_bytes``, it becomes ``path.1`` (``path.1``
    becomes ``path.2``...; ``files`` kept in all, the oldest dropped) and a new ``path`` begins.
    Unbuffered: a reader sees each write at once. Raises OSError as the file system does."""

    def __init__(self, path: Path, max_bytes: int, files: int) -> None:
        self.path, self.max_bytes, self.files = path, max_bytes, files
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()
        self.size = self._f.tell()

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            room = self.max_bytes - self.size
            if room <= 0:
                self._rotate()
                continue
            n = self._f.write(view[:room]) or 0
            self.size += n
            view = view[n:]

    def _rotate(self) -> None:
        self._f.close()
        for i in range(self.files - 1, 0, -1):
            src = self.path.with_name(rotated(self.path.name, i - 1))
            with contextlib.suppress(FileNotFoundError):
                os.replace(src, self.path.with_name(rotated(self.path.name, i)))
        if self.files == 1:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self.size = 0

    def close(self) -> None:
        self._f.close()


def segments(path: Path, files: int) -> list[Path]:
    """The files of ``path`` that exist, oldest first (``path.N`` ... ``path.1``, ``path``)."""
    out = [path.with_name(rotated(path.name, i)) for i in range(files - 1, -1, -1)]
    return [p for p in out if p.exists()]


class Output:
    """One worker process's output: the pipe it writes and the file that takes it now."""

    def __init__(self, pid: int, file: RotatingFile | None) -> None:
        self.pid = pid
        #: None: the file could not be opened; the output is read and dropped (a rank's print
        #: must not fail because its log cannot be written)
        self.file = file
        #: set once the pipe has ended (or was given up) and every byte is in the file
        self.finished = False
        #: bytes lost to a file that could not be written (a full disk)
        self.dropped = 0
        self._wake = asyncio.Event()
        self._transport: asyncio.ReadTransport | None = None

    def writing(self, path: Path) -> bool:
        """Whether bytes may still be appended to ``path`` (or its rotations) by this process."""
        return not self.finished and self.file is not None and self.file.path == path

    def woken(self) -> asyncio.Event:
        """An event set at the next write, switch of file or end."""
        return self._wake

    def _poke(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    def write(self, data: bytes) -> None:
        if self.finished or self.file is None:
            return
        try:
            self.file.write(data)
        except OSError as exc:
            self.dropped += len(data)
            if self.dropped == len(data):  # said once per process
                logs.get(component="rank-logs").warning(
                    "Cannot write a worker's output to its log file; dropping it.",
                    path=str(self.file.path), pid=self.pid, error=str(exc))
        self._poke()

    def switch(self, file: RotatingFile) -> None:
        old, self.file = self.file, file
        if old is not None:
            old.close()
        self._poke()

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._transport is not None:
            self._transport.close()
        if self.file is not None:
            self.file.close()
        self._poke()


class _Pump(asyncio.Protocol):
    def __init__(self, out: Output) -> None:
        self.out = out

    def data_received(self, data: bytes) -> None:
        self.out.write(data)

    def eof_received(self) -> bool | None:
        self.out.finish()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.out.finish()


class RankLogs:
    """The node's worker outputs, by pid, and their index in etcd."""

    def __init__(self, cfg: Config, store: EtcdStore, stop: asyncio.Event,
                 wall: Callable[[], float] = time.time) -> None:
        self.dir = cfg.rank_log_dir
        self.max_bytes, self.files = cfg.rank_logs.max_bytes, cfg.rank_logs.files
        self.node = cfg.node
        self.store, self.keys, self.stop, self.wall = store, Keys(cfg.etcd.prefix), stop, wall
        self.log = logs.get(node=cfg.node, component="rank-logs")
        #: pid -> its output, live or ended (an ended one is dropped when its process's
        #: successor of the same pid comes, or at close)
        self.outputs: dict[int, Output] = {}
        #: index records not yet in etcd
        self._pending: list[LogFile] = []
        self._kick = asyncio.Event()

    def path(self, job: str, rank: int | None, epoch: int, pid: int) -> Path:
        name = standby_file(pid) if rank is None else rank_file(rank, epoch, pid)
        return self.dir / job / name

    @staticmethod
    def pipe() -> tuple[int, int]:
        """A pipe for a child's stdout and stderr: (read end, write end). The caller passes the
        write end to the child and closes it, and gives the read end to :meth:`attach`."""
        r, w = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a smaller buffer still works
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        return r, w

    async def attach(self, read_fd: int, pid: int, job: str, rank: int | None,
                     epoch: int) -> None:
        """Copy what process ``pid`` writes on the pipe ``read_fd`` (which this takes over)
        into its file: ``rank``'s from ``epoch`` on, or (None) a standby worker's. A file that
        cannot be opened is logged, and the output read and dropped."""
        path = self.path(job, rank, epoch, pid)
        file: RotatingFile | None = None
        try:
            file = RotatingFile(path, self.max_bytes, self.files)
        except OSError as exc:
            self.log.error("Cannot open a worker's log file; its output is dropped.",
                           path=str(path), error=str(exc), job=job, rank=rank, pid=pid)
        out = Output(pid, file)
        self.outputs[pid] = out
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: _Pump(out), pipe)
        out._transport = transport
        if rank is not None and file is not None:
            self._index(job, rank, epoch, pid, path)

    def retarget(self, pid: int, job: str, rank: int, epoch: int) -> None:
        """Process ``pid`` holds ``rank`` from ``epoch`` on (a standby promoted, a rank
        renumbered by a reshape): what it writes from now on goes to that rank's file."""
        out = self.outputs.get(pid)
        if out is None or out.finished:
            return
        path = self.path(job, rank, epoch, pid)
        if out.writing(path):
            return
        try:
            out.switch(RotatingFile(path, self.max_bytes, self.files))
        except OSError as exc:
            self.log.warning("Cannot open a rank's new log file; its output goes on to the old "
                             "one.", path=str(path), error=str(exc), job=job, rank=rank)
            return
        self._index(job, rank, epoch, pid, path)

    def ended(self, pid: int) -> None:
        """Process ``pid`` ended: its output is complete once the pipe drains (a grandchild
        still holding the pipe is given :data:`EOF_GRACE_S`)."""
        out = self.outputs.get(pid)
        if out is not None and not out.finished:
            asyncio.get_running_loop().call_later(EOF_GRACE_S, out.finish)

    def find(self, path: Path) -> Output | None:
        """The live output that writes ``path``, if any."""
        return next((o for o in self.outputs.values() if o.writing(path)), None)

    async def close(self, timeout: float = 1.0) -> None:
        """Once the workers are gone: let each pipe drain (for up to ``timeout`` seconds in
        all), then close every file."""
        deadline = time.monotonic() + timeout
        for out in list(self.outputs.values()):
            while not out.finished and time.monotonic() < deadline:
                await wait_any((out.woken(),), deadline - time.monotonic())
            out.finish()

    def _index(self, job: str, rank: int, epoch: int, pid: int, path: Path) -> None:
        self._pending.append(LogFile(job=job, rank=rank, node=self.node, epoch=epoch, pid=pid,
                                     started_at=self.wall(), path=str(path.absolute())))
        self._kick.set()
        for old in [p for p, o in self.outputs.items() if o.finished]:
            del self.outputs[old]  # ended processes' files are served from disk

    async def run(self) -> None:
        """Write the index records to etcd, retried until it takes them or the daemon stops."""
        while not self.stop.is_set():
            await wait_any((self._kick, self.stop), 2.0)
            self._kick.clear()
            while self._pending and not self.stop.is_set():
                rec = self._pending[0]
                try:
                    await self.store.put(self.keys.log_file(rec.job, rec.rank, rec.epoch,
                                                            rec.node, rec.pid), rec.encode())
                except StoreError as exc:
                    self.log.debug("Cannot index a rank's log file yet; will retry.",
                                   error=str(exc), job=rec.job, rank=rec.rank)
                    break
                self._pending.pop(0)
