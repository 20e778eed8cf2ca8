"""``understudy logs JOB [--rank R] [--follow]``: a job's ranks' own output, read through the
daemons of the nodes that hold the files (``common/ranklogs.py`` has the protocol).

Each rank's processes are shown in the order they held the rank (a rank that moved has one
file per process, each on its node). Without ``--rank`` every rank's lines are shown, each
prefixed ``[rank R]``. With ``--follow`` a rank is followed until its process ends and its file
is shown to the end, and on into the process that takes the rank next, until the job is over
or the command is interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from understudy.cli.cluster import ClusterStatus, JobView, read_cluster
from understudy.common.errors import RecordError, StoreError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.ranklogs import LogChunk, LogFile, LogRequest
from understudy.common.records import JobSpec, JobStatus, decode_job_record
from understudy.common.store import EtcdStore, WatchEvent

#: the CLI's lease, which its requests and their answers are bound to
LEASE_TTL = 10
#: a node that sent nothing for this long is looked at (is it still online?)
SILENCE_S = 5.0
#: an online node that has not taken a request after this long is given up on
ANSWER_TIMEOUT_S = 15.0
#: how often a follower looks for a rank's next process, or the end of the job
POLL_S = 0.5


class LogsError(UnderstudyError):
    """Shown as one sentence; exit code 1."""


def check_request(status: ClusterStatus, name: str, rank: int | None) -> JobView:
    """The job to show, after checking the request against the cluster.

    Raises:
        UnknownJob: no such job. LogsError: ``rank`` is not one of its ranks.
    """
    job = status.require_job(name)
    world = world_size(job)
    if rank is not None and not 0 <= rank < world:
        raise LogsError(f"job {name!r} has ranks 0 to {world - 1}; there is no rank {rank}")
    return job


def world_size(job: JobView) -> int:
    """Ranks the job can have: its submitted shape (a reshape may have shrunk it since, and the
    ranks it dropped keep their logs)."""
    a = job.assignment
    return max(job.spec.world_size, len(a.ranks) if a is not None else 0)


@dataclass
class _Printer:
    """Writes one rank's bytes to ``out``: raw, or (``prefix``) whole lines each prefixed."""

    out: BinaryIO
    prefix: bytes = b""
    _partial: bytes = field(default=b"", repr=False)

    def write(self, data: bytes) -> None:
        if not self.prefix:
            self.out.write(data)
            self.out.flush()
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if lines:
            self.out.write(b"".join(self.prefix + line + b"\n" for line in lines))
            self.out.flush()

    def note(self, text: str) -> None:
        """A line of our own between two files (after a last line without a newline)."""
        self.end()
        self.out.write(self.prefix + text.encode() + b"\n")
        self.out.flush()

    def end(self) -> None:
        """The file ended: a last line without a newline is shown as a line."""
        if self._partial:
            self.out.write(self.prefix + self._partial + b"\n")
            self.out.flush()
            self._partial = b""


async def show(store: EtcdStore, keys: Keys, name: str, rank: int | None, follow: bool,
               out: BinaryIO | None = None, err: Callable[[str], None] | None = None) -> int:
    """Print the logs; returns the exit code (1 when a part could not be shown: its node is
    offline or did not answer, each said on ``err`` in one sentence).

    Raises:
        LogsError: unknown job, or a rank out of range (nothing is written to etcd then).
    """
    out = out if out is not None else sys.stdout.buffer
    err = err if err is not None else (lambda s: print(f"understudy: {s}", file=sys.stderr,
                                                       flush=True))
    job = check_request(await read_cluster(store, keys), name, rank)
    ranks = [rank] if rank is not None else list(range(world_size(job)))
    lease = await store.grant(LEASE_TTL)
    stop = asyncio.Event()
    keeper = asyncio.create_task(_keep(store, lease, stop), name="logs-lease")
    session = _Session(store, keys, name, lease, follow, err)
    try:
        results = await asyncio.gather(*(
            session.rank(r, _Printer(out, b"" if rank is not None else f"[rank {r}] ".encode()))
            for r in ranks))
    finally:
        stop.set()
        keeper.cancel()
        with contextlib.suppress(StoreError):
            await store.revoke(lease)  # takes every request and chunk with it
    if not any(results) and not follow:
        err(f"job {name!r} has no rank logs yet" if rank is None
            else f"rank {rank} of job {name!r} has no log yet")
    return 1 if session.failed else 0


async def _keep(store: EtcdStore, lease: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(StoreError):
            await store.keepalive(lease)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), LEASE_TTL / 3)


