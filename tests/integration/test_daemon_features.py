"""One real daemon at a time: reclaim notices and health become drains, systemd readiness,
and the workers' key-value service on the local socket, all against a real etcd."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from tests.cloud_metadata import AwsHandler, AwsState, serve
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.testing.localcluster import LocalCluster

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "understudyd.toml"
    path.write_text(body)
    return ["--config", str(path)]


def test_aws_spot_notice_drains_the_node(cluster: LocalCluster, tmp_path: Path) -> None:
    state = AwsState()
    with serve(AwsHandler, state) as url:
        extra = _config(tmp_path, f'[notices]\naws = true\naws_url = "{url}"\n'
                                  "interval = 0.2\ntimeout = 1.0\n")
        cluster.add("node-a", "active", extra=extra)
        cluster.wait_state("node-a", "active")
        time.sleep(0.5)
        assert cluster.status().node("node-a").state == "active"  # type: ignore[union-attr]
        state.spot = b'{"action": "terminate", "time": "2099-01-01T00:00:00Z"}'
        cluster.wait_state("node-a", "drained", timeout=10)
    node = cluster.status().node("node-a")
    assert node is not None and node.drain is not None
    assert node.drain.source == "aws-spot" and "terminate" in node.drain.reason


def test_unhealthy_host_drains_the_node_with_the_reason(cluster: LocalCluster,
                                                       tmp_path: Path) -> None:
    extra = _config(tmp_path, "[health]\ninterval = 0.2\nfailures_before_drain = 2\n"
                              "min_disk_free_gib = 1e12\nnvml = true\n")
    cluster.add("node-a", "active", extra=extra)
    cluster.wait_state("node-a", "drained", timeout=15)
    node = cluster.status().node("node-a")
    assert node is not None and node.drain is not None and node.drain.source == "health"
    assert "disk" in node.drain.reason


def test_systemd_readiness_and_watchdog(cluster: LocalCluster, tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    got: list[bytes] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(0.2)
        stop = threading.Event()

        def receive() -> None:
            while not stop.is_set():
                try:
                    got.append(sock.recv(4096))
                except TimeoutError:
                    continue

        t = threading.Thread(target=receive)
        t.start()
        try:
            cluster.add("node-a", "active",
                        env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
            cluster.wait_state("node-a", "active")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and sum(b"WATCHDOG=1" in m for m in got) < 2:
                time.sleep(0.05)
        finally:
            stop.set()
            t.join(5)
    assert any(m.startswith(b"READY=1") for m in got), got
    assert sum(b"WATCHDOG=1" in m for m in got) >= 2, got


def test_workers_key_value_service_goes_through_etcd(cluster: LocalCluster) -> None:
    d = cluster.add("node-a", "active")
    cluster.wait_state("node-a", "active")
    sock = str(d.run_dir / "understudyd.sock")
    with DaemonClient("job1/tp0/v1", epoch=3, path=sock, timeout=5) as a, \
            DaemonClient("job1/tp0/v1", epoch=3, path=sock, timeout=5) as b:
        a.ping()
        # get waits for a value another process sets later
        result: list[bytes] = []
        waiter = threading.Thread(target=lambda: result.append(b.get("addr", timeout=5)))
        waiter.start()
        time.sleep(0.2)
        a.set("addr", b"10.0.0.1:29500")
        waiter.join(6)
        assert result == [b"10.0.0.1:29500"]
        assert a.add("counter", 2) == 2 and b.add("counter", 3) == 5
        assert a.compare_set("leader", b"", b"rank0") == b"rank0"
        assert b.compare_set("leader", b"", b"rank1") == b"rank0"
        assert a.check(["addr", "counter"]) and not a.check(["missing"])
        assert a.num_keys() == 3
        assert a.delete("addr") and not a.check(["addr"])
        with pytest.raises(DaemonError, match="did not appear"):
            a.get("never", timeout=0.3)
        with pytest.raises(DaemonError, match="integer"):
            a.add("leader", 1)
    # Namespaces are separate, and bad hellos are refused with a sentence.
    with DaemonClient("job1/tp0/v2", path=sock, timeout=5) as c:
        assert c.num_keys() == 0
    with pytest.raises(DaemonError, match="namespace"):
        DaemonClient("../escape", path=sock, timeout=5)
    assert d.alive()
