"""Controller election and the controller's loop.

Election: every daemon campaigns by creating ``<prefix>/controller`` bound to its own lease
(create-if-absent, so exactly one wins). The others wait for the key to disappear, which
happens when the winner leaves or its lease expires, and campaign again. The leader keeps a view
of the cluster from a list plus watches (re-listed periodically as a backstop), asks the pure
planner what to do, and applies each action by compare-and-swap.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

from understudy.common import failpoints, logs
from understudy.common.backoff import Backoff
from understudy.common.errors import RecordError, StoreError
from understudy.common.keys import Keys
from understudy.common.layout import retired_bootstrap
from understudy.common.records import (
    JOB_RECORDS,
    TRANSFER_OK,
    Assignment,
    ControllerRecord,
    DecodedRecords,
    DrainRequest,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    MigrationPhase,
    NodeRecord,
    RankExit,
    RegistryEntry,
    Rendezvous,
    Report,
    ResizeRequest,
    StopRequest,
    StuckReport,
    decode_job_record,
)
from understudy.common.snapshot_tiers import MemoryCopies, SnapshotReport, counted_copies
from understudy.common.states import NodeState
from understudy.common.store import KV, EtcdStore, WatchEvent, wait_any
from understudy.daemon.events import EventLog
from understudy.daemon.metrics import BadValues, ControllerMetrics, Metrics
from understudy.daemon.node import NodeAgent
from understudy.daemon.planner import (
    Action,
    AddStandbys,
    AdvanceMigration,
    AssignJob,
    ClusterView,
    JobView,
    MarkFailed,
    SetJobState,
    StartMigration,
    plan,
)
from understudy.daemon.probe import Prober

#: a rank's downtime report counts if it comes within this many seconds of its migration's
#: end (it is written just after the rank trains again)
DOWNTIME_REPORT_S = 60.0
#: deletes per transaction when removing retired namespaces (etcd's --max-txn-ops: 128)
TXN_DELETES = 100
#: A controller whose rounds fail this many times in a row with an error of its own (not an
#: etcd outage, which fails every daemon's alike) resigns: a daemon whose code or environment
#: breaks every round must not keep the cluster without a controller while others could lead.
RESIGN_AFTER_FAILED_ROUNDS = 5
#: ... and stands aside this long before it campaigns again (another daemon takes the key; if
#: every one fails the same way, the leadership goes round at this pace, not in a tight loop).
RESIGN_BACKOFF_S = 60.0
#: A daemon that lost the election waits on a watch of the controller key, which sees the key
#: go (a resignation, or the controller's lease gone) even through an outage or a compaction
#: (``watch_prefix`` resumes, or reports a resync). This is only how often it looks again
#: regardless: one read, never a write (each campaign's create-if-absent is a raft proposal
#: even when it fails, and every idle daemon sending one each 5 s was most of the writes an
#: idle cluster made: 51 a second at 256 nodes).
CAMPAIGN_RECHECK_S = 30.0


#: ends the log line of a planner action the controller refused (:meth:`Controller._refused`)
PLANNER_BUG = "This is a bug in the planner."

class Controller:
    def __init__(self, agent: NodeAgent, store: EtcdStore, metrics: Metrics, events: EventLog,
                 stop: asyncio.Event, wall: Callable[[], float] = time.time,
                 tick: float = 1.0, relist_interval: float = 10.0) -> None:
        self.agent, self.store, self.metrics, self.events = agent, store, metrics, events
        self.keys = Keys(agent.cfg.etcd.prefix)
        self.stop, self.wall = stop, wall
        self.tick, self.relist_interval = tick, relist_interval
        self.is_leader = False
        #: the jobs' metrics, exported while this daemon is the controller
        self.job_metrics = ControllerMetrics()
        self.log = logs.get(node=agent.cfg.node)
        self._registry: dict[str, tuple[RegistryEntry, int]] = {}
        self._live: dict[str, NodeRecord] = {}
        self._event_keys: list[str] = []
        #: the records of the view, each decoded once per revision (a relist decodes only what
        #: changed since the last)
        self._decoded = DecodedRecords()
        self._jobs = _JobTables(self._decoded)
        self._jobs.on_downtime = functools.partial(self._downtime, self._jobs)
        self._drain_deadlines: dict[str, float] = {}
        self._changed = asyncio.Event()
        self._need_relist = False
        #: while a relist reads: the watches' events, to apply again to the tables it reads
        self._relisting: list[tuple[str, WatchEvent]] | None = None
        self._bad_values = BadValues(metrics, self.log)
        #: when the current mass disruption was first seen, and until when node losses are held
        #: (see _view)
        self._disruption_since: float | None = None
        self._hold_losses_until = 0.0
        #: wall time of the next settle or hold end, when a round must run (0: none)
        self._wake_at = 0.0
        #: create revision of the controller key this daemon won (see _as_leader)
        self._leader_key_revision = 0
        #: node -> when this controller first saw it in service without a live record
        self._absent_since: dict[str, float] = {}
        #: node -> the lease this controller revoked and why (its probes: see _probe_failed); a
        #: node lost on evidence needs no settle time (a mass disruption's hold it waits out)
        self._evidence: dict[str, tuple[int, str]] = {}
        #: wall time until which this daemon, having resigned, does not campaign
        self._resigned_until = 0.0

    # -- election ---------------------------------------------------------------------------

    async def run(self) -> None:
        # Jittered: after an outage every daemon campaigns again, not all in the same instant.
        backoff = Backoff()
        while not self.stop.is_set():
            try:
                await self._campaign_once()
            except StoreError as exc:
                self.metrics.etcd_retries.labels(call="campaign").inc()
                self.log.debug("Controller election could not reach etcd.", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), backoff.next())
            else:
                backoff.reset()

    async def _campaign_once(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.agent.registered.wait(), 1.0)
        if (aside := self._resigned_until - self.wall()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), min(aside, 1.0))
            return
        lease = self.agent.lease
        if lease is None or self.stop.is_set():
            return
        # Read first: the create-if-absent is a write, sent only while nobody holds the key.
        kv = await self.store.get(self.keys.controller)
        me = ControllerRecord(node=self.agent.cfg.node, incarnation=self.agent.incarnation,
                              since=self.wall())
        if kv is None:
            await self.store.txn(compare=[("create", self.keys.controller, 0)],
                                 success=[("put", self.keys.controller, me.encode(), lease)])
            kv = await self.store.get(self.keys.controller)
        elif kv.lease != lease and (why := _not_a_claim(kv)):
            # Every controller writes its record under its own lease, so the key goes with the
            # lease. A value put without one, or one that is not a controller record (a foreign
            # or mistaken write, under a lease its writer may keep alive for ever), is no
            # claim: waited on, no daemon would lead again, and no job would be recovered.
            # Counted as a bad value and taken over, compared on its revision (a daemon that
            # takes it first wins).
            self._bad_values.found("controller", kv.key, kv.mod_revision, why)
            await self.store.txn(compare=[("mod", self.keys.controller, kv.mod_revision)],
                                 success=[("put", self.keys.controller, me.encode(), lease)])
            kv = await self.store.get(self.keys.controller)
        if kv is not None and kv.lease == lease:
            # Ours (just won, or won before a failed read): lead with the key's create
            # revision, which every write of this controller compares (a deposed one's fail).
            await self._lead(lease, kv.create_revision)
            return
        if kv is not None:
            await self._wait_for_change(self.keys.controller, kv.mod_revision,
                                        timeout=CAMPAIGN_RECHECK_S)

    async def _wait_for_change(self, key: str, revision: int, timeout: float) -> None:
        done = asyncio.Event()

        async def watch() -> None:
            async for ev in self.store.watch_prefix(key, revision + 1, done):
                if not isinstance(ev, WatchEvent) or ev.kv.key == key:
                    done.set()

        task = asyncio.create_task(watch(), name="controller-wait")
        stop_wait = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({task, stop_wait}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.set()
            stop_wait.cancel()
            task.cancel()
            await asyncio.wait({task, stop_wait}, timeout=2)

    # -- leading ----------------------------------------------------------------------------

    async def _lead(self, lease: int, key_revision: int) -> None:
        self._leader_key_revision = key_revision
        self.is_leader = True
        self.metrics.controller.set(1)
        self.job_metrics = ControllerMetrics()
        self.metrics.registry.register(self.job_metrics)
        self.log.info("This daemon is now the controller.")
        await self.events.emit("controller-elected",
                               f"Node {self.agent.cfg.node} became the controller.")
        lost = asyncio.Event()
        watches: list[asyncio.Task[None]] = []
        failed_rounds = 0  # in a row, an outage's included
        broken_rounds = 0  # in a row, failed with an error of this controller's own
        self.metrics.controller_failed_rounds.set(0)
        try:
            rev = await self._relist()
            last_list = self.wall()
            watches = [
                asyncio.create_task(self._watch(self.keys.nodes, rev, lost), name="ctl-nodes"),
                asyncio.create_task(self._watch(self.keys.registry, rev, lost),
                                    name="ctl-registry"),
                asyncio.create_task(self._watch(self.keys.jobs, rev, lost), name="ctl-jobs"),
                asyncio.create_task(self._watch(self.keys.kv_root, rev, lost), name="ctl-kv"),
                asyncio.create_task(self._watch(self.keys.drains, rev, lost), name="ctl-drains"),
                asyncio.create_task(self._watch_leadership(lost), name="ctl-leadership"),
            ]
            if self.agent.cfg.probe.enabled:
                prober = Prober(self.agent.cfg.probe, self.agent.cfg.node, lambda: self._live,
                                self._probe_failed, busy=lambda: self._jobs.busy())
                watches.append(asyncio.create_task(prober.run(lost), name="ctl-probes"))
            while not self.stop.is_set() and not lost.is_set() and self.agent.lease == lease:
                # Wake early when a node's settle time or a hold ends (see _view).
                pending = self._wake_at - self.wall()
                await wait_any((self._changed, self.stop, lost),
                               min(self.tick, max(0.01, pending)) if pending > 0 else self.tick)
                self._changed.clear()
                try:
                    if self._need_relist:  # the watches lost events: the view may be wrong
                        await self._relist()
                        last_list = self.wall()
                    failpoints.hit("controller.round")
                    view, now = self._view(), self.wall()
                    self.job_metrics.observe_jobs(job_summaries(view), now)
                    await self._apply(plan(view, now))
                    if self.wall() - last_list > self.relist_interval:
                        # The backstop, after the round: a round woken by a change (a node
                        # record gone) does not wait for it (136-154 ms at 4,096 nodes; before,
                        # 3 in 20 failovers there took 401-469 ms to be marked failed, the
                        # others 264-311 ms: docs/benchmarks.md).
                        await self._relist()
                        last_list = self.wall()
                    if failed_rounds:
                        self.log.info(f"Controller rounds succeed again after {failed_rounds} "
                                      "that failed.")
                        failed_rounds = broken_rounds = 0
                        self.metrics.controller_failed_rounds.set(0)
                except StoreError as exc:
                    # An etcd outage fails every round until it ends: say so once, not each time.
                    failed_rounds += 1
                    self.metrics.controller_failed_rounds.set(failed_rounds)
                    self.metrics.etcd_retries.labels(call="controller-round").inc()
                    (self.log.warning if failed_rounds == 1 else self.log.debug)(
                        "Controller round failed; retrying until etcd answers.", error=str(exc))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), 0.2)
                except Exception:
                    # A bug here would crash every daemon in turn as each is elected, and take
                    # every node's workers with it: contain it, shout, and retry each second.
                    failed_rounds += 1
                    broken_rounds += 1
                    self.metrics.controller_failed_rounds.set(failed_rounds)
                    self.metrics.errors.labels(kind="controller").inc()
                    self.log.exception("The controller's round failed; it did nothing this "
                                       "round and tries again.", failed_in_a_row=broken_rounds)
                    if broken_rounds >= RESIGN_AFTER_FAILED_ROUNDS:
                        await self._resign(broken_rounds)
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), 1.0)
        finally:
            lost.set()
            for t in watches:
                t.cancel()
            if watches:
                await asyncio.wait(watches, timeout=2)
            self.is_leader = False
            self.metrics.controller.set(0)
            self.metrics.controller_failed_rounds.set(0)  # counted while it leads
            self.metrics.registry.unregister(self.job_metrics)  # another controller's now
            self.log.info("This daemon is no longer the controller.")
            if self.stop.is_set() and self.agent.lease == lease:
                with contextlib.suppress(StoreError):
                    await self.store.delete(self.keys.controller)

    async def _resign(self, rounds: int) -> None:
        """Give the leadership up after ``rounds`` failed rounds in a row: delete the controller
        key if it is still the one this daemon won, and stand aside ``RESIGN_BACKOFF_S``."""
        self._resigned_until = self.wall() + RESIGN_BACKOFF_S
        why = (f"Node {self.agent.cfg.node} resigned as the controller: its last {rounds} "
               f"rounds failed with errors of its own (see its log); it stands aside "
               f"{RESIGN_BACKOFF_S:g} s.")
        self.log.error(why)
        # Said first: the event comes before the next controller's election, not after it.
        with contextlib.suppress(Exception):  # saying so must not fail the resignation
            await self.events.emit("controller-resigned", why)
        with contextlib.suppress(StoreError):
            await self.store.txn(
                compare=[("create", self.keys.controller, self._leader_key_revision)],
                success=[("delete", self.keys.controller)])

    def _downtime(self, jobs: _JobTables, job: str, migration: str, seconds: float) -> None:
        """A rank's downtime report, read into ``jobs``: counted if it is of the job's migration
        now, or of one that ended moments ago (a controller elected later reads every report
        still in etcd and counts none of the old ones again)."""
        current = jobs.migrations.get(job)
        if current is None or current[0].id != migration:
            return
        m = current[0]
        if m.active or self.wall() - m.updated_at <= DOWNTIME_REPORT_S:
            self.job_metrics.observe_downtime(m.kind, seconds)

    async def _probe_failed(self, rec: NodeRecord, why: str) -> None:
        """The prober found ``rec``'s node dead or silent: revoke its lease. Its record goes
        with it, so the next round marks it failed and recovers its ranks, without waiting for
        the TTL or the settle time. A node that was only cut off finds its lease revoked once
        it reaches etcd, and fences itself as after an expired one."""
        live = self._live.get(rec.name)
        if live is None or live.lease != rec.lease:
            return
        try:
            await self.store.revoke(rec.lease)
        except StoreError as exc:
            self.log.warning(f"Could not revoke the lease of node {rec.name}, which {why}; "
                             "its lease will expire.", error=str(exc))
            return
        self._evidence[rec.name] = (rec.lease, f"{why}; its lease was revoked")
        self._changed.set()  # the round that recovers its ranks need not wait for the event
        self.log.warning(f"Node {rec.name} is lost: {why}. Revoked its lease.")
        await self.events.emit("node-unreachable", f"Node {rec.name} is lost: {why}; the "
                               "controller revoked its lease.", node=rec.name)

    async def _watch_leadership(self, lost: asyncio.Event) -> None:
        kv = await self.store.get(self.keys.controller)
        if kv is None or kv.lease != self.agent.lease:
            lost.set()
            return
        async for ev in self.store.watch_prefix(self.keys.controller, kv.mod_revision + 1, lost):
            if isinstance(ev, WatchEvent) and ev.kv.key == self.keys.controller and \
                    (ev.kind == "delete" or ev.kv.lease != self.agent.lease):
                lost.set()

    async def _watch(self, prefix: str, revision: int, lost: asyncio.Event) -> None:
        async for ev in self.store.watch_prefix(prefix, revision + 1, lost):
            if isinstance(ev, WatchEvent):
                self._ingest(prefix, ev.kv, deleted=ev.kind == "delete")
            else:
                self._need_relist = True
            self._changed.set()

    async def _relist(self) -> int:
        """Re-read the whole view; returns the revision it was read at. One that fails (etcd
        went away between its reads) leaves the view half read: the next round re-lists again
        before it plans. A round that planned on it saw nodes without records, and failed a
        job whose every replica looked gone (test_outage.py, once the periodic re-list ran
        after the round)."""
        self._need_relist = False
        try:
            return await self._read_view()
        except BaseException:
            self._need_relist = True
            raise

    async def _read_view(self) -> int:
        """Read the whole view into new tables and put them in place at once.

        The old tables stay in use until then: the prober, a probe's revocation and the watches
        read and feed them while the reads are awaited (tables cleared first showed the prober
        no nodes, which lost their probe peers and started their silence over). The watches'
        events meanwhile are kept, and those newer than the read of their prefix are applied to
        the new tables as they go in: an event applied to the old tables only is not lost."""
        fresh = _Tables(registry={}, live={}, jobs=_JobTables(self._decoded), drain_deadlines={})
        fresh.jobs.on_downtime = functools.partial(self._downtime, fresh.jobs)
        # Shared while both are fed, so that a report counted through the old tables during the
        # reads is not counted again through the new ones.
        fresh.jobs.downtimes_counted = self._jobs.downtimes_counted
        self._relisting = []
        try:
            self._decoded.begin()
            read_at: dict[str, int] = {}
            for prefix in (self.keys.registry, self.keys.nodes, self.keys.jobs,
                           self.keys.drains, self.keys.kv_root):
                kvs, read_at[prefix] = await self.store.get_prefix(prefix)
                for kv in kvs:
                    self._ingest(prefix, kv, deleted=False, into=fresh)
            event_keys = await self.store.keys(self.keys.events)  # their values: never read
            self._decoded.end()
            # From here on nothing is awaited: the new tables go in whole.
            self._registry, self._live = fresh.registry, fresh.live
            self._jobs, self._drain_deadlines = fresh.jobs, fresh.drain_deadlines
            self._event_keys = event_keys
            kept, self._relisting = self._relisting, None
            for prefix, ev in kept:
                if ev.kv.mod_revision > read_at[prefix]:
                    self._ingest(prefix, ev.kv, deleted=ev.kind == "delete")
        finally:
            self._relisting = None
        # The downtime reports still in etcd were read again: those counted already stay
        # counted (each relist counted them again, up to six times in the minute a migration's
        # downtime is taken: tests/integration/test_controller_races.py). Only the jobs'
        # current migrations' are kept: an older one's report is never counted.
        self._jobs.downtimes_counted = {
            (job, mid) for job, mid in self._jobs.downtimes_counted
            if (m := self._jobs.migrations.get(job)) is not None and m[0].id == mid}
        # Watches replay from the first read on: replaying events the second read already saw
        # is harmless (they are applied in order and end at the same state), missing some is not.
        return read_at[self.keys.registry]

    def _ingest(self, prefix: str, kv: KV, deleted: bool, into: _Tables | None = None) -> None:
        """Apply one record (or its deletion) to the tables in use, or to ``into``."""
        if into is None and self._relisting is not None:
            self._relisting.append((prefix, WatchEvent("delete" if deleted else "put", kv)))
        registry = self._registry if into is None else into.registry
        live = self._live if into is None else into.live
        jobs = self._jobs if into is None else into.jobs
        drain_deadlines = self._drain_deadlines if into is None else into.drain_deadlines
        if deleted:
            self._decoded.forget(kv.key)
        if prefix == self.keys.jobs:
            try:
                jobs.ingest(Keys.name_of(kv.key, prefix), kv, deleted)
            except RecordError as exc:
                self._bad(kv, "jobs", exc)
            return
        if prefix == self.keys.kv_root:
            jobs.ingest_progress(Keys.name_of(kv.key, prefix), kv.value, deleted)
            return
        if prefix == self.keys.drains:
            name = Keys.name_of(kv.key, prefix)
            drain_deadlines.pop(name, None)
            if not deleted:
                try:
                    drain_deadlines[name] = self._decoded.decode(
                        kv, DrainRequest.decode).deadline
                except RecordError as exc:
                    self._bad(kv, "drains", exc)
            return
        name = Keys.name_of(kv.key, prefix)
        table: dict[str, object] = registry if prefix == self.keys.registry \
            else live  # type: ignore[assignment]
        if deleted:
            table.pop(name, None)
            return
        try:
            if prefix == self.keys.registry:
                entry = self._decoded.decode(kv, RegistryEntry.decode)
                if entry.name != name:
                    raise RecordError(f"registry entry under {name!r} names {entry.name!r}")
                registry[name] = (entry, kv.mod_revision)
            else:
                rec = self._decoded.decode(kv, NodeRecord.decode)
                if rec.name != name or rec.lease != kv.lease or kv.lease == 0:
                    raise RecordError(f"node record under {name!r} is not bound to its lease")
                live[name] = rec
        except RecordError as exc:
            # Ignored, never acted on: a garbage value must not fail a node or crash us.
            table.pop(name, None)
            self._bad(kv, prefix.rstrip("/").rsplit("/", 1)[-1], exc)

    def _bad(self, kv: KV, collection: str, exc: RecordError) -> None:
        self._bad_values.found(collection, kv.key, kv.mod_revision, str(exc))

    def _view(self) -> ClusterView:
        now = self.wall()
        # A mass disruption: more than half of the nodes in service (two at least) lost their
        # records at once.
        # That is the control plane's doing (a single etcd member paused past the TTL revokes
        # every lease when it wakes), not a fleet of dead machines: their daemons join again
        # within moments, keeping their ranks. Node losses are held for two TTLs from when it
        # began; nodes still without a record then are lost (a real mass failure only waits).
        ttl = self.agent.cfg.lease.ttl
        in_service = [n for n, (e, _) in self._registry.items()
                      if not e.offline and e.state != NodeState.FAILED]
        # Gone, or back moments ago on a new lease without a restart (lost theirs): a controller
        # elected amid the rejoins sees most nodes back already and must still hold the rest.
        for n, (revoked, _) in list(self._evidence.items()):
            # Back, as a new incarnation. The record of the lease it revoked stays in the view
            # until the watch brings its deletion: a round in between keeps the evidence.
            if n in self._live and self._live[n].lease != revoked:
                del self._evidence[n]
        absent = [n for n in in_service if n not in self._evidence and (n not in self._live or (
            self._live[n].registered_at - self._live[n].started_at > ttl
            and now - self._live[n].registered_at < 2 * ttl))]
        for n in in_service:
            if n in self._live:
                self._absent_since.pop(n, None)
            else:
                self._absent_since.setdefault(n, now)
        if len(absent) < 2 or len(absent) * 2 <= len(in_service):
            self._disruption_since = None
        elif self._disruption_since is None:
            self._disruption_since = now
            self._hold_losses_until = now + 2 * ttl
            self.log.warning(f"{len(absent)} of {len(in_service)} nodes lost their lease at "
                             "once; holding node losses for two TTLs while they join again.",
                             nodes=sorted(absent))
        settle = self.agent.cfg.lease.keepalive_interval / 2
        ends = [t + settle for t in self._absent_since.values() if t + settle > now]
        if self._hold_losses_until > now:
            ends.append(self._hold_losses_until)
        self._wake_at = min(ends, default=0.0)
        return ClusterView(registry=dict(self._registry), live=dict(self._live),
                           event_keys=tuple(self._event_keys), jobs=self._jobs.views(),
                           drain_deadlines=dict(self._drain_deadlines),
                           migration_timeout=self.agent.cfg.drain.migration_timeout,
                           hold_losses_until=self._hold_losses_until,
                           absent_since=dict(self._absent_since),
                           loss_settle=settle,
                           evidence={n: why for n, (_, why) in self._evidence.items()})

    def _as_leader(self, compare: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """``compare`` and: this daemon still holds the controller key it won (etcd's
        election idiom). A controller deposed mid-round (its lease lapsed) writes nothing."""
        return [*compare, ("create", self.keys.controller, self._leader_key_revision)]

    async def _write(self, key: str, value: bytes, mod_revision: int) -> bool:
        """Compare-and-swap ``key`` as the leader."""
        return await self.store.txn(compare=self._as_leader([("mod", key, mod_revision)]),
                                    success=[("put", key, value, None)])

    async def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, AssignJob | SetJobState):
                await self._apply_job(action)
            elif isinstance(action, StartMigration | AdvanceMigration):
                await self._apply_migration(action)
            elif isinstance(action, AddStandbys):
                a = action.assignment
                if await self._write(self.keys.job_assignment(a.job), a.encode(),
                                     self._jobs.assignments[a.job][1]):
                    self.log.info(f"Job {a.job}: {action.reason}.", job=a.job)
                    await self.events.emit("standbys-added", f"Job {a.job}: {action.reason}.",
                                           job=a.job, standbys=list(a.standbys))
                self._changed.set()
            elif isinstance(action, MarkFailed):
                entry, rev = self._registry[action.node]
                failed = dataclasses.replace(entry, state=NodeState.FAILED, reason=action.reason,
                                             updated_at=self.wall())
                # Only while the node record is really gone: a joining node writes its record
                # and its entry in one transaction, but they reach us through two watches, and
                # a round can run between them. Losing this compare needs no re-plan: the
                # change that made it fail arrives through a watch.
                if await self.store.txn(
                        compare=self._as_leader([("mod", self.keys.registry_entry(action.node),
                                                  action.mod_revision),
                                                 ("create", self.keys.node(action.node), 0)]),
                        success=[("put", self.keys.registry_entry(action.node),
                                  failed.encode(), None)]):
                    self._registry[action.node] = (failed, rev)
                    self.log.warning(f"Node {action.node} failed: {action.reason}.")
                    await self.events.emit("node-failed",
                                           f"Node {action.node} failed: {action.reason}.",
                                           node=action.node, previous_state=str(entry.state))
            else:
                for key in action.keys:
                    await self.store.delete(key)
                self._event_keys = self._event_keys[len(action.keys):]

    async def _apply_migration(self, action: StartMigration | AdvanceMigration) -> None:
        now = self.wall()
        if isinstance(action, StartMigration):
            m = action.migration
            key = self.keys.job_migration(m.job)
            # A recovery of a lost node's ranks stands only while that node has no record: one
            # that joined again since keeps them (its daemon checks for a plan once its new
            # record exists; see JobRunner.readopt).
            if await self.store.txn(
                    compare=self._as_leader([("mod", key, self._jobs.migration_rev(m.job)),
                                             *(("create", self.keys.node(n), 0)
                                               for n in action.absent)]),
                    success=[("put", key, m.encode(), None)]):
                self.log.info(f"Migration {m.id} of job {m.job} planned: {action.reason}.",
                              job=m.job, epoch=m.from_epoch)
                await self.events.emit("migration-planned",
                                       f"Job {m.job}: migration {m.id} planned "
                                       f"({m.reason}): {action.reason}.", job=m.job, id=m.id)
                # the plan is in etcd, nothing else has happened: the next controller's to run
                failpoints.hit("controller.migration.planned")
            self._changed.set()
            return
        current = self._jobs.migrations.get(action.job)
        if current is None or current[0].id != action.id:
            return
        m, rev = current
        if not m.can_become(action.phase):
            self._refused(f"Refused to move migration {m.id} of job {m.job} from {m.phase} to "
                          f"{action.phase} ({action.reason}): a {m.kind} migration cannot.",
                          m.job)
            return
        timings = {**m.timings, str(action.phase): now}
        new = dataclasses.replace(
            m, phase=action.phase, updated_at=now, timings=timings,
            outcome=action.reason if action.phase == MigrationPhase.ABORTED else m.outcome)
        key = self.keys.job_migration(action.job)
        ops: list[tuple[Any, ...]] = [("put", key, new.encode(), None)]
        compare: list[tuple[Any, ...]] = [("mod", key, rev)]
        if action.assignment is not None:
            a_key = self.keys.job_assignment(action.job)
            compare.append(("mod", a_key, self._jobs.assignments[action.job][1]))
            ops.append(("put", a_key, action.assignment.encode(), None))
        if await self.store.txn(compare=self._as_leader(compare), success=ops):
            self.log.info(f"Migration {m.id} of job {m.job} is {action.phase}: "
                          f"{action.reason}.", job=m.job, epoch=m.from_epoch)
            details: dict[str, Any] = {"id": m.id, "phase": str(action.phase)}
            if action.phase in (MigrationPhase.DONE, MigrationPhase.ABORTED):
                details["timings"] = {k: round(v - m.created_at, 4) for k, v in
                                      timings.items() if isinstance(v, int | float)}
                self.job_metrics.migration_ended(m.kind, str(action.phase), timings)
            await self.events.emit(f"migration-{action.phase}",
                                   f"Job {m.job}: migration {m.id} {action.phase} "
                                   f"({action.reason}).", job=m.job, **details)
            if action.phase == MigrationPhase.DONE:
                await self._collect_retired(m)
        self._changed.set()

    def _refused(self, what: str, job: str) -> None:
        """A planner action outside its record's lifecycle, dropped unwritten: logged, and
        counted (``understudy_errors_total{kind="controller-refused"}``)."""
        self.log.error(f"{what} {PLANNER_BUG}", job=job)
        self.metrics.errors.labels(kind="controller-refused").inc()

    async def _collect_retired(self, m: Migration) -> None:
        """Remove from etcd what migration ``m``, now committed, left behind for good: the
        bootstrap namespaces of the group versions it retired and of earlier attempts' transfer
        pairs (``layout.retired_bootstrap``), and the reports of the job's earlier migrations.
        Nothing reads them again, and each would stay under ``kv/`` (which the controller
        reads whole when it starts and at every relist) for the job's whole life. Best
        effort: a failure is logged, and the next commit collects what this one left."""
        base = self.keys.kv(m.job)
        try:
            keys = await self.store.keys(base)
            retired = retired_bootstrap(keys, base, m.group_version)
            retired += retired_reports(keys, base, m.id)
            for i in range(0, len(retired), TXN_DELETES):
                await self.store.txn(compare=self._as_leader([]), success=[
                    ("delete-prefix", prefix) for prefix in retired[i:i + TXN_DELETES]])
        except StoreError as exc:
            self.log.warning(f"Could not remove what migration {m.id} of job {m.job} retired "
                             f"from etcd: {exc}.", job=m.job, error=str(exc))
            return
        if retired:
            self.log.info(f"Removed {len(retired)} namespace(s) that migration {m.id} of job "
                          f"{m.job} retired from etcd.", job=m.job,
                          namespaces=[p.removeprefix(base) for p in retired])

    async def _apply_job(self, action: AssignJob | SetJobState) -> None:
        now = self.wall()
        if isinstance(action, AssignJob):
            a = action.assignment
            status = JobStatus(job=a.job, state=JobState.RUNNING, reason=action.reason,
                               updated_at=now)
            ok = await self.store.txn(
                compare=self._as_leader([
                    ("create", self.keys.job_assignment(a.job), 0),
                    ("mod", self.keys.job_status(a.job), self._jobs.status_rev(a.job))]),
                success=[("put", self.keys.job_assignment(a.job), a.encode(), None),
                         ("put", self.keys.job_status(a.job), status.encode(), None)])
            if ok:
                self.log.info(f"Job {a.job} placed: {action.reason}.", job=a.job, epoch=a.epoch)
                await self.events.emit("job-started", f"Job {a.job} started: {action.reason}.",
                                       job=a.job, ranks=list(a.ranks),
                                       standbys=list(a.standbys), epoch=a.epoch)
            self._changed.set()
            return
        current = self._jobs.statuses.get(action.job)
        before = current[0].state if current is not None else JobState.PENDING
        if not before.can_become(action.state):
            self._refused(f"Refused to write job {action.job} as {action.state} "
                          f"({action.reason}): a {before} job cannot become {action.state}.",
                          action.job)
            return
        status = JobStatus(job=action.job, state=action.state, reason=action.reason,
                           updated_at=now, paused=action.paused)
        if await self._write(self.keys.job_status(action.job), status.encode(),
                             self._jobs.status_rev(action.job)):
            self.log.info(f"Job {action.job} is {action.state}: {action.reason}.",
                          job=action.job)
            await self.events.emit(action.event or f"job-{action.state}",
                                   f"Job {action.job} is {action.state}: {action.reason}.",
                                   job=action.job)
        self._changed.set()


def retired_reports(keys: list[str], base: str, current: str) -> list[str]:
    """The report namespaces among ``keys`` (under ``base``, a job's ``kv/<job>/``; reports
    are ``migration/<id>/<report>``) of every migration but ``current``, each as a key prefix
    ending in ``/``: once a later migration committed, nothing waits on them."""
    ids = {parts[1] for key in keys if key.startswith(base)
           and len(parts := key.removeprefix(base).split("/", 2)) == 3
           and parts[0] == "migration" and parts[1]}
    return [f"{base}migration/{i}/" for i in sorted(ids - {current})]


def _seconds(value: bytes) -> float | None:
    """A worker's report of seconds (untrusted): a finite number from 0 to a day, or None."""
    try:
        seconds = float(value[:32].decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and 0 <= seconds <= 86400 else None


def _epoch_rises(before: SnapshotReport, after: SnapshotReport) -> bool:
    return before.epoch is not None and after.epoch is not None and before.epoch < after.epoch


def _not_a_claim(kv: KV) -> str:
    """Why the controller key's value claims nothing ("" if it is a controller's claim)."""
    if kv.lease == 0:
        return "the controller key has no lease: no controller holds it"
    try:
        ControllerRecord.decode(kv.value)
    except RecordError as exc:
        return f"the controller key holds no controller record: {exc}"
    return ""


@dataclasses.dataclass
class _Tables:
    """What a relist reads, before it replaces the controller's tables with it."""

    registry: dict[str, tuple[RegistryEntry, int]]
    live: dict[str, NodeRecord]
    jobs: _JobTables
    drain_deadlines: dict[str, float]


class _JobTables:
    """The controller's cache of ``<prefix>/jobs/``, fed by list and watch events."""

    def __init__(self, decoded: DecodedRecords | None = None) -> None:
        #: shared with the controller's other tables, which outlive a relist's new one
        self.decoded = decoded if decoded is not None else DecodedRecords()
        self.specs: dict[str, JobSpec] = {}
        self.assignments: dict[str, tuple[Assignment, int]] = {}
        self.statuses: dict[str, tuple[JobStatus, int]] = {}
        self.exits: dict[str, dict[tuple[int, int], RankExit]] = {}
        self.migrations: dict[str, tuple[Migration, int]] = {}
        self.resizes: dict[str, tuple[ResizeRequest, int]] = {}
        self.stops: dict[str, tuple[StopRequest, int]] = {}
        #: a restart-only job's meeting point (its daemons' business; kept for completeness)
        self.rendezvous: dict[str, tuple[Rendezvous, int]] = {}
        #: job -> migration id -> progress keys ("prepared/3", ...)
        self.progress: dict[str, dict[str, set[str]]] = {}
        self.abort_reasons: dict[tuple[str, str], str] = {}
        #: called once per migration with its downtime as a rank reported it (job, id, s)
        self.on_downtime: Callable[[str, str, float], None] = lambda job, mid, s: None
        #: the (job, migration) pairs whose downtime report was handed to ``on_downtime``
        self.downtimes_counted: set[tuple[str, str]] = set()
        #: job -> rank -> its newest snapshot report, and before it the last one of an older
        #: epoch (a joiner's first report does not list its predecessor's copies)
        self.snapshot_reports: dict[str, dict[int, tuple[SnapshotReport, ...]]] = {}
        #: job -> rank -> its newest stuck report (``worker/stuck.py``)
        self.stuck: dict[str, dict[int, StuckReport]] = {}

    def busy(self) -> bool:
        """Whether a job is pending or running: one submitted with no status yet included."""
        return any(job not in self.statuses or not self.statuses[job][0].state.ended
                   for job in self.specs)

    @property
    def snapshots(self) -> dict[str, dict[int, tuple[int, ...]]]:
        """job -> rank -> the storage steps of its newest report"""
        return {job: {r: reps[-1].storage for r, reps in ranks.items()}
                for job, ranks in self.snapshot_reports.items()}

    @property
    def memory_snapshots(self) -> dict[str, dict[int, MemoryCopies]]:
        """job -> rank -> the memory copies of its newest report"""
        return {job: {r: m for r, reps in ranks.items() if (m := reps[-1].memory) is not None}
                for job, ranks in self.snapshot_reports.items()}

    def ingest_progress(self, path: str, value: bytes, deleted: bool) -> None:
        """``path`` is ``<job>/migration/<id>/<report>`` under the workers' KV root."""
        parts = path.split("/", 3)
        if len(parts) == 3 and parts[1] == "snapshots":
            self._ingest_snapshots(parts[0], parts[2], value, deleted)
            return
        if len(parts) == 3 and parts[1] == "stuck":
            self._ingest_stuck(parts[0], parts[2], value, deleted)
            return
        if len(parts) != 4 or parts[1] != "migration":
            return
        job, _, mig_id, report = parts
        if report.startswith(f"{Report.DOWNTIME}/"):
            if not deleted and (job, mig_id) not in self.downtimes_counted:
                seconds = _seconds(value)
                if seconds is not None:
                    self.downtimes_counted.add((job, mig_id))
                    self.on_downtime(job, mig_id, seconds)
            return
        reports = self.progress.setdefault(job, {}).setdefault(mig_id, set())
        if deleted:
            reports.discard(report)
        else:
            reports.add(report)
            if report == Report.ABORTED or (report.startswith(f"{Report.TRANSFERRED}/")
                                            and value != TRANSFER_OK):
                reports.add(Report.ABORTED)
                self.abort_reasons.setdefault((job, mig_id),
                                              value[:300].decode(errors="replace"))

    def _ingest_stuck(self, job: str, rank: str, value: bytes, deleted: bool) -> None:
        """``<job>/stuck/<rank>``: that rank's report of a collective it has waited in long
        (``StuckReport``); anything else there, or a report for another rank or job, is none."""
        table = self.stuck.setdefault(job, {})
        report = None
        if not deleted and rank.isdigit():
            try:
                report = StuckReport.decode(value)
            except RecordError:
                report = None
        if report is None or report.job != job or str(report.rank) != rank:
            if rank.isdigit():
                table.pop(int(rank), None)
            return
        table[report.rank] = report

    def _ingest_snapshots(self, job: str, rank: str, value: bytes, deleted: bool) -> None:
        """``<job>/snapshots/<rank>``: which steps that rank's snapshots hold, in storage and
        in a holder's memory (``SnapshotReport``; a plain JSON list is storage steps).
        Anything else is ignored (workers write here, so the value is untrusted). A report of
        a newer epoch keeps the rank's last report of an older one beside it; which of them
        count is decided when the job is viewed, against its assignment's epoch."""
        table = self.snapshot_reports.setdefault(job, {})
        if not rank.isdigit():
            return
        r = int(rank)
        try:
            report = None if deleted else SnapshotReport.parse(value)
        except ValueError:
            report = None
        if report is None:
            table.pop(r, None)
            return
        before = table.get(r, ())
        older = before[0] if len(before) == 2 else None
        newest = before[-1] if before else None
        if newest is not None and _epoch_rises(newest, report):
            table[r] = (newest, report)
        elif older is not None and newest is not None and newest.epoch == report.epoch:
            table[r] = (older, report)  # the same epoch again: its predecessor stays
        else:
            table[r] = (report,)

    def migration_rev(self, job: str) -> int:
        return self.migrations[job][1] if job in self.migrations else 0

    def ingest(self, path: str, kv: KV, deleted: bool) -> None:
        """``path`` is ``<job>/spec`` etc. Raises RecordError for a value that does not fit."""
        job, _, rest = path.partition("/")
        if rest in JOB_RECORDS:
            tables: dict[str, dict[str, Any]] = {"spec": self.specs, "assignment": self.assignments,
                                                 "status": self.statuses,
                                                 "migration": self.migrations,
                                                 "resize": self.resizes,
                                                 "stop": self.stops,
                                                 "rendezvous": self.rendezvous}
            if deleted:
                tables[rest].pop(job, None)
                return
            decoded = self.decoded.decode(kv, functools.partial(decode_job_record, path))
            assert decoded is not None
            record = decoded[2]
            tables[rest][job] = record if rest == "spec" else (record, kv.mod_revision)
        elif rest.startswith("exits/"):
            table = self.exits.setdefault(job, {})
            try:
                _, epoch, rank = rest.split("/")
                key = (int(epoch), int(rank))
            except ValueError:
                raise RecordError(f"unexpected key jobs/{path}") from None
            if deleted:
                table.pop(key, None)
            else:
                table[key] = self.decoded.decode(kv, RankExit.decode)
        else:
            raise RecordError(f"unexpected key jobs/{path}")

    def status_rev(self, job: str) -> int:
        return self.statuses[job][1] if job in self.statuses else 0

    def views(self) -> dict[str, JobView]:
        out = {}
        for name, spec in self.specs.items():
            a = self.assignments.get(name)
            st = self.statuses.get(name)
            exits, next_exits = {}, {}
            m = self.migrations.get(name)
            if a is not None:
                exits = {rank: e for (epoch, rank), e in self.exits.get(name, {}).items()
                         if epoch == a[0].epoch}
            if m is not None:
                next_exits = {rank: e for (epoch, rank), e in self.exits.get(name, {}).items()
                              if epoch == m[0].to_epoch}
            progress = frozenset(self.progress.get(name, {}).get(m[0].id, set())) if m \
                else frozenset()
            storage, storage_epochs, memory = self._counted_snapshots(
                name, a[0].epoch if a is not None else None)
            out[name] = JobView(spec=spec, status=st[0] if st else None,
                                assignment=a[0] if a else None, exits=exits,
                                next_exits=next_exits,
                                migration=m[0] if m else None, progress=progress,
                                abort_reason=self.abort_reasons.get((name, m[0].id), "")
                                if m else "", snapshots=storage, memory_snapshots=memory,
                                storage_epochs=storage_epochs,
                                resize=r[0] if (r := self.resizes.get(name)) else None,
                                stop=q[0] if (q := self.stops.get(name)) else None,
                                stuck={r: rep for r, rep in self.stuck.get(name, {}).items()
                                       if a is not None and rep.epoch == a[0].epoch})
        return out

    def _counted_snapshots(self, job: str, epoch: int | None
                           ) -> tuple[dict[int, tuple[int, ...]],
                                      dict[int, dict[int, int | None]], dict[int, MemoryCopies]]:
        """The copies each rank's reports name that count at the job's epoch
        (``snapshot_tiers.report_counts``): storage steps, their writers' epochs, memory."""
        storage: dict[int, tuple[int, ...]] = {}
        epochs: dict[int, dict[int, int | None]] = {}
        memory: dict[int, MemoryCopies] = {}
        for r, reports in self.snapshot_reports.get(job, {}).items():
            if epoch is None:  # no assignment yet, so no plan: the newest report, as it is
                newest = reports[-1]
                held, copies = counted_copies((newest,), newest.epoch or 0)
            else:
                held, copies = counted_copies(reports, epoch)
            if held:
                storage[r] = tuple(sorted(held))
                epochs[r] = held
            if copies is not None:
                memory[r] = copies
        return storage, epochs, memory


def job_summaries(view: ClusterView) -> dict[str, dict[str, Any]]:
    """Each job's state, pause and standby pool, for :class:`ControllerMetrics`."""
    out: dict[str, dict[str, Any]] = {}
    for name, job in view.jobs.items():
        a, status = job.assignment, job.status
        pool = a.standbys if a is not None and not (status and status.state.ended) else ()
        free = [n for n in pool if n in view.live and view.live[n].state == NodeState.STANDBY]
        out[name] = {"state": status.state if status else JobState.PENDING,
                     "paused": bool(status and status.paused), "needed": job.spec.standby,
                     "free": len(free),
                     "warm": sum(1 for n in free if view.live[n].warmth.get(name))}
    return out
