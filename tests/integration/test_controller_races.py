"""The controller's writes against a real etcd, in the races its watches allow; and a joining
node's, when etcd's answer is lost."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from understudy.common import config
from understudy.common.errors import StoreError
from understudy.common.keys import Keys
from understudy.common.records import (
    Assignment,
    ControllerRecord,
    DrainRequest,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    MigrationPhase,
    NodeRecord,
    RegistryEntry,
)
from understudy.common.states import NodeState
from understudy.common.store import EtcdStore
from understudy.daemon.controller import Controller
from understudy.daemon.events import EventLog
from understudy.daemon.metrics import Metrics
from understudy.daemon.node import NodeAgent
from understudy.daemon.planner import AdvanceMigration, MarkFailed, SetJobState, plan
from understudy.testing.embedded_etcd import EmbeddedEtcd


class _NoWorkers:
    running_count = 0

    def kill_all_now(self) -> None:
        pass

    async def stop_all(self, grace: float) -> None:
        pass


class _TxnAnswerLost(EtcdStore):
    """A real store whose first transaction is applied by etcd but whose answer never comes:
    the caller sees the request time out, as after an etcd that woke from a long pause too busy
    to answer within the timeout (etcd.timeout, 1 s)."""

    lost = 1

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.granted: list[int] = []

    async def grant(self, ttl: int) -> int:
        lease = await super().grant(ttl)
        self.granted.append(lease)
        return lease

    async def txn(self, compare: list[Any], success: list[Any],
                  failure: list[Any] | None = None) -> bool:
        ok = await super().txn(compare, success, failure)
        if self.lost:
            self.lost -= 1
            raise StoreError("etcd txn failed: timed out")
        return ok


def _controller(etcd: EmbeddedEtcd) -> tuple[Controller, EtcdStore, Keys]:
    """A controller of node "ctl" on ``etcd``, not started: the test drives it."""
    cfg = config.load(overrides={"node": "ctl", "etcd.endpoints": etcd.endpoint}, environ={})
    store, metrics, stop = EtcdStore(cfg.etcd), Metrics(), asyncio.Event()
    keys = Keys(cfg.etcd.prefix)
    events = EventLog(store, keys, "ctl", metrics)
    agent = NodeAgent(cfg, store, metrics, events, _NoWorkers(), stop)
    return Controller(agent, store, metrics, events, stop), store, keys


async def _register(store: EtcdStore, keys: Keys,
                    name: str) -> tuple[NodeRecord, RegistryEntry, int]:
    """``name``'s record (on a lease of its own) and registry entry, written as a daemon joins
    (one transaction); the entry's revision with them."""
    lease = await store.grant(30)
    rec = NodeRecord(name=name, incarnation="i1", lease=lease, state=NodeState.ACTIVE,
                     role="active", slots=1)
    entry = RegistryEntry(name=name, incarnation="i1", state=NodeState.ACTIVE,
                          updated_at=time.time())
    assert await store.txn(compare=[], success=[
        ("put", keys.node(name), rec.encode(), lease),
        ("put", keys.registry_entry(name), entry.encode(), None)])
    kv = await store.get(keys.registry_entry(name))
    assert kv is not None
    return rec, entry, kv.mod_revision


async def _running_job(store: EtcdStore, keys: Keys, ranks: tuple[str, ...],
                       standbys: tuple[str, ...]) -> Assignment:
    """Job "j" (DP only, one rank per node of ``ranks``) running there, as the controller
    placed it; returns its assignment."""
    now = time.time()
    a = Assignment(job="j", epoch=1, ranks=ranks, standbys=standbys, reason="",
                   updated_at=now)
    await store.put(keys.job_spec("j"), JobSpec(name="j", argv=("t",), cwd="/", tp=1,
                                                dp=len(ranks), standby=len(standbys),
                                                created_at=now).encode())
    await store.put(keys.job_assignment("j"), a.encode())
    await store.put(keys.job_status("j"), JobStatus(job="j", state=JobState.RUNNING, reason="",
                                                    updated_at=now).encode())
    return a


