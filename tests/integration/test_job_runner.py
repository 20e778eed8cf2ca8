"""The job runner's view of ``jobs/`` against a real etcd: listed once, then kept by the watch,
so that a change there costs each daemon a watch message and not a read of every job's records;
listed again when etcd compacted the revisions its watch had to resume from."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_controller_races import _NoWorkers
from understudy.common import config
from understudy.common.keys import Keys
from understudy.common.records import Assignment, JobSpec, JobState, JobStatus
from understudy.common.store import KV, EtcdStore, WatchEvent
from understudy.daemon import jobs as jobs_mod
from understudy.daemon.events import EventLog
from understudy.daemon.jobs import JobRunner, _Listing
from understudy.daemon.metrics import Metrics
from understudy.daemon.node import NodeAgent
from understudy.daemon.supervisor import ChildExit, Supervisor
from understudy.testing.embedded_etcd import EmbeddedEtcd


class _Gated(EtcdStore):
    """A real store whose new connections wait while ``gate`` is clear: a test drops its
    connection, changes etcd meanwhile, and then lets it reconnect."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.gate.set()

    async def _get_client(self) -> Any:
        if self._client is None:
            await self.gate.wait()
        return await super()._get_client()


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(0.02)


@dataclasses.dataclass
class _Running:
    runner: JobRunner
    store: EtcdStore
    writer: EtcdStore
    keys: Keys
    #: the runner's etcd requests by kind (``range``: a read of a prefix)
    ops: collections.Counter[str]


@contextlib.asynccontextmanager
async def _running(etcd: EmbeddedEtcd, tmp_path: Path,
                   store_class: type[EtcdStore] = EtcdStore) -> AsyncIterator[_Running]:
    """A job runner of node "node-a" on ``etcd`` (its node not registered: it decides
    nothing, but keeps its view), and a second store to write with."""
    cfg = config.load(overrides={"node": "node-a", "etcd.endpoints": etcd.endpoint},
                      environ={})
    keys = Keys(cfg.etcd.prefix)
    ops: collections.Counter[str] = collections.Counter()
    store = store_class(cfg.etcd, on_request=lambda op: ops.update([op]))
    metrics, stop = Metrics(), asyncio.Event()
    agent = NodeAgent(cfg, store, metrics, EventLog(store, keys, "node-a", metrics),
                      _NoWorkers(), stop)

    async def on_exit(child: ChildExit) -> None:
        pass

    runner = JobRunner(agent, store, Supervisor(tmp_path / "run", on_exit), stop)
    task = asyncio.create_task(runner.run())
    writer = EtcdStore(cfg.etcd)
    try:
        yield _Running(runner, store, writer, keys, ops)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await writer.close()
        await store.close()


def _records(keys: Keys, epoch: int) -> list[Any]:
    """Job "j" running at ``epoch`` on two other nodes: the puts of its records."""
    now = time.time()
    spec = JobSpec(name="j", argv=("true",), cwd="/", tp=1, dp=2, standby=0, created_at=now)
    status = JobStatus(job="j", state=JobState.RUNNING, reason="", updated_at=now)
    assignment = Assignment(job="j", epoch=epoch, ranks=("node-b", "node-c"), standbys=(),
                            reason="", updated_at=now)
    return [("put", keys.job_spec("j"), spec.encode(), None),
            ("put", keys.job_status("j"), status.encode(), None),
            ("put", keys.job_assignment("j"), assignment.encode(), None)]


