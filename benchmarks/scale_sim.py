"""Simulated nodes for ``scale.py``: many per process, each one looking to the controller
exactly like a real ``understudyd``.

Each simulated node is the daemon's own :class:`NodeAgent` (its records, its registration
transaction, its registry compare-and-swap, its events and its state changes), with a real etcd
lease. What is simulated is only the process around it: no workers, no local socket, and the
keep-alives, which are sent for all nodes of the fleet on a few long-lived ``LeaseKeepAlive``
streams (one message per lease per interval, as etcd's Go client multiplexes its leases)
instead of one stream per keep-alive as aetcd does; N streams per interval would cost this one
process more CPU than the two-core machine has. A node "crashes" when its keep-alives stop: its
lease expires at etcd a TTL after the last one, the way a kill -9 or a partition looks.

With ``daemon_traffic``, each node also sends the periodic reads and holds the watches a real
daemon does besides its keep-alives (read off ``daemon/node.py``, ``daemon/jobs.py`` and
``daemon/controller.py``): every 5 s the own-keys reconcile (Range of its drain request,
registry entry and node record), every 5 s and on every change under ``jobs/`` the job
runner's Range of the whole ``jobs/`` prefix, and the controller campaign of a non-leader (a
failed create-if-absent Txn and a Range of the controller key, then a watch of it that ends
after 5 s); and four watches: its three own keys and ``jobs/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aetcd import rpc

from understudy.daemon import config as config_mod
from understudy.daemon.errors import StoreError
from understudy.daemon.events import EventLog
from understudy.daemon.keys import Keys
from understudy.daemon.metrics import Metrics
from understudy.daemon.node import NodeAgent
from understudy.daemon.records import ControllerRecord
from understudy.daemon.states import NodeState
from understudy.daemon.store import EtcdStore

#: the daemon's reconcile and resync periods (``watch_own_keys``, ``JobRunner``)
DAEMON_RESYNC_S = 5.0
#: a non-leader waits this long on the controller key before campaigning again
CAMPAIGN_WAIT_S = 5.0


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
    last_ack: float = 0.0
    lost_at: float | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class KeepAlives:
    """Keep-alives for every live lease of the fleet, spread evenly over ``interval``, on
    ``streams`` long-lived bidirectional ``LeaseKeepAlive`` streams."""

    def __init__(self, endpoint: str, interval: float, streams: int,
                 on_expired: Callable[[int], None]) -> None:
        self.endpoint, self.interval, self.nstreams = endpoint, interval, streams
        self.on_expired = on_expired
        self.leases: dict[int, SimNode] = {}
        self.sent = 0
        self.acked = 0
        self.late_s = 0.0  # how far behind schedule the sender fell, at most
        self._channels: list[Any] = []
        self._calls: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    async def start(self) -> None:
        for _ in range(self.nstreams):
            ch = rpc.insecure_channel(self.endpoint)
            self._channels.append(ch)
            call = rpc.LeaseStub(ch).LeaseKeepAlive()
            self._calls.append(call)
            self._tasks.append(asyncio.create_task(self._read(call), name="keepalive-read"))
        self._tasks.append(asyncio.create_task(self._send(), name="keepalive-send"))

    async def _read(self, call: Any) -> None:
        while not self._stop.is_set():
            try:
                reply = await call.read()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                return
            if reply is grpc.aio.EOF:
                return
            self.acked += 1
            node = self.leases.get(reply.ID)
            if node is None:
                continue
            if reply.TTL <= 0:
                self.on_expired(reply.ID)
            else:
                node.last_ack = time.monotonic()

    async def _send(self) -> None:
        """Rounds of one keep-alive per lease, each round spread evenly over ``interval`` in
        slices of ``tick``."""
        tick = 0.01
        k = 0
        while not self._stop.is_set():
            order = list(self.leases)
            t0 = time.monotonic()
            i = 0
            while i < len(order):
                due = min(len(order), math.ceil(len(order) * (time.monotonic() - t0 + tick)
                                                / self.interval))
                for lease in order[i:due]:
                    if lease not in self.leases:
                        continue  # stopped meanwhile: a crashed node sends nothing
                    k += 1
                    try:
                        await self._calls[k % len(self._calls)].write(
                            rpc.LeaseKeepAliveRequest(ID=lease))
                    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        return
                    self.sent += 1
                i = max(i, due)
                if i < len(order):
                    await asyncio.sleep(tick)
            wait = t0 + self.interval - time.monotonic()
            self.late_s = max(self.late_s, -wait)
            await asyncio.sleep(max(wait, 0.0))

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


class Fleet:
    """N simulated nodes over ``channels`` shared etcd connections."""

    def __init__(self, endpoint: str, prefix: str, ttl: int, keepalive_interval: float,
                 channels: int = 4, keepalive_streams: int = 4, daemon_traffic: bool = False,
                 seed: int = 1) -> None:
        self.endpoint, self.prefix, self.ttl = endpoint, prefix, ttl
        self.keys = Keys(prefix)
        self.daemon_traffic = daemon_traffic
        self.rng = random.Random(seed)
        self.keepalive_interval = keepalive_interval
        self.metrics = Metrics()  # one registry for all: nothing reads a simulated node's
        self.stores = [EtcdStore(self._cfg("sim-config").etcd) for _ in range(channels)]
        self.nodes: dict[str, SimNode] = {}
        self.stop = asyncio.Event()
        self.keepalives = KeepAlives(endpoint, keepalive_interval, keepalive_streams,
                                     self._expired)
        self.expired_acks = 0

    def _cfg(self, name: str, role: str = "active", slots: int = 1) -> config_mod.Config:
        return config_mod.load(overrides={
            "node": name, "etcd.endpoints": self.endpoint, "etcd.prefix": self.prefix,
            "role": role, "slots": slots, "lease.ttl": self.ttl,
            "lease.keepalive_interval": min(self.keepalive_interval, self.ttl / 3),
            "addresses": "127.0.0.1", "metrics_listen": ""}, environ={})

    def _expired(self, lease: int) -> None:
        self.expired_acks += 1
        node = self.keepalives.leases.pop(lease, None)
        if node is not None and node.lost_at is None:
            node.lost_at = time.monotonic()

    async def start(self) -> None:
        await self.keepalives.start()

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
                await asyncio.wait_for(agent.register(), 60)
                assert agent.lease is not None
                node.last_ack = time.monotonic()
                self.keepalives.leases[agent.lease] = node
                if self.daemon_traffic:
                    self._start_traffic(node, store)

        await asyncio.gather(*(one(i, *nr) for i, nr in enumerate(names_roles)))

    def crash(self, name: str) -> float:
        """Stop the node's keep-alives (and its other traffic); returns when (monotonic)."""
        node = self.nodes[name]
        node.alive = False
        for t in node.tasks:
            t.cancel()
        node.tasks.clear()
        lease = node.agent.lease
        if lease is not None:
            self.keepalives.leases.pop(lease, None)
        return time.monotonic()

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
        node.last_ack = time.monotonic()
        self.keepalives.leases[agent.lease] = node
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
        three reads every 5 s or on a change."""
        keys = [self.keys.drain(node.name), self.keys.registry_entry(node.name),
                self.keys.node(node.name)]
        stop = asyncio.Event()
        changed = asyncio.Event()
        watches = [asyncio.create_task(self._watch(store, k, stop, changed, read_first=True))
                   for k in keys]
        try:
            await asyncio.sleep(self.rng.uniform(0, DAEMON_RESYNC_S))
            while True:
                await self._periodic(DAEMON_RESYNC_S, changed)
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
        """``JobRunner.run``: a watch of ``jobs/``, and a Range of all of it on each change
        and every 5 s (the reads of a daemon that holds no rank; one that does also reads its
        ranks' exit keys)."""
        stop = asyncio.Event()
        changed = asyncio.Event()
        watch = asyncio.create_task(self._watch(store, self.keys.jobs, stop, changed))
        try:
            await asyncio.sleep(self.rng.uniform(0, DAEMON_RESYNC_S))
            while True:
                await self._periodic(DAEMON_RESYNC_S, changed)
                with contextlib.suppress(StoreError):
                    await store.get_prefix(self.keys.jobs)
        finally:
            stop.set()
            watch.cancel()

    async def _campaign(self, node: SimNode, store: EtcdStore) -> None:
        """``Controller._campaign_once`` of a daemon that loses: a create-if-absent Txn, a
        Range of the controller key, then a watch from its revision for up to 5 s."""
        await asyncio.sleep(self.rng.uniform(0, CAMPAIGN_WAIT_S))
        while True:
            lease = node.agent.lease
            me = ControllerRecord(node=node.name, incarnation=node.agent.incarnation,
                                  since=time.time())
            kv = None
            try:
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
                await asyncio.wait_for(changed.wait(), CAMPAIGN_WAIT_S)
            stop.set()
            w.cancel()

    async def close(self) -> None:
        self.stop.set()
        for node in self.nodes.values():
            for t in node.tasks:
                t.cancel()
        tasks = [t for n in self.nodes.values() for t in n.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.keepalives.close()
        for s in self.stores:
            await s.close()