def test_a_joining_node_seen_by_its_registry_entry_first_is_not_failed(
        etcd: EmbeddedEtcd) -> None:
    """A node's record and registry entry are written in one transaction but reach the
    controller through two watches; a round between them sees an entry without a record. The
    controller must not mark that node failed (seen with 24 nodes joining at once in
    benchmarks/scale.py); once the record is really gone, the same action does, but only while
    this daemon still holds the controller key it won (a deposed controller writes nothing)."""

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        rec, entry, rev = await _register(store, keys, "node-j")
        lease = rec.lease
        ctl._registry["node-j"] = (entry, rev)  # the record's event is still due
        await store.put(keys.controller, b"ctl")  # as if won
        won = await store.get(keys.controller)
        assert won is not None
        ctl._leader_key_revision = won.create_revision
        # (past the settle time: a node counts as lost after half a keep-alive interval)
        actions = plan(ctl._view(), time.time() + ctl.agent.cfg.lease.keepalive_interval)
        assert [type(a) for a in actions] == [MarkFailed]
        await ctl._apply(actions)
        kv = await store.get(keys.registry_entry("node-j"))
        assert kv is not None and RegistryEntry.decode(kv.value).state == NodeState.ACTIVE
        assert (await store.get_prefix(keys.events))[0] == []

        await store.revoke(lease)  # the lease is gone: now the node has failed
        await store.delete(keys.controller)  # ... but this controller was deposed meanwhile
        await ctl._apply(actions)
        kv = await store.get(keys.registry_entry("node-j"))
        assert kv is not None and RegistryEntry.decode(kv.value).state == NodeState.ACTIVE
        await store.put(keys.controller, b"ctl")  # elected again: a new key, a new revision
        won = await store.get(keys.controller)
        assert won is not None
        ctl._leader_key_revision = won.create_revision
        await ctl._apply(actions)
        kv = await store.get(keys.registry_entry("node-j"))
        assert kv is not None and RegistryEntry.decode(kv.value).state == NodeState.FAILED
        assert len((await store.get_prefix(keys.events))[0]) == 1
        await store.close()

    asyncio.run(run())


def test_a_round_before_the_revoked_record_leaves_the_view_keeps_the_probes_evidence(
        etcd: EmbeddedEtcd) -> None:
    """The controller revokes the lease of a node its probes condemned and wakes its round at
    once; the node's record, deleted with the lease, leaves the view only when the watch brings
    the deletion. A round in between still sees the old record: it must not take it for the
    node back as a new incarnation and drop the evidence (then the node was marked failed half
    a keep-alive interval later as a lapsed lease, not on the probes' word: seen in
    test_partition.py). A record on another lease is a new incarnation: that drops it."""

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        rec, entry, rev = await _register(store, keys, "node-p")
        ctl._registry["node-p"] = (entry, rev)
        ctl._live["node-p"] = rec
        await ctl._probe_failed(rec, "it answered no probe for 0.61 s")
        assert await store.get(keys.node("node-p")) is None  # revoked: the record went with it
        # The deletion's event is still due: the view keeps the old record, and the evidence.
        assert ctl._view().evidence == {
            "node-p": "it answered no probe for 0.61 s; its lease was revoked"}
        del ctl._live["node-p"]  # the deletion arrives
        actions = plan(ctl._view(), time.time())  # at once: no settle time on evidence
        assert [(type(a), a.reason) for a in actions] == [  # type: ignore[attr-defined]
            (MarkFailed, "it answered no probe for 0.61 s; its lease was revoked")]
        # Back on a new lease (it fenced and joined again): the evidence is spent.
        ctl._live["node-p"] = dataclasses.replace(rec, incarnation="i2",
                                                  lease=await store.grant(30))
        assert ctl._view().evidence == {}
        await store.close()

    asyncio.run(run())


