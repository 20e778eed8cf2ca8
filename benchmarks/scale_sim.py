"""Simulated nodes for ``scale.py``: many per process, each one looking to the controller
exactly like a real ``understudyd``.

Each simulated node is the daemon's own :class:`NodeAgent` (its records, its registration
transaction, its registry compare-and-swap, its events and its state changes), with a real etcd
lease. What is simulated is only the process around it: no workers, no local socket, and the
keep-alives, which keep-alive processes of their own (``KeepAliveSender``, so the nodes'
registrations cannot delay them) send for all nodes of the fleet on long-lived
``LeaseKeepAlive`` streams (one message per lease per interval, as etcd's Go client multiplexes
its leases) instead of one stream per keep-alive as aetcd does; N streams per interval would
cost more CPU than the two-core machine has. A node "crashes" when its keep-alives stop: its
lease expires at etcd a TTL after the last one, the way a kill -9 or a partition looks.

With ``daemon_traffic``, each node also sends the periodic reads and holds the watches a real
daemon does besides its keep-alives (read off ``daemon/node.py``, ``daemon/jobs.py`` and
``daemon/controller.py``): the own-keys reconcile (Range of its drain request, registry entry
and node record) on a change to them and every ``OWN_KEYS_RESYNC_S``; the job runner's Range of
the whole ``jobs/`` prefix at its start and every ``JOBS_RELIST_S`` (+-20 %), its listing kept
current by its watch in between (no read per change); and the controller campaign of a
non-leader (a Range of the controller key, then a watch of it for up to
``CAMPAIGN_RECHECK_S``); and four watches: its three own keys and ``jobs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from understudy.common import config as config_mod
from understudy.common.errors import StoreError
from understudy.common.keys import Keys
from understudy.common.records import ControllerRecord
from understudy.common.states import NodeState
from understudy.common.store import EtcdStore
from understudy.daemon.controller import CAMPAIGN_RECHECK_S
from understudy.daemon.events import EventLog
from understudy.daemon.jobs import JOBS_RELIST_S
from understudy.daemon.metrics import Metrics
from understudy.daemon.node import OWN_KEYS_RESYNC_S, NodeAgent

MIB = 1024 * 1024


class NoWorkers:
    """A simulated node runs no worker processes."""

    running_count = 0

    def kill_all_now(self) -> None:
        pass

    async def stop_all(self, grace: float) -> None:
        pass


@dataclass
class SimNode:
    name: str
    role: str
    agent: NodeAgent
    alive: bool = True
    lost_at: float | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class LoopLag:
    """How late a ``period`` sleep wakes up on this event loop: the time every other task
    on the loop (a keep-alive write among them) waited for the CPU or for other tasks."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.window_max = 0.0  # since the last ``take``
        self.max = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(self.period)
            lag = time.monotonic() - t - self.period
            self.window_max = max(self.window_max, lag)
            self.max = max(self.max, lag)

    def take(self) -> float:
        v, self.window_max = self.window_max, 0.0
        return v