def test_the_job_runner_follows_jobs_through_its_watch_and_lists_again_after_compaction(
        etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    async def run() -> None:
        async with _running(etcd, tmp_path, _Gated) as r:
            runner, writer, keys, ops = r.runner, r.writer, r.keys, r.ops
            assert isinstance(r.store, _Gated)
            assert await writer.txn(compare=[], success=_records(keys, 1))
            await _until(lambda: _epoch(runner) == 1, "the job at epoch 1")
            ranges = ops["range"]
            # Twenty changes, each seen: not one read of the prefix for any of them (each used
            # to cost one per daemon).
            for e in range(2, 22):
                assert await writer.txn(compare=[], success=_records(keys, e)[2:])
                await _until(lambda e=e: _epoch(runner) == e,  # type: ignore[misc]
                             f"the job at epoch {e}")
            assert ops["range"] - ranges <= 1, (ops, "at most the backstop's one listing")

            # The runner's connection drops; meanwhile the job moves on and etcd compacts the
            # revisions its watch would resume from. It lists the prefix again, and is current.
            r.store.gate.clear()
            await r.store.reset()
            await asyncio.wait(r.store._closing, timeout=5)  # the old connection is closed
            for e in (29, 30):  # two: the compaction keeps its own revision's history
                assert await writer.txn(compare=[], success=_records(keys, e)[2:])
            client = await writer._get_client()
            _, now = await writer.get_prefix(keys.jobs)
            await client.compact(now)
            ranges = ops["range"]
            r.store.gate.set()
            await _until(lambda: _epoch(runner) == 30, "the job at epoch 30 after the compaction")
            assert ops["range"] > ranges, ("listed again", ops)
            # ... and follows the watch again from there.
            assert await writer.txn(compare=[], success=_records(keys, 31)[2:])
            await _until(lambda: _epoch(runner) == 31, "the job at epoch 31")
            # A job's records deleted: it is gone from the view.
            await writer.delete_prefix(keys.job("j"))
            await _until(lambda: runner.job_info("j") is None, "the job gone")

    asyncio.run(run())


def test_the_listing_is_read_again_on_its_backstop_period_and_misses_nothing_between(
        etcd: EmbeddedEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``JOBS_RELIST_S`` the watch ends and the prefix is listed again, the watch then
    starting afresh from the listing: changes made all along are each seen."""
    monkeypatch.setattr(jobs_mod, "JOBS_RELIST_S", 0.2)

    async def run() -> None:
        async with _running(etcd, tmp_path) as r:
            assert await r.writer.txn(compare=[], success=_records(r.keys, 1))
            t0 = time.monotonic()
            e = 1
            while time.monotonic() - t0 < 1.5:
                e += 1
                assert await r.writer.txn(compare=[], success=_records(r.keys, e)[2:])
                await _until(lambda e=e: _epoch(r.runner) == e,  # type: ignore[misc]
                             f"the job at epoch {e}")
                await asyncio.sleep(0.03)
            assert r.ops["range"] >= 5 and r.ops["watch"] >= 5, r.ops

    asyncio.run(run())


def test_a_view_decodes_only_the_records_that_changed_since_the_last(
        etcd: EmbeddedEtcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reconcile makes its view from the listing; a record is decoded once per revision
    (at rest, a reconcile every 5 s decoded every record of every job), and a bad value is
    still ignored in every view."""
    decoded: list[str] = []
    real = jobs_mod.decode_job_record

    def counting(path: str, value: bytes) -> Any:
        decoded.append(path)
        return real(path, value)

    monkeypatch.setattr(jobs_mod, "decode_job_record", counting)

    async def run() -> None:
        async with _running(etcd, tmp_path) as r:
            bad = r.keys.job_status("k")
            assert await r.writer.txn(compare=[], success=[
                *_records(r.keys, 1), ("put", r.keys.job_spec("k"), b"{not a spec", None),
                ("put", bad, b"garbage", None)])
            await _until(lambda: _epoch(r.runner) == 1, "the job at epoch 1")
            decoded.clear()
            for _ in range(3):  # at rest
                r.runner.poke()
                await asyncio.sleep(0.05)
            assert r.runner._listed_jobs().keys() == {"j"}
            assert decoded == [], decoded
            assert await r.writer.txn(compare=[], success=_records(r.keys, 2)[2:])
            await _until(lambda: _epoch(r.runner) == 2, "the job at epoch 2")
            assert decoded and set(decoded) == {"j/assignment"}, decoded
            assert r.runner._listed_jobs().keys() == {"j"}
        assert r.runner.agent.metrics.bad_values.labels(collection="jobs")._value.get() == 2

    asyncio.run(run())


def _epoch(runner: JobRunner) -> int | None:
    info = runner.job_info("j")
    return info["assignment"]["epoch"] if info and info["assignment"] else None


def _kv(key: str, rev: int, value: bytes = b"v") -> KV:
    return KV(key=key, value=value, mod_revision=rev, create_revision=rev, lease=0)


def test_the_listing_takes_each_event_once_and_never_an_older_listing() -> None:
    p = "/u/jobs/"
    listing = _Listing(p)
    assert listing.revision == 0
    listing.listed([_kv(f"{p}a/spec", 3), _kv(f"{p}a/exits/1/0", 4), _kv(f"{p}a/assignment", 5)],
                   6)
    # A rank's exit is not a record the runner decides from: not kept.
    assert set(listing.kvs) == {f"{p}a/spec", f"{p}a/assignment"} and listing.revision == 6
    # Events the listing had already (a watch started before it, or resumed below it): skipped.
    assert not listing.apply(WatchEvent("put", _kv(f"{p}a/assignment", 5, b"old")))
    assert listing.kvs[f"{p}a/assignment"].value == b"v"
    # A transaction's events share a revision: each is taken.
    assert listing.apply(WatchEvent("put", _kv(f"{p}a/assignment", 7, b"e2")))
    assert listing.apply(WatchEvent("put", _kv(f"{p}a/migration", 7, b"m")))
    assert listing.apply(WatchEvent("delete", _kv(f"{p}a/spec", 8, b"")))
    assert not listing.apply(WatchEvent("put", _kv(f"{p}a/exits/2/1", 9)))
    assert listing.apply(WatchEvent("put", _kv(f"{p}b/stop/x", 10))) is False  # not a record
    assert set(listing.kvs) == {f"{p}a/assignment", f"{p}a/migration"}
    assert listing.revision == 10
    # A listing replaces the copy whole, and the events up to it are then skipped...
    listing.listed([_kv(f"{p}c/spec", 11)], 12)
    assert set(listing.kvs) == {f"{p}c/spec"} and listing.revision == 12
    assert not listing.apply(WatchEvent("put", _kv(f"{p}a/assignment", 12)))
    assert listing.apply(WatchEvent("put", _kv(f"{p}a/assignment", 13)))
    # ... even one at a lower revision (etcd restored from a backup): it is what etcd holds.
    listing.listed([_kv(f"{p}d/spec", 2)], 4)
    assert set(listing.kvs) == {f"{p}d/spec"} and listing.revision == 4
    assert listing.apply(WatchEvent("put", _kv(f"{p}d/assignment", 5)))