def test_a_downtime_report_is_counted_once_through_every_relist(etcd: EmbeddedEtcd) -> None:
    """The controller re-reads its whole view every 10 s (and after a compaction), rebuilding
    its job tables; a rank's downtime report, still in etcd, must not be counted again at each
    of those reads while the migration runs or has just ended."""

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        now = time.time()
        m = Migration(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(1,),
                      leavers=("node-b",), joiners=("node-s",), phase=MigrationPhase.SWITCHING,
                      reason="drain of node-b", created_at=now, deadline=now + 60,
                      updated_at=now)
        await store.put(keys.job_migration("j"), m.encode())
        await store.put(keys.kv("j/migration/e2-1/downtime/0"), b"0.125")
        try:
            for _ in range(3):
                await ctl._relist()
            drains = ctl.job_metrics.downtime["drain"]
            assert (sum(drains.counts), drains.total) == (1, 0.125)
            # A migration the job has moved on from is forgotten: the next one counts anew.
            m2 = dataclasses.replace(m, id="e3-2", from_epoch=2, to_epoch=3)
            await store.put(keys.job_migration("j"), m2.encode())
            await store.put(keys.kv("j/migration/e3-2/downtime/0"), b"0.25")
            for _ in range(2):
                await ctl._relist()
            assert (sum(drains.counts), drains.total) == (2, 0.375)
        finally:
            await store.close()

    asyncio.run(run())


def test_a_state_or_phase_its_lifecycle_forbids_is_refused_and_nothing_is_written(
        etcd: EmbeddedEtcd) -> None:
    """The controller writes a job state or a migration phase only where the record's lifecycle
    allows it (``JobState.can_become``, ``Migration.can_become``): an action that would revive
    an ended job or move a migration past its kind's path is a planner bug, and is logged and
    dropped, never written, while the allowed ones are."""

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        try:
            await store.put(keys.controller, b"ctl")
            won = await store.get(keys.controller)
            assert won is not None
            ctl._leader_key_revision = won.create_revision
            now = time.time()
            await store.put(keys.job_status("j"), JobStatus(
                job="j", state=JobState.DONE, reason="every rank finished",
                updated_at=now).encode())
            drain = Migration(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(1,),
                              leavers=("node-b",), joiners=("node-s",),
                              phase=MigrationPhase.PREPARING, reason="drain of node-b",
                              created_at=now, deadline=now + 60, updated_at=now)
            await store.put(keys.job_migration("j"), drain.encode())
            await ctl._relist()

            async def values() -> tuple[JobStatus, Migration]:
                status, mig = (await store.get(keys.job_status("j")),
                               await store.get(keys.job_migration("j")))
                assert status is not None and mig is not None
                return JobStatus.decode(status.value), Migration.decode(mig.value)

            # A done job written as running again; a drain committed from preparing (only
            # a recovery skips the switch).
            await ctl._apply([SetJobState("j", JobState.RUNNING, "resumed"),
                              AdvanceMigration("j", "e2-1", MigrationPhase.DONE, "took over")])
            status, mig = await values()
            assert status.state == JobState.DONE and status.reason == "every rank finished"
            assert mig.phase == MigrationPhase.PREPARING and "done" not in mig.timings
            assert (await store.get_prefix(keys.events))[0] == []
            assert ctl.metrics.errors.labels(kind="controller-refused")._value.get() == 2
            # The path the lifecycle allows is written.
            await ctl._apply([AdvanceMigration("j", "e2-1", MigrationPhase.READY, "prepared")])
            await ctl._relist()
            await ctl._apply([AdvanceMigration("j", "e2-1", MigrationPhase.DONE, "took over")])
            assert (await values())[1].phase == MigrationPhase.DONE
        finally:
            await store.close()

    asyncio.run(run())


