"""The node's trust boundary with real daemons: who may use a daemon's workers' socket, and
failpoints that only a daemon's configuration arms.

The daemons here run as production runs them (``LocalCluster(failpoints=False,
socket_group="")``) unless a test says otherwise; the harness's usual settings
(``testing/localcluster.py``) would admit this test process through its group and honour every
failpoint. The state transfer's restricted loader is tested in ``tests/unit/test_transfer.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.scenarios import assert_no_tracebacks, wait_log
from understudy.common import config, env
from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.common.store import EtcdStore
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import DaemonProcess, LocalCluster

pytestmark = pytest.mark.slow
PROBE = str(Path(__file__).parents[1] / "workers" / "probe.py")
#: a group id no account here uses, for the tests of ``socket_group``
GROUP = 48213
REFUSED = "Refused a connection to the workers' socket."


@pytest.fixture
def production(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster",
                     failpoints=False, socket_group="")
    try:
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)
        assert_no_tracebacks(c)


def _socket(d: DaemonProcess) -> str:
    return str(d.run_dir / "understudyd.sock")


def _kv(etcd: EmbeddedEtcd, key: str) -> bytes | None:
    async def read() -> bytes | None:
        s = EtcdStore(config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                                  require_node=False).etcd)
        try:
            kv = await s.get(key)
        finally:
            await s.close()
        return None if kv is None else kv.value

    return asyncio.run(read())


def _connect(path: str, **popen: object) -> dict[str, object]:
    """Connect from a new process of this test (not a descendant of the daemon), with the
    credentials ``popen`` gives it (``group=``, ``extra_groups=``); its pid and what it got."""
    code = ("import json, os, sys\n"
            "from understudy.common.daemon_client import DaemonClient, DaemonError\n"
            "try:\n"
            "    with DaemonClient('j/probe', path=sys.argv[1], timeout=5) as c:\n"
            "        c.set('from-outside', b'1')\n"
            "    out = 'admitted'\n"
            "except DaemonError as exc:\n"
            "    out = str(exc)\n"
            "print(json.dumps({'pid': os.getpid(), 'result': out}))\n")
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          timeout=60, **popen)  # type: ignore[call-overload]
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_only_the_daemons_own_workers_use_its_socket(production: LocalCluster,
                                                      etcd: EmbeddedEtcd) -> None:
    d = production.add("node-a", "active")
    production.wait_state("node-a", "active")
    production.wait_for("a controller", lambda s: s.controller is not None)
    # A worker the daemon started reaches the job's store through the socket.
    # It acts for its own job only (review H3): another job's namespace is refused.
    out = production.cli("run", "--job", "j", "--tp", "1", "--dp", "1",
                         "--env=PROBE_FOREIGN=other/probe", "--", sys.executable, PROBE)
    assert out.returncode == 0, out.stderr
    production.wait_for("j done", lambda s: s.job("j") is not None
                        and s.job("j").state == "done", timeout=60)  # type: ignore[union-attr]
    assert _kv(etcd, f"{production.prefix}/kv/j/probe/rank0") == b"1,1,1,0,0,node-a"
    assert _kv(etcd, f"{production.prefix}/kv/j/probe/foreign0") == \
        b"a worker of job 'j' may not use namespace 'other/probe'"
    assert _kv(etcd, f"{production.prefix}/kv/other/probe/from-another-job") is None
    assert "Refused a worker's request for another job's namespace." in d.log_text()
    # This test process runs as root, as the daemon does, and is refused all the same: twice,
    # with one warning in the daemon's log.
    for _ in range(2):
        with pytest.raises(DaemonError) as info:
            DaemonClient("j/probe", epoch=1, path=_socket(d), timeout=5)
        assert str(info.value) == (
            f"process {os.getpid()} (uid {os.geteuid()}, gid {os.getegid()}) is not a worker of "
            f"this daemon (pid {d.pid}); besides its workers it admits no other process "
            f"(socket_group is not set)")
    other = _connect(_socket(d))
    assert "is not a worker of this daemon" in str(other["result"])
    assert _kv(etcd, f"{production.prefix}/kv/j/probe/from-outside") is None
    refusals = [json.loads(line) for line in d.log_text().splitlines() if REFUSED in line]
    assert sorted(r["pid"] for r in refusals) == sorted([os.getpid(), other["pid"]])
    assert d.alive()


@pytest.mark.root
def test_members_of_the_socket_group_are_admitted_and_no_one_else(etcd: EmbeddedEtcd,
                                                                   tmp_path: Path) -> None:
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster",
                     failpoints=False, socket_group=str(GROUP))
    try:
        d = c.add("node-a", "active")
        c.wait_state("node-a", "active")
        assert os.stat(_socket(d)).st_gid == GROUP
        with pytest.raises(DaemonError, match=f"admits members of group {GROUP}"):
            DaemonClient("j/probe", path=_socket(d), timeout=5)  # root, but not in the group
        assert _connect(_socket(d), group=GROUP)["result"] == "admitted"
        assert _connect(_socket(d), extra_groups=[GROUP])["result"] == "admitted"
        assert "not a worker" in str(_connect(_socket(d), group=GROUP + 1)["result"])
    finally:
        c.stop_all(timeout=5, drain=False)
        assert_no_tracebacks(c)


def test_a_stray_failpoint_variable_does_nothing_but_warn(production: LocalCluster) -> None:
    """A daemon whose configuration leaves failpoints off (the default) ignores
    UNDERSTUDY_FAILPOINTS in its environment: one warning, and its controller's rounds run."""
    d = production.add("node-a", "active",
                       env={env.FAILPOINTS: "controller.round=exit(3);controller.round2=raise"})
    production.wait_state("node-a", "active")
    production.wait_for("node-a to be the controller", lambda s: s.controller == "node-a")
    out = production.cli("run", "--job", "j", "--tp", "1", "--dp", "1", "--",
                         sys.executable, PROBE)
    assert out.returncode == 0, out.stderr
    production.wait_for("j done", lambda s: s.job("j") is not None
                        and s.job("j").state == "done", timeout=60)  # type: ignore[union-attr]
    time.sleep(0.5)  # more controller rounds
    log = d.log_text()
    warnings = [line for line in log.splitlines() if "UNDERSTUDY_FAILPOINTS is set" in line]
    assert len(warnings) == 1, warnings
    assert "failpoints are not enabled by this daemon's configuration" in warnings[0]
    assert "fired" not in log and d.alive()


def test_an_enabled_daemon_arms_failpoints_and_refuses_a_malformed_spec(
        etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster",
                     failpoints=True, socket_group="")
    try:
        bad = c.add("node-b", "active", env={env.FAILPOINTS: "controller.round=explode"})
        assert bad.wait(30) == 2
        assert "is not sleep(S), exit(N) or raise" in bad.log_text()
        d = c.add("node-a", "active", env={env.FAILPOINTS: "controller.round=exit(3)"})
        wait_log(d, "failpoint controller.round fired: exit(3)", timeout=30)
        assert d.wait(10) == 3
    finally:
        c.stop_all(timeout=5, drain=False)
