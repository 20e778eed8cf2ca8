"""Self-fencing under a real network partition (namespace + nftables drop, no TCP reset)."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import netns
from understudy.daemon.embedded_etcd import EmbeddedEtcd
from understudy.daemon.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.root]


@pytest.fixture
def host() -> Iterator[netns.TestHost]:
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    h = netns.TestHost.create(index=7)
    try:
        yield h
    finally:
        h.destroy()


def _log_times(text: str, message: str) -> list[float]:
    """Wall-clock times of JSON log lines whose event contains ``message``."""
    import datetime

    out = []
    for line in text.splitlines():
        with_json = line[line.find("{"):] if "{" in line else ""
        try:
            rec = json.loads(with_json)
        except ValueError:
            continue
        if message in rec.get("event", ""):
            ts = re.sub(r"Z$", "+00:00", rec["timestamp"])
            out.append(datetime.datetime.fromisoformat(ts).timestamp())
    return out


def test_partitioned_node_fences_before_it_is_replaced_and_rejoins_clean(
        host: netns.TestHost, tmp_path: Path) -> None:
    etcd = EmbeddedEtcd(data_dir=tmp_path / "etcd", host=host.host_ip)
    etcd.start()
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        c.add("node-p", "active", wrap=host.wrap())
        c.add("node-b", "active")
        c.add("node-s", "standby")
        for n, s in (("node-p", "active"), ("node-b", "active"), ("node-s", "standby")):
            c.wait_state(n, s)
        c.wait_for("a controller", lambda s: s.controller is not None)
        if c.status().controller == "node-p":
            # Make a root-namespace daemon the controller so failure detection stays visible.
            c.daemons["node-p"].signal(15)
            c.daemons["node-p"].wait(30)
            c.cli("undrain", "node-p")
            c.add("node-p", "active", wrap=host.wrap())
            c.wait_state("node-p", "active")
        # A rank on each active node; the one on node-p must die before node-p is replaced.
        probe = str(Path(__file__).parents[1] / "workers" / "probe.py")
        out = c.cli("run", "--job", "pj", "--tp", "1", "--dp", "2", "--env", "PROBE_SLEEP=120",
                    "--", sys.executable, probe)
        assert out.returncode == 0, out.stderr
        assert "rank 1 on node-p" in out.stdout, out.stdout
        pid = _wait_kv(etcd, f"{c.prefix}/kv/pj/probe/pid1")
        t_cut = time.time()
        host.partition()
        t_worker_gone = None
        while time.time() - t_cut < c.lease_ttl + 5:
            if t_worker_gone is None and not _alive(pid):
                t_worker_gone = time.time()
            st = c.status()
            if st.node("node-p").state == "failed":  # type: ignore[union-attr]
                break
            time.sleep(0.02)
        t_failed = time.time()
        assert t_worker_gone is not None, "the partitioned node's worker was not killed"
        p_log = c.daemons["node-p"].log_text()
        fenced = [t for t in _log_times(p_log, "fenced itself") if t >= t_cut]
        assert fenced, "the partitioned daemon never fenced itself"
        events = [json.loads(line) for line in c.cli("events", "--json").stdout.splitlines()]
        failed_at = [e["time"] for e in events if e["kind"] == "node-failed"
                     and e["node"] == "node-p"]
        assert failed_at, events
        # The node stopped its workers before the controller could declare it failed.
        assert fenced[0] < failed_at[0] <= t_failed
        assert t_worker_gone < failed_at[0], "the worker outlived the node's lease"
        assert c.daemons["node-p"].alive(), "fencing must not kill the daemon itself"
        old_incarnation = _incarnation(c, "node-p")
        host.heal()
        c.wait_state("node-p", "active", timeout=20)
        assert _incarnation(c, "node-p") != old_incarnation, "rejoined as a new incarnation"
        kinds = [json.loads(line)["kind"] for line in c.cli("events", "--json").stdout
                 .splitlines()]
        assert "node-fenced" in kinds
    finally:
        c.stop_all(timeout=5)
        etcd.cleanup()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_kv(etcd: EmbeddedEtcd, key: str, timeout: float = 20.0) -> int:
    import asyncio

    from understudy.daemon import config
    from understudy.daemon.store import EtcdStore

    async def read() -> int:
        s = EtcdStore(config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                                  require_node=False).etcd)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                kv = await s.get(key)
                if kv is not None:
                    return int(kv.value)
                await asyncio.sleep(0.05)
            raise AssertionError(f"{key} never appeared")
        finally:
            await s.close()

    return asyncio.run(read())


def _incarnation(c: LocalCluster, node: str) -> str:
    import asyncio

    from understudy.daemon import config
    from understudy.daemon.store import EtcdStore

    async def read() -> bytes:
        s = EtcdStore(config.load(overrides={"etcd.endpoints": c.etcd_endpoint}, environ={},
                                  require_node=False).etcd)
        kv = await s.get(f"{c.prefix}/registry/{node}")
        await s.close()
        assert kv is not None
        return kv.value

    inc: str = json.loads(asyncio.run(read()))["incarnation"]
    return inc