def test_a_relist_decodes_only_the_records_that_changed_since_the_last(
        etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller re-reads its whole view every 10 s. Decoding every node's records was
    nearly all of that (0.34 s at 4,096 nodes, on its one event loop); a relist now decodes
    what changed since the last, and sees the same view."""
    decoded: list[str] = []
    for cls in (RegistryEntry, NodeRecord, JobSpec, Assignment, JobStatus, DrainRequest):
        real = cls.decode

        def counting(value: bytes, real: Any = real, kind: str = cls.KIND) -> Any:
            decoded.append(kind)
            return real(value)

        monkeypatch.setattr(cls, "decode", counting)

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        try:
            for n in ("node-a", "node-b", "node-c"):
                await _register(store, keys, n)
            now = time.time()
            a = await _running_job(store, keys, ("node-a", "node-b"), ("node-c",))
            await store.put(keys.drain("node-b"), DrainRequest(
                node="node-b", source="cli", reason="r", requested_at=now,
                deadline=now + 60).encode())
            await store.put(keys.registry_entry("node-x"), b"garbage")
            await ctl._relist()
            assert sorted(decoded) == sorted([RegistryEntry.KIND] * 4 + [NodeRecord.KIND] * 3 + [
                JobSpec.KIND, Assignment.KIND, JobStatus.KIND, DrainRequest.KIND])
            first = plan(ctl._view(), now)
            bad = ctl.metrics.bad_values.labels(collection="registry")._value.get()
            assert bad == 1

            decoded.clear()
            for _ in range(3):
                await ctl._relist()
            assert decoded == []
            view = ctl._view()
            assert sorted(view.registry) == ["node-a", "node-b", "node-c"]
            assert sorted(view.live) == ["node-a", "node-b", "node-c"]
            assert view.jobs["j"].assignment == a and "node-b" in view.drain_deadlines
            assert plan(view, now) == first
            assert ctl.metrics.bad_values.labels(collection="registry")._value.get() == bad

            # One entry changed, one node gone: only the change is decoded.
            entry = RegistryEntry(name="node-c", incarnation="i1", state=NodeState.DRAINING,
                                  updated_at=now)
            await store.put(keys.registry_entry("node-c"), entry.encode())
            await store.delete(keys.node("node-a"))
            await ctl._relist()
            assert decoded == [RegistryEntry.KIND]
            assert ctl._registry["node-c"][0] == entry and "node-a" not in ctl._live
        finally:
            await store.close()

    asyncio.run(run())


async def _until(what: str, ok: Any, timeout: float = 5.0) -> None:
    """Until ``ok()``, polled every 50 ms; fails naming ``what`` after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.05)):
        if ok():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s: {what}")


@contextlib.asynccontextmanager
async def _leading(ctl: Controller, store: EtcdStore, keys: Keys) -> AsyncIterator[None]:
    """``ctl``'s loop runs as the leader (its key put as if won) until the block ends, a round
    at least every 0.2 s (1 s in a daemon); ``store`` is closed then."""
    ctl.tick = 0.2
    lease = await store.grant(30)
    ctl.agent.lease = lease
    await store.put(keys.controller, b"ctl", lease)
    won = await store.get(keys.controller)
    assert won is not None
    task = asyncio.create_task(ctl._lead(lease, won.create_revision))
    try:
        yield
    finally:
        ctl.stop.set()
        await asyncio.wait_for(task, 10)
        await store.close()


def test_a_round_woken_by_a_change_plans_before_a_due_relist(etcd: EmbeddedEtcd) -> None:
    """The periodic re-list (a backstop; 0.15 s at 4,096 nodes) runs after a round, not between
    the change that woke it and its plan: a node record's deletion is acted on at once. A
    re-list after lost watch events still comes first (the view may be wrong without it)."""

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        calls: list[str] = []
        relist, apply = ctl._relist, ctl._apply

        async def logged_relist() -> int:
            calls.append("relist")
            return await relist()

        async def logged_apply(actions: list[Any]) -> None:
            calls.append("round")
            await apply(actions)

        ctl._relist, ctl._apply = logged_relist, logged_apply  # type: ignore[method-assign]
        ctl.relist_interval = 0.0  # a re-list is due at every round
        async with _leading(ctl, store, keys):
            await _until("two rounds", lambda: calls.count("round") >= 2)
            # The first re-list is the leader's own, before any round; each round then plans
            # before the re-list that came due.
            assert calls[:4] == ["relist", "round", "relist", "round"], calls
            ctl._need_relist = True  # as after a compaction the watches could not resume from
            ctl._changed.set()
            seen = len(calls)
            await _until("a round after the re-list asked for", lambda: "round" in calls[seen:])
            assert calls[seen:seen + 2] == ["relist", "round"], calls[seen:]

    asyncio.run(run())


