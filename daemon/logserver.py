"""Answers ``understudy logs``: reads the rank log files this node holds and writes them into
etcd, chunk by chunk, for the CLI that asked (``common/ranklogs.py`` has the protocol).

Bounded: at most :data:`MAX_SERVING` requests sending at a time (more wait their turn; a
follower waiting for its process to write more does not count), at most :data:`WINDOW` chunks of
:data:`CHUNK_BYTES` unread per request, every value bound to the asking CLI's lease (gone with
it). A value under this node's requests that is not a valid
request is counted (``understudy_bad_values_total{collection="log-requests"}``), logged once
and ignored; a request for a file this node does not hold is answered with one sentence.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import BinaryIO

from understudy.common import logs
from understudy.common.errors import RecordError, StoreError
from understudy.common.keys import Keys
from understudy.common.ranklogs import (
    CHUNK_BYTES,
    MAX_SERVING,
    WINDOW,
    LogChunk,
    LogRequest,
)
from understudy.common.store import RESYNC, EtcdStore, WatchEvent, wait_any
from understudy.daemon.metrics import BadValues, Metrics
from understudy.daemon.ranklogs import RankLogs, segments

#: how often a follower with nothing new looks at its file anyway (a write it missed)
IDLE_POLL_S = 1.0
#: how often a full window is looked at again for a chunk the reader has taken
WINDOW_POLL_S = 0.05


class _Gone(Exception):
    """The request went away (its CLI's lease ended) while it was answered."""


class LogServer:
    def __init__(self, ranklogs: RankLogs, store: EtcdStore, metrics: Metrics,
                 stop: asyncio.Event) -> None:
        self.ranklogs, self.store, self.metrics, self.stop = ranklogs, store, metrics, stop
        self.node = ranklogs.node
        self.keys = Keys(ranklogs.keys.prefix)
        self.prefix = self.keys.log_requests(self.node)
        self.log = logs.get(node=self.node, component="log-server")
        self._serving: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(MAX_SERVING)
        self._bad_values = BadValues(metrics, self.log)

    async def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    kvs, rev = await self.store.get_prefix(self.prefix)
                except StoreError:
                    await wait_any((self.stop,), 0.5)
                    continue
                for kv in kvs:
                    self._on_put(kv.key, kv.value, kv.mod_revision)
                async for item in self.store.watch_prefix(self.prefix, rev + 1, self.stop):
                    if item is RESYNC:
                        break  # re-list
                    assert isinstance(item, WatchEvent)
                    if item.kind == "put":
                        self._on_put(item.kv.key, item.kv.value, item.kv.mod_revision)
                    else:
                        task = self._serving.pop(Keys.name_of(item.kv.key, self.prefix), None)
                        if task is not None:
                            task.cancel()
        finally:
            tasks = list(self._serving.values())
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2)

    def _on_put(self, key: str, value: bytes, revision: int) -> None:
        name = Keys.name_of(key, self.prefix)
        if name in self._serving:
            return  # a request is written once; a rewrite changes nothing
        try:
            req = LogRequest.decode(value)
            if req.id != name or req.node != self.node:
                raise RecordError(f"log request {req.id!r} for node {req.node!r} is under "
                                  f"{key!r}")
        except RecordError as exc:
            self._bad_values.found("log-requests", key, revision, str(exc))
            return
        task = asyncio.create_task(self._serve(req), name=f"log-request-{req.id}")
        self._serving[req.id] = task
        task.add_done_callback(lambda t: self._done(req.id, t))

    def _done(self, request: str, task: asyncio.Task[None]) -> None:
        if self._serving.get(request) is task:
            del self._serving[request]
        if not task.cancelled() and task.exception() is not None:
            self.metrics.errors.labels(kind="log-request").inc()
            self.log.error("Answering a log request failed.", request=request,
                           exc_info=task.exception())

    async def _serve(self, req: LogRequest) -> None:
        answer = _Answer(self, req)
        try:
            await answer.run()
        except (_Gone, StoreError) as exc:
            self.log.debug("Stopped answering a log request.", request=req.id, error=str(exc))
        finally:
            answer.release()


