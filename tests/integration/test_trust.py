"""The node's trust boundary with real daemons: failpoints that only a daemon's configuration
arms.

The daemons here run as production runs them (``LocalCluster(failpoints=False)``) unless a test
says otherwise; the harness's usual setting (``daemon/localcluster.py``) honours every
failpoint. The state transfer's restricted loader is tested in ``tests/unit/test_transfer.py``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.scenarios import assert_no_tracebacks, wait_log
from understudy.daemon import env
from understudy.daemon.embedded_etcd import EmbeddedEtcd
from understudy.daemon.localcluster import LocalCluster

pytestmark = pytest.mark.slow
PROBE = str(Path(__file__).parents[1] / "workers" / "probe.py")


@pytest.fixture
def production(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster",
                     failpoints=False)
    try:
        yield c
    finally:
        c.stop_all(timeout=5)
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
                     failpoints=True)
    try:
        bad = c.add("node-b", "active", env={env.FAILPOINTS: "controller.round=explode"})
        assert bad.wait(30) == 2
        assert "is not sleep(S), exit(N) or raise" in bad.log_text()
        d = c.add("node-a", "active", env={env.FAILPOINTS: "controller.round=exit(3)"})
        wait_log(d, "failpoint controller.round fired: exit(3)", timeout=30)
        assert d.wait(10) == 3
    finally:
        c.stop_all(timeout=5)