class _RegistryReadLost(EtcdStore):
    """A real store whose ``lose``-th read of the registry fails, as when etcd goes away
    between a re-list's reads."""

    lose = 2
    prefix = ""

    async def get_prefix(self, prefix: str) -> tuple[list[Any], int]:
        if prefix == self.prefix:
            self.lose -= 1
            if self.lose == 0:
                raise StoreError("etcd range was cut off by a closed connection")
        return await super().get_prefix(prefix)


def test_a_relist_cut_off_is_done_again_before_the_next_round_plans(etcd: EmbeddedEtcd) -> None:
    """A re-list that fails between its reads leaves the view without nodes. The next round
    must read it again before it plans: planned on, every node looks gone, and a running job
    whose every replica is gone fails (test_outage.py saw this once the periodic re-list ran
    after the round)."""

    async def run() -> None:
        ctl, plain, keys = _controller(etcd)
        await plain.close()
        store = _RegistryReadLost(ctl.agent.cfg.etcd)
        store.prefix = keys.registry
        ctl.store = ctl.agent.store = ctl.events.store = store
        for n in ("node-a", "node-b"):
            await _register(store, keys, n)
        await _running_job(store, keys, ("node-a", "node-b"), ())
        ctl.relist_interval = 0.0  # the leader's re-list, a round, then the re-list that fails
        async with _leading(ctl, store, keys):
            # Until a round has planned after the one whose re-list was cut off, and the settle
            # time (0.25 s) of nodes gone from the view has passed.
            await _until("the re-list cut off and done again", lambda: store.lose <= -2, 10)
            assert store.lose <= -2, "the re-list was not cut off, or not done again"
            await asyncio.sleep(0.5)
            kv = await store.get(keys.job_status("j"))
            assert kv is not None and JobStatus.decode(kv.value).state == JobState.RUNNING
            assert await store.get(keys.job_migration("j")) is None
            for n in ("node-a", "node-b"):
                kv = await store.get(keys.registry_entry(n))
                assert kv is not None and RegistryEntry.decode(kv.value).state == NodeState.ACTIVE
            assert sorted(ctl._live) == ["node-a", "node-b"]

    asyncio.run(run())