class _Answer:
    """One request's answer: its file's bytes in order, across rotations, as chunks."""

    def __init__(self, server: LogServer, req: LogRequest) -> None:
        self.server, self.req = server, req
        self.store, self.keys = server.store, server.keys
        self.seq = 0
        self.path: Path = server.ranklogs.path(req.job, req.rank, req.epoch, req.pid)
        #: holds one of the server's slots: while it has bytes to send, not while it follows a
        #: quiet process (so followers of every rank of a node never starve a request)
        self.holding = False

    def release(self) -> None:
        if self.holding:
            self.holding = False
            self.server._slots.release()

    async def _acquire(self) -> None:
        if not self.holding:
            await self.server._slots.acquire()
            self.holding = True

    async def run(self) -> None:
        req, files = self.req, self.server.ranklogs.files
        opened: list[BinaryIO] = []
        await self._acquire()
        try:
            for p in segments(self.path, files):
                with contextlib.suppress(FileNotFoundError):  # rotated away meanwhile
                    opened.append(open(p, "rb"))  # noqa: SIM115 - closed below
            if not opened:
                await self._send(b"", final=True,
                                 error=f"node {req.node} holds no log of rank {req.rank} of job "
                                       f"{req.job} from process {req.pid} (epoch {req.epoch})")
                return
            await self._stream(opened, req.offset)
        finally:
            for f in opened:
                f.close()

    async def _stream(self, opened: list[BinaryIO], skip: int) -> None:
        i = 0
        sent_any = False
        while True:
            out = self.server.ranklogs.find(self.path)
            wake = out.woken() if out is not None else None
            data = opened[i].read(CHUNK_BYTES)
            if data:
                if skip >= len(data):
                    skip -= len(data)
                    continue
                data, skip = data[skip:], 0
                await self._send(data)
                sent_any = True
                continue
            if i + 1 < len(opened):
                i += 1
                continue
            # At the end of the newest file opened: it may have been rotated since.
            try:
                now = os.stat(self.path).st_ino
            except FileNotFoundError:
                now = None
            if now is not None and now != os.fstat(opened[i].fileno()).st_ino:
                rest = opened[i].read()
                if rest:  # written just before the rotation
                    opened[i].seek(-len(rest), os.SEEK_CUR)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    opened.append(open(self.path, "rb"))  # noqa: SIM115 - closed by run()
                continue
            if not self.req.follow or out is None:
                break
            if not sent_any:
                await self._send(b"")  # says the request is taken, the file still empty
                sent_any = True
            assert wake is not None
            self.release()
            await wait_any((wake, self.server.stop), IDLE_POLL_S)
            if self.server.stop.is_set():
                raise _Gone("the daemon is stopping")
            await self._acquire()
        await self._send(b"", final=True)

    async def _send(self, data: bytes, final: bool = False, error: str = "") -> None:
        """Write the next chunk once fewer than WINDOW are unread; under the request's lease,
        so a put after the CLI went fails."""
        if self.seq >= WINDOW:
            older = self.keys.log_chunk(self.req.id, self.seq - WINDOW)
            while await self.store.get(older) is not None:
                await wait_any((self.server.stop,), WINDOW_POLL_S)
                if self.server.stop.is_set():
                    raise _Gone("the daemon is stopping")
        chunk = LogChunk(request=self.req.id, seq=self.seq, data=data, final=final, error=error)
        try:
            await self.store.put(self.keys.log_chunk(self.req.id, self.seq), chunk.encode(),
                                 lease=self.req.lease)
        except StoreError as exc:
            raise _Gone(f"cannot answer (the asking CLI's lease is gone?): {exc}") from exc
        self.seq += 1