class KeepAlives:
    """Keep-alives for every live lease it is given, spread evenly over ``interval``, on
    ``streams`` long-lived bidirectional ``LeaseKeepAlive`` streams; a lease's first one is
    sent as soon as it is added, as the daemon's keep-alive loop does right after it registers.

    A lease not acknowledged for a full ``ttl`` has expired at etcd (etcd renewed it before
    it answered), and no keep-alive is sent for it again: etcd 3.4 answers a keep-alive of an
    expired lease only once the lease's revocation is applied, and its stream answers nothing
    else meanwhile, so one expired lease would stall every lease sharing its stream. A real
    daemon has a stream of its own (aetcd opens one per keep-alive): hence many streams here,
    each carrying few leases.

    Instrumented, per window between two ``stats`` calls: the longest gap between two
    keep-alives of one lease (what etcd sees; above the TTL the lease expires), the longest
    wait of a stream write and the longest keep-alive -> reply time per stream, the longest
    round, the oldest unanswered lease, and the event loop's lag."""

    def __init__(self, endpoint: str, interval: float, streams: int, ttl: float,
                 on_expired: Callable[[int], None]) -> None:
        self.endpoint, self.interval, self.nstreams, self.ttl = endpoint, interval, streams, ttl
        self.on_expired = on_expired
        self.leases: dict[int, float] = {}  # lease -> when etcd last acknowledged it
        self.last_sent: dict[int, float] = {}
        self.sent = 0
        self.acked = 0
        self.late_s = 0.0  # how far behind schedule a round fell, at most
        self.lag = LoopLag()
        self._inflight: list[collections.deque[float]] = []
        self._locks: list[asyncio.Lock] = []  # a gRPC stream takes one write at a time
        self._w: dict[str, float] = {}
        self._w_stream: list[dict[str, float]] = []
        self._channels: list[Any] = []
        self._calls: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._k = 0

    async def start(self) -> None:
        for s in range(self.nstreams):
            ch = rpc.insecure_channel(self.endpoint)
            self._channels.append(ch)
            call = rpc.LeaseStub(ch).LeaseKeepAlive()
            self._calls.append(call)
            self._inflight.append(collections.deque())
            self._locks.append(asyncio.Lock())
            self._w_stream.append({"write_wait_s": 0.0, "reply_s": 0.0})
            self._tasks.append(asyncio.create_task(self._read(s, call), name="keepalive-read"))
        self._tasks.append(asyncio.create_task(self._send(), name="keepalive-send"))
        self._tasks.append(asyncio.create_task(self.lag.run(self._stop), name="loop-lag"))

    def _wmax(self, key: str, v: float) -> None:
        if v > self._w.get(key, 0.0):
            self._w[key] = v

    async def add(self, lease: int) -> None:
        now = time.monotonic()
        self.leases[lease] = now
        await self._write(lease)

    def remove(self, lease: int) -> tuple[float, float | None]:
        """Stop the lease's keep-alives; returns when, and when it was last acknowledged."""
        last = self.leases.pop(lease, None)
        self.last_sent.pop(lease, None)
        return time.monotonic(), last

    async def _write(self, lease: int) -> None:
        self._k += 1
        s = self._k % len(self._calls)
        now = time.monotonic()
        prev = self.last_sent.get(lease)
        if prev is not None:
            self._wmax("send_gap_s", now - prev)
        self.last_sent[lease] = now
        async with self._locks[s]:
            self._inflight[s].append(time.monotonic())
            await self._calls[s].write(rpc.LeaseKeepAliveRequest(ID=lease))
        w = time.monotonic() - now
        if w > self._w_stream[s]["write_wait_s"]:
            self._w_stream[s]["write_wait_s"] = w
        self.sent += 1

    async def _read(self, s: int, call: Any) -> None:
        while not self._stop.is_set():
            try:
                reply = await call.read()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                return
            if reply is grpc.aio.EOF:
                return
            now = time.monotonic()
            self.acked += 1
            if self._inflight[s]:
                r = now - self._inflight[s].popleft()
                if r > self._w_stream[s]["reply_s"]:
                    self._w_stream[s]["reply_s"] = r
            if reply.ID not in self.leases:
                continue
            if reply.TTL <= 0:
                self.leases.pop(reply.ID, None)
                self.last_sent.pop(reply.ID, None)
                self.on_expired(reply.ID)
            else:
                self.leases[reply.ID] = now

    async def _send(self) -> None:
        """Rounds of one keep-alive per lease, each round spread evenly over ``interval`` in
        slices of ``tick``."""
        tick = 0.01
        while not self._stop.is_set():
            order = list(self.leases)
            t0 = time.monotonic()
            i = 0
            while i < len(order):
                due = min(len(order), math.ceil(len(order) * (time.monotonic() - t0 + tick)
                                                / self.interval))
                now = time.monotonic()
                for lease in order[i:due]:
                    if lease not in self.leases:
                        continue  # stopped meanwhile: a crashed node sends nothing
                    if now - self.leases[lease] > self.ttl:
                        self.leases.pop(lease)
                        self.last_sent.pop(lease, None)
                        self.on_expired(lease)
                        continue
                    try:
                        await self._write(lease)
                    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        return
                i = max(i, due)
                if i < len(order):
                    await asyncio.sleep(tick)
            self._wmax("round_s", time.monotonic() - t0)
            wait = t0 + self.interval - time.monotonic()
            self.late_s = max(self.late_s, -wait)
            await asyncio.sleep(max(wait, 0.0))

    def stats(self) -> dict[str, Any]:
        """Counters, and the window maxima since the last call (which starts a new window)."""
        now = time.monotonic()
        out: dict[str, Any] = {
            "t": now, "leases": len(self.leases), "sent": self.sent, "acked": self.acked,
            "late_s": self.late_s, "loop_lag_s": self.lag.take(),
            "oldest_ack_s": max((now - a for a in self.leases.values()), default=0.0),
            "send_gap_s": 0.0, "round_s": 0.0, **self._w,
            "write_wait_s": [w["write_wait_s"] for w in self._w_stream],
            "reply_s": [w["reply_s"] for w in self._w_stream],
        }
        self._w = {}
        for w in self._w_stream:
            w["write_wait_s"] = w["reply_s"] = 0.0
        return out

    async def close(self) -> None:
        self._stop.set()
        for call in self._calls:
            with contextlib.suppress(Exception):
                await call.done_writing()
            call.cancel()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in self._channels:
            with contextlib.suppress(Exception):
                await ch.close()