class _HeldRead(EtcdStore):
    """A real store whose next read of a prefix, once :meth:`hold` names it, waits until the
    test lets it go: a re-list caught between its reads."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.prefix: str | None = None
        self.held, self.release = asyncio.Event(), asyncio.Event()

    def hold(self, prefix: str) -> None:
        self.prefix, self.held, self.release = prefix, asyncio.Event(), asyncio.Event()

    async def get_prefix(self, prefix: str) -> tuple[list[Any], int]:
        if prefix == self.prefix:
            self.prefix = None
            self.held.set()
            await self.release.wait()
        return await super().get_prefix(prefix)


def test_a_relist_shows_the_whole_view_until_its_reads_are_done_and_loses_no_event(
        etcd: EmbeddedEtcd) -> None:
    """A re-list reads its tables apart and puts them in place at once. Caught between its
    reads, the controller's view is still whole: the prober reads it then, and a node missing
    from it lost its probe peer and started its silence over (the re-list cleared the tables
    first). The watches' events during the reads reach the new tables too: a node record
    deleted and one written after the nodes were read are not undone by the swap."""

    async def run() -> None:
        ctl, plain, keys = _controller(etcd)
        await plain.close()
        store = _HeldRead(ctl.agent.cfg.etcd)
        ctl.store = ctl.agent.store = ctl.events.store = store
        for n in ("node-a", "node-b"):
            await _register(store, keys, n)
        ctl.relist_interval = 3600.0  # the test re-lists
        async with _leading(ctl, store, keys):
            await _until("the leader's own re-list", lambda: sorted(ctl._live) == [
                "node-a", "node-b"])
            # Held before the node records are read: the registry is read already.
            store.hold(keys.nodes)
            relist = asyncio.create_task(ctl._relist())
            await asyncio.wait_for(store.held.wait(), 5)
            assert sorted(ctl._live) == ["node-a", "node-b"]
            assert sorted(ctl._registry) == ["node-a", "node-b"]
            store.release.set()
            await asyncio.wait_for(relist, 5)
            assert sorted(ctl._live) == ["node-a", "node-b"]
            # Held after the node records are read; meanwhile one goes and one comes.
            store.hold(keys.jobs)
            relist = asyncio.create_task(ctl._relist())
            await asyncio.wait_for(store.held.wait(), 5)
            await store.delete(keys.node("node-b"))
            await _register(store, keys, "node-c")
            await _until("the watches' events", lambda: sorted(ctl._live) == [
                "node-a", "node-c"])
            store.release.set()
            await asyncio.wait_for(relist, 5)
            assert sorted(ctl._live) == ["node-a", "node-c"]
            assert sorted(ctl._registry) == ["node-a", "node-b", "node-c"]

    asyncio.run(run())


def test_a_controller_key_that_holds_no_controller_record_is_taken_over_though_its_lease_lives(
        etcd: EmbeddedEtcd) -> None:
    """A foreign or mistaken write over the controller key, under a lease its writer keeps
    alive, claims nothing: a campaigning daemon takes the key over at once and leads. Waited
    on (as before), no daemon led again for as long as that lease lived, and no job was
    recovered. A controller's own record, under its live lease, is a claim: left alone."""

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        led: list[tuple[int, int]] = []

        async def lead(lease: int, key_revision: int) -> None:
            led.append((lease, key_revision))

        ctl._lead = lead  # type: ignore[method-assign]
        try:
            ctl.agent.lease = await store.grant(30)
            ctl.agent.registered.set()
            foreign = await store.grant(60)
            await store.put(keys.controller, b'{"schema": "someone/v1", "leader": "x"}', foreign)
            await asyncio.wait_for(ctl._campaign_once(), 5)
            kv = await store.get(keys.controller)
            assert kv is not None and kv.lease == ctl.agent.lease
            assert ControllerRecord.decode(kv.value).node == "ctl"
            assert led == [(ctl.agent.lease, kv.create_revision)]
            assert ctl.metrics.registry.get_sample_value(
                "understudy_bad_values_total", {"collection": "controller"}) == 1.0

            other = ControllerRecord(node="node-o", incarnation="i1", since=time.time())
            await store.put(keys.controller, other.encode(), foreign)
            campaign = asyncio.create_task(ctl._campaign_once())
            await asyncio.sleep(0.5)
            kv = await store.get(keys.controller)
            assert kv is not None and kv.lease == foreign and kv.value == other.encode()
            assert len(led) == 1 and not campaign.done()
            ctl.stop.set()
            await asyncio.wait_for(campaign, 5)
        finally:
            await store.close()

    asyncio.run(run())


def test_the_controller_keeps_the_newest_thousand_events_from_the_keys_it_lists(
        etcd: EmbeddedEtcd) -> None:
    """A re-list lists the events' keys (their values are never read: an event may be large)
    and the rounds delete the oldest past the newest 1,000."""

    async def run() -> None:
        ctl, store, keys = _controller(etcd)
        names = [f"{i:06d}" for i in range(1003)]
        for i in range(0, len(names), 100):
            await store.txn(compare=[], success=[("put", keys.event(n), b"x" * 64, None)
                                                 for n in names[i:i + 100]])
        ctl.relist_interval = 3600.0
        async with _leading(ctl, store, keys):
            # The controller's own "controller-elected" is the newest: the oldest four go.
            await _until("the oldest events deleted", lambda: len(ctl._event_keys) == 1000,
                         timeout=10)
            left = await store.keys(keys.events)
            assert len(left) == 1000 and left == ctl._event_keys
            assert left[:999] == [keys.event(n) for n in names[4:]]

    asyncio.run(run())