class _Session:
    def __init__(self, store: EtcdStore, keys: Keys, job: str, lease: int, follow: bool,
                 err: Callable[[str], None]) -> None:
        self.store, self.keys, self.job, self.lease = store, keys, job, lease
        self.follow, self.err = follow, err
        self.failed = False
        self.by = f"{getpass.getuser()}@{socket.gethostname()}"

    async def files(self, rank: int) -> list[LogFile]:
        """The rank's processes' files, in the order they held it."""
        kvs, _ = await self.store.get_prefix(f"{self.keys.log_files_of(self.job)}{rank}/")
        found = []
        for kv in kvs:
            with contextlib.suppress(RecordError):
                f = LogFile.decode(kv.value)
                if f.job == self.job and f.rank == rank:
                    found.append(f)
        return sorted(found, key=lambda f: (f.epoch, f.started_at))

    async def job_over(self) -> bool:
        """The job has ended (or is gone): no process will take a rank any more."""
        kvs, _ = await self.store.get_prefix(self.keys.jobs + self.job + "/")
        exists, ended = False, False
        for kv in kvs:
            with contextlib.suppress(RecordError):
                decoded = decode_job_record(Keys.name_of(kv.key, self.keys.jobs), kv.value)
                if decoded is not None and isinstance(decoded[2], JobStatus):
                    ended = decoded[2].state.ended
                exists = exists or (decoded is not None and isinstance(decoded[2], JobSpec))
        return not exists or ended

    async def rank(self, rank: int, printer: _Printer) -> int:
        """Show ``rank``'s files in order; returns how many were shown. Where the rank had more
        than one process, a line before each file says whose it is."""
        shown: set[tuple[str, int, int]] = set()
        while True:
            files = [f for f in await self.files(rank) if (f.node, f.pid, f.epoch) not in shown]
            for f in files:
                if len(files) + len(shown) > 1:
                    printer.note(f"==> rank {rank} from epoch {f.epoch}: process {f.pid} on "
                                 f"{f.node}, {f.path} <==")
                await self.stream(f, printer)
                shown.add((f.node, f.pid, f.epoch))
            if not self.follow or (not files and await self.job_over()):
                return len(shown)
            if not files:
                await asyncio.sleep(POLL_S)

    async def stream(self, f: LogFile, printer: _Printer) -> None:
        """One process's file, from its node's daemon, to the end (following: until the
        process ended and its file was sent to the end)."""
        rid = uuid.uuid4().hex
        req = LogRequest(id=rid, job=f.job, rank=f.rank, node=f.node, epoch=f.epoch, pid=f.pid,
                         lease=self.lease, follow=self.follow, requested_at=time.time(),
                         requested_by=self.by)
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        stop = asyncio.Event()
        rev = await self.store.put(self.keys.log_request(f.node, rid), req.encode(),
                                   lease=self.lease)
        watcher = asyncio.create_task(self._watch(rid, rev + 1, queue, stop),
                                      name=f"logs-watch-{rid}")
        where = f"the log of rank {f.rank} (process {f.pid} on {f.node})"
        try:
            seq, answered, waited = 0, False, 0.0
            pending: dict[int, LogChunk] = {}
            while True:
                try:
                    value = await asyncio.wait_for(queue.get(), SILENCE_S)
                except TimeoutError:
                    waited += SILENCE_S
                    if await self.store.get(self.keys.node(f.node)) is None:
                        self._fail(f"node {f.node} is offline: {where} cannot be shown"
                                   + (" to its end" if answered else ""))
                        return
                    if not answered and waited >= ANSWER_TIMEOUT_S:
                        self._fail(f"node {f.node} did not answer a request for {where}")
                        return
                    continue
                try:
                    chunk = LogChunk.decode(value)
                except RecordError:
                    continue
                answered, waited = True, 0.0
                if chunk.seq >= seq:  # a re-listed one may come twice
                    pending[chunk.seq] = chunk
                while seq in pending:
                    c = pending.pop(seq)
                    printer.write(c.data)
                    with contextlib.suppress(StoreError):  # else the lease takes it
                        await self.store.delete(self.keys.log_chunk(rid, seq))
                    seq += 1
                    if c.final:
                        printer.end()
                        if c.error:
                            self._fail(c.error)
                        return
        finally:
            stop.set()
            watcher.cancel()
            with contextlib.suppress(StoreError):
                await self.store.delete(self.keys.log_request(f.node, rid))

    async def _watch(self, rid: str, rev: int, queue: asyncio.Queue[bytes],
                     stop: asyncio.Event) -> None:
        async for item in self.store.watch_prefix(self.keys.log_chunks(rid), rev, stop):
            if isinstance(item, WatchEvent):
                if item.kind == "put":
                    queue.put_nowait(item.kv.value)
            else:  # RESYNC: events were lost; what is unread is still there
                with contextlib.suppress(StoreError):
                    for kv in (await self.store.get_prefix(self.keys.log_chunks(rid)))[0]:
                        queue.put_nowait(kv.value)

    def _fail(self, sentence: str) -> None:
        self.failed = True
        self.err(sentence)
