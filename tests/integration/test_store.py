"""The etcd store contract, against a real etcd server."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from understudy.common import config
from understudy.common.errors import StoreError
from understudy.common.store import RESYNC, EtcdStore, WatchEvent
from understudy.testing.embedded_etcd import EmbeddedEtcd, free_port


def _store(endpoints: str, **etcd: object) -> EtcdStore:
    cfg = config.load(overrides={"etcd.endpoints": endpoints, **{f"etcd.{k}": v for k, v in
                                                                  etcd.items()}},
                      environ={}, require_node=False)
    return EtcdStore(cfg.etcd)


def test_cas_create_update_and_lost_race(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        assert await s.cas("/t/a", b"1", 0)
        assert not await s.cas("/t/a", b"2", 0), "create-if-absent must lose on an existing key"
        kv = await s.get("/t/a")
        assert kv is not None and kv.value == b"1"
        assert await s.cas("/t/a", b"2", kv.mod_revision)
        assert not await s.cas("/t/a", b"3", kv.mod_revision), "stale revision must lose"
        got = await s.get("/t/a")
        assert got is not None and got.value == b"2"
        assert not await s.delete("/t/a", kv.mod_revision)
        assert await s.delete("/t/a", got.mod_revision)
        assert await s.get("/t/a") is None
        await s.close()

    asyncio.run(run())


def test_lease_binds_keys_and_expired_keepalive_returns_zero(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        lease = await s.grant(1)
        await s.put("/t/alive", b"x", lease=lease)
        assert await s.keepalive(lease) >= 1
        await s.revoke(lease)
        assert await s.get("/t/alive") is None
        assert await s.keepalive(lease) == 0
        await s.close()

    asyncio.run(run())


def test_watch_resumes_after_etcd_restart(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        w = _store(etcd.endpoint)
        _, rev = await s.get_prefix("/t/")
        stop = asyncio.Event()
        seen: list[str] = []

        async def consume() -> None:
            async for ev in w.watch_prefix("/t/", rev + 1, stop, retry_delay=0.05):
                assert isinstance(ev, WatchEvent)
                seen.append(ev.kv.key)
                if len(seen) == 3:
                    stop.set()

        task = asyncio.create_task(consume())
        await s.put("/t/1", b"a")
        while not seen:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(etcd.stop)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(etcd.start)
        for _ in range(50):
            try:
                await s.put("/t/2", b"b")
                break
            except StoreError:
                await asyncio.sleep(0.1)
        await s.put("/t/3", b"c")
        await asyncio.wait_for(task, 15)
        assert seen == ["/t/1", "/t/2", "/t/3"], "no event lost or repeated across the restart"
        await s.close()
        await w.close()

    asyncio.run(run())


def test_watch_reports_resync_after_compaction(etcd: EmbeddedEtcd) -> None:
    async def run() -> None:
        s = _store(etcd.endpoint)
        _, rev = await s.get_prefix("/t/")
        for i in range(5):
            await s.put(f"/t/{i}", b"x")
        client = await s._get_client()
        _, now = await s.get_prefix("/t/")
        await client.compact(now)
        stop = asyncio.Event()
        async for ev in s.watch_prefix("/t/", rev + 1, stop):
            assert ev is RESYNC
            stop.set()
        await s.close()

    asyncio.run(run())


def test_unreachable_etcd_is_a_store_error_within_the_timeout() -> None:
    async def run() -> None:
        s = _store("127.0.0.1:1", timeout=0.3)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(StoreError):
            await s.get("/t/x")
        assert loop.time() - t0 < 2.0
        await s.close()

    asyncio.run(run())


def test_embedded_etcd_picks_new_ports_when_one_is_taken_before_it_binds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The port picked for the peer listener is taken by another process before etcd binds it
    # (a real socket holds it): etcd exits with "address already in use", and the start is
    # tried again on fresh picks.
    from understudy.testing import embedded_etcd

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([embedded_etcd.free_port(), taken.getsockname()[1]])
        real = embedded_etcd.free_port
        monkeypatch.setattr(embedded_etcd, "free_port",
                            lambda host="127.0.0.1": next(picks, None) or real(host))
        e = EmbeddedEtcd(data_dir=tmp_path / "etcd").start()
        try:
            assert e.healthy() and e.peer_port != taken.getsockname()[1]
            assert "address already in use" in (tmp_path / "etcd" / "etcd.log").read_text()
        finally:
            e.cleanup()


def test_a_refused_endpoint_is_skipped_within_the_same_call(etcd: EmbeddedEtcd) -> None:
    # The first endpoint listed is down (nothing listens): a fresh store, as every CLI run
    # makes, still answers at once from the next one instead of failing its first request.
    # A port of free_port's pool: no other process is given it meanwhile (a port the kernel
    # picked and let go could be bound again by a daemon of a parallel test).
    dead = f"127.0.0.1:{free_port()}"

    async def run() -> None:
        st = _store(f"{dead},{etcd.endpoint}")
        try:
            await st.put("/t/k", b"v")
            kv = await st.get("/t/k")
            assert kv is not None and kv.value == b"v"
        finally:
            await st.close()
        lone = _store(dead)
        try:
            with pytest.raises(StoreError, match=f"failed at {dead}"):
                await lone.get("/t/k")
        finally:
            await lone.close()

    asyncio.run(run())