def test_a_registration_whose_answer_was_lost_goes_on_from_the_record_it_wrote(
        etcd: EmbeddedEtcd) -> None:
    """A daemon registers (grant, then one transaction for its record and registry entry);
    etcd applies the transaction but the answer is lost. The next attempt must find its own
    record and go on from it: not start over as a new incarnation, which found the name held
    by that record and waited out its lease while its probe port answered with an incarnation
    no record had; the controller took that for silence, revoked the lease and recovered the
    node's ranks elsewhere (the outage test, on a loaded machine)."""

    async def run() -> None:
        cfg = config.load(overrides={"node": "node-j", "etcd.endpoints": etcd.endpoint},
                          environ={})
        store, metrics = _TxnAnswerLost(cfg.etcd), Metrics()
        keys = Keys(cfg.etcd.prefix)
        agent = NodeAgent(cfg, store, metrics, EventLog(store, keys, "node-j", metrics),
                          _NoWorkers(), asyncio.Event())
        await asyncio.wait_for(agent.register(), 10)
        assert store.lost == 0, "the transaction's answer was lost once"
        kv = await store.get(keys.node("node-j"))
        assert kv is not None and agent.lease == kv.lease
        assert NodeRecord.decode(kv.value).incarnation == agent.incarnation
        assert agent.registered.is_set() and agent.state == NodeState.ACTIVE
        joined = [e for e in (await store.get_prefix(keys.events))[0] if b"node-joined" in e.value]
        assert len(joined) == 1
        # One lease in all: the first attempt's (a second grant would have had to wait out
        # the first, which nobody refreshed, for the whole TTL).
        assert store.granted == [agent.lease], store.granted
        await store.close()

    asyncio.run(run())


class _NextPutLost(EtcdStore):
    """A real store whose next put, once armed, fails as a timed-out request would."""

    armed = False

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        if self.armed:
            self.armed = False
            raise StoreError("etcd put failed: timed out")
        return await super().put(key, value, lease)


def test_a_state_whose_write_failed_is_written_again_at_once(etcd: EmbeddedEtcd) -> None:
    """A node's new state that etcd did not take (its write timed out, as after an etcd
    restart) is written again by the own-keys reconcile at once, not at its 30 s backstop: a
    drain's "drained" once waited that long, past the operator's --wait deadline."""

    async def run() -> None:
        cfg = config.load(overrides={"node": "node-d", "etcd.endpoints": etcd.endpoint},
                          environ={})
        store, metrics, stop = _NextPutLost(cfg.etcd), Metrics(), asyncio.Event()
        keys = Keys(cfg.etcd.prefix)
        agent = NodeAgent(cfg, store, metrics, EventLog(store, keys, "node-d", metrics),
                          _NoWorkers(), stop)
        await asyncio.wait_for(agent.register(), 10)
        own = asyncio.create_task(agent.watch_own_keys())
        try:
            store.armed = True
            await agent.set_state(NodeState.STANDBY, "stands by for a test's job")
            assert not store.armed, "the state's write failed"
            deadline = time.monotonic() + 5
            while True:
                kv = await store.get(keys.registry_entry("node-d"))
                if kv is not None and RegistryEntry.decode(kv.value).state == \
                        NodeState.STANDBY:
                    break
                assert time.monotonic() < deadline, "the state never reached etcd"
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            own.cancel()
            await asyncio.gather(own, return_exceptions=True)
            await store.close()

    asyncio.run(run())
