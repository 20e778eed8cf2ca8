"""The node's membership: its lease, its records, self-fencing, and drains of the node.

Tasks (each named, stopped by ``stop``, joined with a bound by the daemon):
- ``keepalive``: refreshes the lease every ``keepalive_interval``; fences the node when etcd
  answers that the lease is gone, and ends an outage when it answers that the lease holds.
- ``lease-watch``: notices when no keep-alive was acknowledged for long enough that the lease
  *may* expire (an etcd outage, or this node cut off from etcd) and reports the outage. It kills
  nothing: silence is not evidence (see "Fencing on evidence" below).
- ``own-keys``: watches this node's drain request, registry entry and record, and reconciles
  them every ``OWN_KEYS_RESYNC_S`` as a backstop (a hung watch cannot hide a drain for long).

A drain of the node: ``active|standby -> draining``, the workers are stopped within the
deadline, ``-> drained``. (Live migration of the workers' ranks plugs in before the stop.)

Fencing on evidence. A node's ranks can only be taken over by a plan the controller writes to
etcd after the node's lease expired there; the takeover moves the job to a new epoch whose group
versions the old ranks are not members of. So while etcd cannot be reached the ranks keep
training (nobody can replace them), and the node acts only on evidence: etcd answers that the
lease is gone (a keep-alive returns TTL 0), or the node's record is bound to another lease (a
newer incarnation). Then it joins again as a new incarnation and, once its new record exists,
kills every worker that was replaced meanwhile and keeps the others (``readopt``): a recovery of
a lost node's ranks is written only while that node has no record, so none can come later. The
job's epoch moving past a rank's is the job runner's evidence too (it stops ranks the assignment
no longer places here); a rank whose peers left its groups cannot commit a step and waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from understudy.common import logs
from understudy.common.backoff import Backoff
from understudy.common.config import Config
from understudy.common.errors import RecordError, StoreError
from understudy.common.keys import Keys
from understudy.common.records import DrainRequest, NodeRecord, RegistryEntry
from understudy.common.states import NodeLifecycle, NodeState
from understudy.common.store import EtcdStore, WatchEvent, wait_any
from understudy.common.version import VERSION
from understudy.daemon.events import EventLog
from understudy.daemon.fencing import FenceTimer
from understudy.daemon.metrics import BadValues, Metrics, drain_source_label

#: Seconds between the own-keys reconciles that no change asked for: the backstop for a watch
#: that stopped delivering without an error. Each is three reads per node (its drain request,
#: registry entry and record), so at 4,096 nodes 410 reads/s at 30 s; it was 5 s (2,458/s).
#: A watch broken by an error is resumed at once, and a dead connection under a watch is found
#: by gRPC's keep-alive pings (``common/store.py``: every 5 s, 1 s to answer).
OWN_KEYS_RESYNC_S = 30.0
#: ... and after a reconcile that etcd did not answer (an outage), the next try
OWN_KEYS_RETRY_S = 1.0


class Workers(Protocol):
    """What the node needs of its worker supervisor."""

    @property
    def running_count(self) -> int: ...

    def kill_all_now(self) -> None: ...

    async def stop_all(self, grace: float) -> Any: ...


class NodeAgent:
    def __init__(self, cfg: Config, store: EtcdStore, metrics: Metrics, events: EventLog,
                 workers: Workers, stop: asyncio.Event,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.cfg, self.store, self.metrics, self.events = cfg, store, metrics, events
        self.workers = workers
        self.keys = Keys(cfg.etcd.prefix)
        self.stop = stop
        self.clock, self.wall = clock, wall
        self.lifecycle = NodeLifecycle()
        self.fence = FenceTimer(cfg.lease.fence_margin)
        self.lease: int | None = None
        #: monotonic time the current etcd outage was noticed (None: etcd answers)
        self.outage_since: float | None = None
        self._fencing = False
        self._started_at = 0.0
        self._registered_at = 0.0
        self.incarnation = ""
        #: (incarnation, lease) of a registration not seen through: its transaction got no
        #: answer (etcd may have applied it: a reply lost, or later than the request's
        #: timeout), or a step after it failed. The next attempt looks before it starts
        #: another (see _took_unanswered).
        self._unanswered: tuple[str, int] | None = None
        self.cordoned = False
        self.drain_request: DrainRequest | None = None
        self.first_failure = ""
        self.health: tuple[str, ...] = ()
        #: job -> the warmth this node's standby worker reported (see NodeRecord.warmth)
        self.warmth: dict[str, dict[str, Any]] = {}
        #: ``HOST:PORT`` where this daemon answers probes (empty: probes are off)
        self.probe_address = ""
        #: the address this node's workers bind to (``daemon/address.py``); None: gloo's own
        self.worker_address: str | None = None
        #: Set once the node is registered and holds a live lease.
        self.registered = asyncio.Event()
        #: Set when a drain finishes; the daemon exits after a SIGTERM drain.
        self.drained = asyncio.Event()
        self._changed = asyncio.Event()
        #: Called after every state change (the job runner re-checks what it should run).
        self.listeners: list[Callable[[], None]] = []
        #: After a lost lease and a new registration: kills the workers that were replaced (or
        #: cannot be shown not to be) and returns (killed, kept) child names (the job runner's
        #: ``readopt``). None: a lost lease kills every worker.
        self.readopt: Callable[[], Awaitable[tuple[list[str], list[str]]]] | None = None
        #: Awaited by a drain before the workers are stopped, with a wall-clock deadline.
        self.before_stop: Callable[[float], Awaitable[Any]] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.log = logs.get(node=cfg.node)
        self._bad_values = BadValues(metrics, self.log)

    @property
    def state(self) -> NodeState:
        return self.lifecycle.state

    @property
    def role_state(self) -> NodeState:
        return NodeState.ACTIVE if self.cfg.role == "active" else NodeState.STANDBY

    # -- records ----------------------------------------------------------------------------

    def record(self) -> NodeRecord:
        return NodeRecord(
            name=self.cfg.node, incarnation=self.incarnation, lease=self.lease or 0,
            state=self.state, role=self.cfg.role, slots=self.cfg.slots,
            addresses=self.cfg.addresses, failure_domain=self.cfg.failure_domain,
            version=VERSION, started_at=self._started_at, registered_at=self._registered_at,
            state_since=self.lifecycle.since,
            reason=self.lifecycle.reason, workers=self.workers.running_count,
            first_failure=self.first_failure, health=self.health, warmth=dict(self.warmth),
            probe=self.probe_address,
        )


    def _bad_value(self, collection: str, key: str, rev: int, exc: RecordError) -> None:
        self._bad_values.found(collection, key, rev, str(exc))

    async def _read_registry(self) -> tuple[RegistryEntry | None, int]:
        key = self.keys.registry_entry(self.cfg.node)
        kv = await self.store.get(key)
        if kv is None:
            return None, 0
        try:
            return RegistryEntry.decode(kv.value), kv.mod_revision
        except RecordError as exc:
            self._bad_value("registry", key, kv.mod_revision, exc)
            return None, kv.mod_revision

    def _registry_entry(self, cordoned: bool, offline: bool = False) -> RegistryEntry:
        return RegistryEntry(name=self.cfg.node, incarnation=self.incarnation, state=self.state,
                             updated_at=self.wall(), cordoned=cordoned,
                             reason=self.lifecycle.reason, offline=offline)

    async def publish(self) -> bool:
        """Write the node record (under the lease) and the registry entry (CAS, keeping the
        operator's cordon flag). False if the entry changed under each of five CAS tries.
        Raises StoreError when etcd is unreachable."""
        if self.lease is None:
            return True
        await self.store.put(self.keys.node(self.cfg.node), self.record().encode(),
                             lease=self.lease)
        for _ in range(5):
            entry, rev = await self._read_registry()
            cordoned = entry.cordoned if entry else self.cordoned
            new = self._registry_entry(cordoned)
            if entry is not None and dataclasses.replace(entry, updated_at=0) == \
                    dataclasses.replace(new, updated_at=0):
                return True
            if await self.store.cas(self.keys.registry_entry(self.cfg.node), new.encode(), rev):
                self.cordoned = cordoned
                return True
        return False

    async def set_state(self, new: NodeState, reason: str) -> None:
        old, _ = self.lifecycle.transition(new, self.wall(), reason)
        if old != new:
            self.metrics.set_state(new)
            self.log.info(f"Node went from {old} to {new}: {reason}.", state=str(new))
            try:
                published = await self.publish()
            except StoreError:
                published = False
            if not published:
                # The own-keys reconcile repairs the records: now, and every second while etcd
                # does not take them, not at its 30 s backstop (a drain's "drained" waited
                # that long once, after an etcd restart).
                self._changed.set()
            for listener in self.listeners:
                listener()

    # -- joining ----------------------------------------------------------------------------

    async def register(self) -> None:
        """Join the cluster with a fresh lease and incarnation. Retries until it succeeds or
        ``stop`` is set; goes on from an attempt that wrote its record although its answer was
        lost, and waits out a previous incarnation's record that is still leased."""
        self._started_at = self._started_at or self.wall()
        waited_for: str | None = None
        last_error = ""
        # Jittered: after an outage the fleet's daemons do not register again in lock-step.
        backoff = Backoff(first=min(0.1, self.cfg.lease.keepalive_interval),
                          cap=self.cfg.lease.keepalive_interval)
        while not self.stop.is_set():
            try:
                if await self._try_register():
                    return
                kv = await self.store.get(self.keys.node(self.cfg.node))
                holder = kv.value[:200].decode(errors="replace") if kv else "?"
                if waited_for != holder:
                    waited_for = holder
                    self.log.warning("Node name is held by a live lease (a previous incarnation "
                                     "or another daemon); waiting for it to expire.")
            except StoreError as exc:
                self.metrics.etcd_retries.labels(call="register").inc()
                if str(exc) != last_error:  # repeated status is logged only when it changes
                    last_error = str(exc)
                    self.log.warning("Cannot register with etcd yet; retrying.", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), backoff.next())

    async def _try_register(self) -> bool:
        node_key = self.keys.node(self.cfg.node)
        if self._unanswered is not None and await self._took_unanswered(node_key):
            return await self._joined()
        self.incarnation = uuid.uuid4().hex[:12]
        self._registered_at = self.wall()
        sent = self.clock()
        lease = await self.store.grant(self.cfg.lease.ttl)
        self.lease = lease
        self.fence.arm(sent, self.cfg.lease.ttl)
        if self.lifecycle.state != NodeState.JOINING:
            self.lifecycle.transition(NodeState.JOINING, self.wall(), "registering")
        entry, rev = await self._read_registry()
        self.cordoned = entry.cordoned if entry else False
        self._unanswered = (self.incarnation, lease)
        ok = await self.store.txn(
            compare=[("create", node_key, 0), ("mod", self.keys.registry_entry(self.cfg.node),
                                               rev)],
            success=[("put", node_key, self.record().encode(), lease),
                     ("put", self.keys.registry_entry(self.cfg.node),
                      self._registry_entry(self.cordoned).encode(), None)],
        )
        if not ok:
            self._unanswered = None
            with contextlib.suppress(StoreError):
                await self.store.revoke(lease)
            self.lease = None
            self.fence.disarm()
            return False
        return await self._joined()

    async def _took_unanswered(self, node_key: str) -> bool:
        """Whether the last attempt, not seen through, did write its node record (its
        incarnation, on its lease). Then this node is registered already and must not start
        over: a new attempt would find the name held by that record and wait out its lease,
        while answering probes as a new incarnation, which the controller took for the
        record's going silent (it revoked the lease, and recovered the node's ranks elsewhere).
        Raises StoreError, to be asked again, while etcd does not answer."""
        assert self._unanswered is not None
        incarnation, lease = self._unanswered
        kv = await self.store.get(node_key)
        mine = False
        if kv is not None and kv.lease == lease:
            with contextlib.suppress(RecordError):
                mine = NodeRecord.decode(kv.value).incarnation == incarnation
        if mine:
            self.incarnation, self.lease = incarnation, lease
            self.log.info("The last registration took effect although it was not seen "
                          "through; the node goes on from it.", lease=lease,
                          incarnation=incarnation)
            return True
        self._unanswered = None
        with contextlib.suppress(StoreError):
            await self.store.revoke(lease)
        if self.lease == lease:
            self.lease = None
            self.fence.disarm()
        return False

    async def _joined(self) -> bool:
        """The node record and registry entry of this incarnation are written: announce it,
        reconcile, and take up the node's role."""
        assert self.lease is not None
        lease = self.lease
        self.metrics.set_state(self.state)
        self.log.info("Node registered.", lease=lease, incarnation=self.incarnation)
        await self.events.emit("node-joined", f"Node {self.cfg.node} joined as {self.cfg.role}.",
                               incarnation=self.incarnation)
        await self._reconcile()
        if self.state == NodeState.JOINING:
            await self.set_state(self.role_state, f"joined as {self.cfg.role}")
        self._unanswered = None
        self.registered.set()
        return True

    # -- lease ------------------------------------------------------------------------------

    async def keepalive_loop(self) -> None:
        interval = self.cfg.lease.keepalive_interval
        while not self.stop.is_set():
            lease = self.lease
            if lease is not None:
                sent = self.clock()
                try:
                    ttl = await self.store.keepalive(lease)
                except StoreError as exc:
                    self.metrics.errors.labels(kind="keepalive").inc()
                    self.log.debug("Keep-alive failed.", error=str(exc))
                else:
                    if lease != self.lease:
                        pass  # fenced and re-registered meanwhile
                    elif ttl <= 0:
                        await self.fence_now("etcd says the lease has expired")
                    else:
                        self.fence.arm(sent, ttl)
                        if self.outage_since is not None:
                            await self._outage_ended()
                if self.fence.last_ack is not None:
                    self.metrics.lease_age.set(self.clock() - self.fence.last_ack)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), interval)

    async def lease_watch(self) -> None:
        """Notices the moment the lease can no longer be proven alive (the fence timer's
        deadline: no keep-alive acknowledged for ``ttl - margin``) and reports an etcd outage.
        Kills nothing: etcd unreachable means nobody can write the plan that would replace this
        node's ranks, so they train on; evidence is for the keep-alive loop to find."""
        while not self.stop.is_set():
            deadline = self.fence.deadline
            now = self.clock()
            if self.lease is not None and deadline is not None and now >= deadline \
                    and self.outage_since is None:
                self._outage_began(now)
            wait = 0.5 if deadline is None or self.outage_since is not None \
                else min(0.5, max(0.005, deadline - now))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), wait)

    def _outage_began(self, now: float) -> None:
        self.outage_since = now
        self.metrics.etcd_reachable.set(0)
        self.metrics.etcd_outages.inc()
        silent = now - self.fence.last_ack if self.fence.last_ack is not None else 0.0
        self.log.warning(
            f"etcd has acknowledged no keep-alive for {silent:.1f} s: the lease may expire. "
            "The workers keep training; the daemon keeps trying and stops them only if etcd "
            "says the lease is gone or their job moved on.", lease=self.lease,
            running=self.workers.running_count)
        for listener in self.listeners:
            listener()

    async def _outage_ended(self) -> None:
        assert self.outage_since is not None
        lasted = self.clock() - self.outage_since
        self.outage_since = None
        self.metrics.etcd_reachable.set(1)
        self.log.info(f"etcd answers again after an outage of {lasted:.1f} s; the lease held "
                      "and the workers trained on.", lease=self.lease)
        self._changed.set()  # repair our records at once
        for listener in self.listeners:
            listener()
        with contextlib.suppress(StoreError):
            await self.events.emit(
                "etcd-reachable", f"Node {self.cfg.node} reached etcd again after "
                f"{lasted:.1f} s; its lease held and its workers trained on.",
                outage_s=round(lasted, 3))

    async def fence_now(self, reason: str) -> None:
        """On evidence that the lease is gone: this incarnation is over, and the node's ranks
        may have been replaced. Join again as a new incarnation first, then keep only the
        workers that etcd shows nobody replaced (``readopt``, the job runner's check, reading
        after the new record exists: a recovery of a lost node's ranks is written only while
        that node has no record, so none can replace them later) and kill the rest at once.
        Without ``readopt`` every worker is killed. A second call while one runs does nothing.
        """
        if self._fencing:
            return
        self._fencing = True
        try:
            await self._fence(reason)
        finally:
            self._fencing = False

    async def _fence(self, reason: str) -> None:
        if self.readopt is None:
            self.workers.kill_all_now()
        self.metrics.fences.inc()
        lost = self.lease
        self.lease = None
        self.fence.disarm()
        if self.outage_since is not None:
            self.outage_since = None
            self.metrics.etcd_reachable.set(1)
        self.registered.clear()
        self.lifecycle.transition(NodeState.FAILED, self.wall(), f"lease lost: {reason}")
        self.metrics.set_state(NodeState.FAILED)
        if self._drain_task is not None:
            self._drain_task.cancel()
        self.log.error(f"Node lost its lease: {reason}. It joins again as a new incarnation "
                       "and stops whatever was replaced meanwhile.", lease=lost)
        await self.register()
        killed: list[str] = ["every worker"]
        kept: list[str] = []
        if self.readopt is not None:
            killed, kept = await self.readopt()
        if killed:
            self.log.error(f"Node fenced itself: killed {', '.join(killed)} (replaced, or not "
                           "provably still its own, while the lease was gone).",
                           kept=kept)
        elif kept:
            self.log.info(f"Node kept {', '.join(kept)}: etcd shows nobody replaced them while "
                          "the lease was gone.")
        await self.events.emit(
            "node-fenced", f"Node {self.cfg.node} lost its lease ({reason}) and joined again; "
            f"killed: {', '.join(killed) or 'nothing'}; kept: {', '.join(kept) or 'nothing'}.",
            killed=killed, kept=kept)

    # -- own keys ---------------------------------------------------------------------------

    async def watch_own_keys(self, resync_interval: float = OWN_KEYS_RESYNC_S) -> None:
        """Reconcile the node with its drain request, registry entry and node record on every
        change to them (their watches), and every ``resync_interval`` seconds besides; a
        reconcile that etcd did not answer is tried again within a second."""
        watched = [self.keys.drain(self.cfg.node), self.keys.registry_entry(self.cfg.node),
                   self.keys.node(self.cfg.node)]
        tasks = [asyncio.create_task(self._watch_key(k), name=f"watch {k}") for k in watched]
        wait = resync_interval
        try:
            while not self.stop.is_set():
                await wait_any((self._changed, self.stop), wait)
                self._changed.clear()
                if self.lease is None or self.stop.is_set():
                    continue
                try:
                    await self._reconcile()
                    wait = resync_interval
                except StoreError as exc:
                    self.log.debug("Reconcile failed; will retry.", error=str(exc))
                    wait = min(resync_interval, OWN_KEYS_RETRY_S)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=2)

    async def _watch_key(self, key: str) -> None:
        while not self.stop.is_set():
            try:
                _, rev = await self.store.get_prefix(key)
            except StoreError:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 0.5)
                continue
            async for ev in self.store.watch_prefix(key, rev + 1, self.stop):
                # RESYNC, or an event on exactly this key (the prefix also matches longer names).
                if not isinstance(ev, WatchEvent) or ev.kv.key == key:
                    self._changed.set()

    async def _reconcile(self) -> None:
        """Bring the node in line with its drain request and repair its own records."""
        drain_key = self.keys.drain(self.cfg.node)
        kv = await self.store.get(drain_key)
        request = None
        if kv is not None:
            try:
                request = DrainRequest.decode(kv.value)
                if request.node != self.cfg.node:
                    raise RecordError(f"drain request names node {request.node!r}")
            except RecordError as exc:
                self._bad_value("drains", drain_key, kv.mod_revision, exc)
                request = None
        self.drain_request = request
        entry, _ = await self._read_registry()
        if entry is not None:
            self.cordoned = entry.cordoned
            self.metrics.cordoned.set(1 if entry.cordoned else 0)
        # Repair our own record if someone else overwrote or deleted it.
        node_key = self.keys.node(self.cfg.node)
        node_kv = await self.store.get(node_key)
        mine = False
        if node_kv is not None:
            if node_kv.lease not in (0, self.lease):
                # Only a registration on another lease can have put it there, and that needed
                # our record gone, which takes our lease gone: evidence that this incarnation
                # is over (or that two daemons share one node name).
                await self.fence_now(f"the node record is bound to another lease "
                                     f"({node_kv.lease:x}): a newer incarnation holds the name")
                return
            try:
                mine = NodeRecord.decode(node_kv.value).incarnation == self.incarnation
            except RecordError as exc:
                self._bad_value("nodes", node_key, node_kv.mod_revision, exc)
        stale = not mine or entry is None or entry.incarnation != self.incarnation \
            or entry.state != self.state
        if stale and not await self.publish():
            raise StoreError("the registry entry changed under each compare-and-swap")
        if request is not None and self.state in (NodeState.ACTIVE, NodeState.STANDBY,
                                                  NodeState.JOINING):
            self._start_drain(request)
        elif request is None and self.state in (NodeState.DRAINING, NodeState.DRAINED):
            if self._drain_task is not None:
                self._drain_task.cancel()
            self.drained.clear()
            await self.set_state(self.role_state, "drain request removed (undrain)")
            await self.events.emit("node-undrained", f"Node {self.cfg.node} is back in service.")

    # -- drains -----------------------------------------------------------------------------

    async def request_drain(self, source: str, reason: str, deadline_s: float) -> None:
        """Write a drain request for this node (SIGTERM, notices, health). Keeps an existing
        request. Raises StoreError if etcd is unreachable."""
        now = self.wall()
        req = DrainRequest(node=self.cfg.node, reason=reason, source=source, requested_at=now,
                           deadline=now + deadline_s, requested_by=f"understudyd@{self.cfg.node}")
        created = await self.store.cas(self.keys.drain(self.cfg.node), req.encode(), 0)
        if created:
            self.log.info(f"Drain of this node requested by {source}: {reason}.")
        self._changed.set()

    def _start_drain(self, request: DrainRequest) -> None:
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.create_task(self._drain(request), name="drain")

    async def _drain(self, request: DrainRequest) -> None:
        self.metrics.drains.labels(source=drain_source_label(request.source)).inc()
        await self.set_state(NodeState.DRAINING, f"drain by {request.source}: {request.reason}")
        await self.events.emit("node-draining",
                               f"Node {self.cfg.node} is draining ({request.source}): "
                               f"{request.reason}.", deadline=request.deadline)
        if self.before_stop is not None:
            # Live migration first: the ranks move to standbys while the node is draining.
            await self.before_stop(request.deadline - self.cfg.drain.stop_grace)
        budget = max(0.1, request.deadline - self.wall())
        grace = min(self.cfg.drain.stop_grace, budget)
        try:
            await asyncio.wait_for(self.workers.stop_all(grace), budget + 1.0)
        except TimeoutError:
            self.workers.kill_all_now()
        await self.set_state(NodeState.DRAINED, f"drained ({request.source})")
        await self.events.emit("node-drained", f"Node {self.cfg.node} is drained.")
        self.drained.set()

    async def leave(self) -> None:
        """Clean exit: mark the registry entry offline, drop the record, revoke the lease."""
        lease, self.lease = self.lease, None
        self.fence.disarm()
        if lease is None:
            return
        with contextlib.suppress(StoreError):
            entry, rev = await self._read_registry()
            offline = self._registry_entry(entry.cordoned if entry else self.cordoned,
                                           offline=True)
            await self.store.txn(
                compare=[("mod", self.keys.registry_entry(self.cfg.node), rev)],
                success=[("put", self.keys.registry_entry(self.cfg.node), offline.encode(),
                          None), ("delete", self.keys.node(self.cfg.node))],
            )
            await self.events.emit("node-left", f"Node {self.cfg.node} left the cluster "
                                   f"({self.state}).")
            await self.store.revoke(lease)