STATS_EVERY_S = 0.5


async def keepalive_process(endpoint: str, interval: float, streams: int, ttl: float
                            ) -> None:
    """``--keepalive-child``: a ``KeepAlives`` of its own, so no other simulated work shares
    its event loop. Reads ``+<lease>`` (start) and ``-<lease>`` (stop) lines on stdin; writes
    JSON lines: ``{"expired": lease}``, ``{"removed": lease, "t": .., "last_ack": ..}`` and,
    every ``STATS_EVERY_S``, ``{"stats": ...}`` (``time.monotonic`` is the same clock in every
    process of the machine)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MIB)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    ka = KeepAlives(endpoint, interval, streams, ttl, lambda lease: emit({"expired": lease}))
    await ka.start()

    async def report() -> None:
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            emit({"stats": ka.stats()})

    reporter = asyncio.create_task(report(), name="keepalive-stats")
    try:
        async for line in reader:
            op, lease = line[:1], int(line[1:])
            if op == b"+":
                await ka.add(lease)
            elif op == b"-":
                t, last = ka.remove(lease)
                emit({"removed": lease, "t": t, "last_ack": last})
    finally:
        reporter.cancel()
        await ka.close()


class KeepAliveSender:
    """The fleet's keep-alives, sent by ``procs`` child processes (leases sharded by id), or
    on the simulator's own event loop when ``procs`` is 0 (how the first 4,096-node run sent
    them). Either way ``stats_log`` collects each sender's ``KeepAlives.stats`` every
    ``STATS_EVERY_S``."""

    def __init__(self, endpoint: str, interval: float, streams: int, procs: int, ttl: float,
                 on_expired: Callable[[int], None]) -> None:
        self.endpoint, self.interval, self.streams, self.nprocs = (endpoint, interval,
                                                                   streams, procs)
        self.ttl = ttl
        self.on_expired = on_expired
        self.stats_log: list[dict[str, Any]] = []  # each with "sender": its index
        self.procs: list[asyncio.subprocess.Process] = []
        self._sent: list[int] = []
        self._local: KeepAlives | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._removed: dict[int, asyncio.Future[tuple[float, float | None]]] = {}

    @property
    def sent(self) -> int:
        return self._local.sent if self._local is not None else sum(self._sent)

    @property
    def late_s(self) -> float:
        return max((s["late_s"] for s in self.stats_log), default=0.0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def start(self) -> None:
        if self.nprocs == 0:
            self._local = KeepAlives(self.endpoint, self.interval, self.streams, self.ttl,
                                     self.on_expired)
            await self._local.start()
            self._tasks.append(asyncio.create_task(self._local_stats(), name="ka-stats"))
            return
        for i in range(self.nprocs):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(Path(__file__).resolve()), "--keepalive-child",
                self.endpoint, str(self.interval), str(self.streams), str(self.ttl),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=MIB,
                start_new_session=True)
            self.procs.append(proc)
            self._sent.append(0)
            self._tasks.append(asyncio.create_task(self._read(i, proc), name=f"ka-read {i}"))

    async def _local_stats(self) -> None:
        assert self._local is not None
        while True:
            await asyncio.sleep(STATS_EVERY_S)
            self.stats_log.append({**self._local.stats(), "sender": 0})

    async def _read(self, i: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            msg = json.loads(line)
            if "stats" in msg:
                self._sent[i] = msg["stats"]["sent"]
                self.stats_log.append({**msg["stats"], "sender": i})
            elif "expired" in msg:
                self.on_expired(msg["expired"])
            elif "removed" in msg:
                fut = self._removed.pop(msg["removed"], None)
                if fut is not None and not fut.done():
                    fut.set_result((msg["t"], msg["last_ack"]))

    def _proc(self, lease: int) -> asyncio.subprocess.Process:
        return self.procs[lease % len(self.procs)]

    async def add(self, lease: int) -> None:
        if self._local is not None:
            await self._local.add(lease)
            return
        stdin = self._proc(lease).stdin
        assert stdin is not None
        stdin.write(b"+%d\n" % lease)
        await stdin.drain()

    async def remove(self, lease: int) -> tuple[float, float | None]:
        """Stop the lease's keep-alives: (when, when etcd last acknowledged one)."""
        if self._local is not None:
            return self._local.remove(lease)
        fut = asyncio.get_running_loop().create_future()
        self._removed[lease] = fut
        stdin = self._proc(lease).stdin
        assert stdin is not None
        stdin.write(b"-%d\n" % lease)
        await stdin.drain()
        return await asyncio.wait_for(fut, 10)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Maxima over the senders' stats windows that ended in [t0, t1]."""
        rows = [s for s in self.stats_log if t0 < s["t"] <= t1 + STATS_EVERY_S]
        if not rows:
            return {}
        return {k: max(max(r[k]) if isinstance(r[k], list) else r[k] for r in rows)
                for k in ("loop_lag_s", "send_gap_s", "round_s", "oldest_ack_s",
                          "write_wait_s", "reply_s")}

    async def close(self) -> None:
        if self._local is not None:
            await self._local.close()
        for p in self.procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            await p.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Fleet:
    """N simulated nodes over ``channels`` shared etcd connections."""

    def __init__(self, endpoint: str, prefix: str, ttl: int, keepalive_interval: float,
                 channels: int = 4, keepalive_streams: int = 4, keepalive_procs: int = 2,
                 daemon_traffic: bool = False, seed: int = 1) -> None:
        self.endpoint, self.prefix, self.ttl = endpoint, prefix, ttl
        self.keys = Keys(prefix)
        self.daemon_traffic = daemon_traffic
        self.rng = random.Random(seed)
        self.keepalive_interval = keepalive_interval
        self.metrics = Metrics()  # one registry for all: nothing reads a simulated node's
        self.stores = [EtcdStore(self._cfg("sim-config").etcd) for _ in range(channels)]
        self.nodes: dict[str, SimNode] = {}
        self.stop = asyncio.Event()
        self.keepalives = KeepAliveSender(endpoint, keepalive_interval, keepalive_streams,
                                          keepalive_procs, ttl, self._expired)
        self.by_lease: dict[int, SimNode] = {}
        self.expired_acks = 0
        self.register_s: list[float] = []
        self.loop_lag = LoopLag()  # of this process's event loop: registrations, placement
        self._lag_task: asyncio.Task[None] | None = None

    def _cfg(self, name: str, role: str = "active", slots: int = 1) -> config_mod.Config:
        return config_mod.load(overrides={
            "node": name, "etcd.endpoints": self.endpoint, "etcd.prefix": self.prefix,
            "role": role, "slots": slots, "lease.ttl": self.ttl,
            "lease.keepalive_interval": min(self.keepalive_interval, self.ttl / 3),
            "addresses": "127.0.0.1", "metrics_listen": ""}, environ={})

    def _expired(self, lease: int) -> None:
        self.expired_acks += 1
        node = self.by_lease.pop(lease, None)
        if node is not None and node.lost_at is None:
            node.lost_at = time.monotonic()

    async def start(self) -> None:
        await self.keepalives.start()
        self._lag_task = asyncio.create_task(self.loop_lag.run(self.stop), name="loop-lag")

    async def add(self, names_roles: list[tuple[str, str, int]], concurrency: int = 64) -> None:
        """Register nodes (name, role, slots) as their daemons would, ``concurrency`` at a
        time; each starts its keep-alives once registered."""
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, name: str, role: str, slots: int) -> None:
            async with sem:
                store = self.stores[i % len(self.stores)]
                cfg = self._cfg(name, role, slots)
                agent = NodeAgent(cfg, store, self.metrics,
                                  EventLog(store, self.keys, name, self.metrics), NoWorkers(),
                                  self.stop)
                node = SimNode(name, role, agent)
                self.nodes[name] = node
                t0 = time.monotonic()
                await asyncio.wait_for(agent.register(), 60)
                # From before the lease is granted to its first keep-alive: a real daemon's
                # registration takes this long too before its keep-alive loop starts.
                self.register_s.append(time.monotonic() - t0)
                assert agent.lease is not None
                self.by_lease[agent.lease] = node
                await self.keepalives.add(agent.lease)
                if self.daemon_traffic:
                    self._start_traffic(node, store)

        await asyncio.gather(*(one(i, *nr) for i, nr in enumerate(names_roles)))

    async def crash(self, name: str) -> tuple[float, float | None]:
        """Stop the node's keep-alives (and its other traffic); returns when they stopped
        and when etcd last acknowledged one (monotonic)."""
        node = self.nodes[name]
        node.alive = False
        for t in node.tasks:
            t.cancel()
        node.tasks.clear()
        lease = node.agent.lease
        assert lease is not None
        self.by_lease.pop(lease, None)
        return await self.keepalives.remove(lease)

    async def restart(self, name: str) -> None:
        """The crashed node's daemon comes back: a fresh lease and incarnation, as a restarted
        ``understudyd`` joins."""
        node = self.nodes[name]
        store = node.agent.store
        agent = NodeAgent(node.agent.cfg, store, self.metrics,
                          EventLog(store, self.keys, name, self.metrics), NoWorkers(), self.stop)
        node.agent, node.alive, node.lost_at = agent, True, None
        await asyncio.wait_for(agent.register(), 60)
        assert agent.lease is not None
        self.by_lease[agent.lease] = node
        await self.keepalives.add(agent.lease)
        if self.daemon_traffic:
            self._start_traffic(node, store)

    async def set_state(self, name: str, state: NodeState, reason: str) -> None:
        await self.nodes[name].agent.set_state(state, reason)

    # -- the rest of a daemon's etcd traffic ------------------------------------------------

    def _start_traffic(self, node: SimNode, store: EtcdStore) -> None:
        node.tasks = [
            asyncio.create_task(self._own_keys(node, store), name=f"own-keys {node.name}"),
            asyncio.create_task(self._jobs(node, store), name=f"jobs {node.name}"),
            asyncio.create_task(self._campaign(node, store), name=f"campaign {node.name}"),
        ]

    async def _periodic(self, period: float, changed: asyncio.Event | None = None) -> None:
        if changed is None:
            await asyncio.sleep(period)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), period)
        changed.clear()

    async def _own_keys(self, node: SimNode, store: EtcdStore) -> None:
        """``NodeAgent.watch_own_keys``: three watches (each after a Range of its key), and
        three reads every ``OWN_KEYS_RESYNC_S`` or on a change."""
        keys = [self.keys.drain(node.name), self.keys.registry_entry(node.name),
                self.keys.node(node.name)]
        stop = asyncio.Event()
        changed = asyncio.Event()
        watches = [asyncio.create_task(self._watch(store, k, stop, changed, read_first=True))
                   for k in keys]
        try:
            await asyncio.sleep(self.rng.uniform(0, OWN_KEYS_RESYNC_S))
            while True:
                await self._periodic(OWN_KEYS_RESYNC_S, changed)
                with contextlib.suppress(StoreError):
                    for k in keys:
                        await store.get(k)
        finally:
            stop.set()
            for w in watches:
                w.cancel()

    async def _watch(self, store: EtcdStore, prefix: str, stop: asyncio.Event,
                     changed: asyncio.Event, read_first: bool = False,
                     start_revision: int | None = None) -> None:
        """A watch of ``prefix`` that sets ``changed``; it starts after a Range of the prefix
        (``read_first``), the store's revision, or ``start_revision``."""
        while not stop.is_set():
            try:
                if start_revision is not None:
                    rev = start_revision - 1
                elif read_first:
                    _, rev = await store.get_prefix(prefix)
                else:
                    rev = await store.current_revision()
            except StoreError:
                await asyncio.sleep(0.5)
                continue
            async for _ in store.watch_prefix(prefix, rev + 1, stop):
                changed.set()

    async def _jobs(self, node: SimNode, store: EtcdStore) -> None:
        """``JobRunner.run``: a Range of all of ``jobs/``, then a watch of it from that
        revision, and the Range again every ``JOBS_RELIST_S`` (+-20 %) as the backstop (the
        reads of a daemon that holds no rank). Not sent: the daemon also starts its watch
        afresh at each relist, a watch create and cancel per node every 30 s (about 17
        messages a second at 256 nodes, beside some 300 in the steady window)."""
        stop = asyncio.Event()
        changed = asyncio.Event()
        watch = asyncio.create_task(self._watch(store, self.keys.jobs, stop, changed,
                                                read_first=True))
        try:
            while True:
                await asyncio.sleep(JOBS_RELIST_S * self.rng.uniform(0.8, 1.2))
                with contextlib.suppress(StoreError):
                    await store.get_prefix(self.keys.jobs)
        finally:
            stop.set()
            watch.cancel()

    async def _campaign(self, node: SimNode, store: EtcdStore) -> None:
        """``Controller._campaign_once`` of a daemon that loses: a Range of the controller
        key (a create-if-absent Txn only while nobody holds it), then a watch from its
        revision for up to ``CAMPAIGN_RECHECK_S``."""
        await asyncio.sleep(self.rng.uniform(0, CAMPAIGN_RECHECK_S))
        while True:
            lease = node.agent.lease
            me = ControllerRecord(node=node.name, incarnation=node.agent.incarnation,
                                  since=time.time())
            kv = None
            try:
                kv = await store.get(self.keys.controller)
                if kv is None:
                    won = await store.txn(compare=[("create", self.keys.controller, 0)],
                                          success=[("put", self.keys.controller, me.encode(),
                                                    lease)])
                    if won:  # the real controller is gone: give the key back, we plan nothing
                        await store.delete(self.keys.controller)
                    kv = await store.get(self.keys.controller)
            except StoreError:
                pass
            if kv is None:
                await asyncio.sleep(0.5)
                continue
            stop = asyncio.Event()
            changed = asyncio.Event()
            w = asyncio.create_task(self._watch(store, self.keys.controller, stop, changed,
                                                start_revision=kv.mod_revision + 1))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), CAMPAIGN_RECHECK_S)
            stop.set()
            w.cancel()

    async def close(self) -> None:
        self.stop.set()
        for node in self.nodes.values():
            for t in node.tasks:
                t.cancel()
        tasks = [t for n in self.nodes.values() for t in n.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._lag_task is not None:
            self._lag_task.cancel()
            await asyncio.gather(self._lag_task, return_exceptions=True)
        await self.keepalives.close()
        for s in self.stores:
            await s.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="a keep-alive sender process of scale.py")
    p.add_argument("--keepalive-child", nargs=4,
                   metavar=("ENDPOINT", "INTERVAL", "STREAMS", "TTL"), required=True)
    a = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(keepalive_process(a.keepalive_child[0], float(a.keepalive_child[1]),
                                      int(a.keepalive_child[2]),
                                      float(a.keepalive_child[3])))
