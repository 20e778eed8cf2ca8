"""Recovery from unexpected failures end to end: a TP=2 x DP=2 job under real daemons loses a
rank's process (kill -9) or a whole node (daemon and workers killed, or frozen with no TCP
reset); a standby takes each lost rank with the state of a data-parallel replica, the failed
step is redone, and the final state is compared bit for bit with an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.bitwise import assert_bitwise_equal
from tests.integration.scenarios import events, start, wait_log, wait_standbys, worker_pid
from tests.integration.test_migration import STEPS, _finish, _run_job, reference  # noqa: F401
from understudy.daemon.embedded_etcd import EmbeddedEtcd
from understudy.daemon.localcluster import DaemonProcess, LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _wait_steps(d: DaemonProcess, rank: int, steps: int) -> None:
    """Until ``rank`` on ``d`` committed ``steps`` steps (the runtime says so every 50)."""
    wait_log(d, f"{steps} steps committed on rank {rank}", timeout=120)


def _recovery_done(c: LocalCluster) -> dict:
    c.wait_for("the recovery to finish", lambda s: any(
        e["kind"] == "migration-done" for e in events(c)), timeout=120)
    return next(e for e in events(c) if e["kind"] == "migration-done")


def test_a_killed_rank_is_replaced_from_its_replica_and_the_result_is_bitwise_identical(
        etcd: EmbeddedEtcd, reference: Path, tmp_path: Path) -> None:  # noqa: F811
    c = start(etcd, tmp_path / "cluster", {"node-a": 2, "node-b": 2}, ("node-s1", "node-s2"))
    try:
        out = tmp_path / "out"
        _run_job(c, out)
        wait_standbys(c, ("node-s1", "node-s2"))
        a = c.daemons["node-a"]
        _wait_steps(a, 1, 50)
        os.kill(worker_pid(a, "mig.r1"), signal.SIGKILL)
        done = _recovery_done(c)
        planned = next(e for e in events(c) if e["kind"] == "migration-planned")
        assert "recovery: rank 1 -> node-s1 (state from rank 3)" in planned["message"]
        job = _finish(c)
        assert job.assignment.epoch == 2
        assert job.assignment.ranks == ("node-a", "node-s1", "node-b", "node-b")
        # Nobody else restarted; rank 0 (rank 1's TP partner) and ranks 2, 3 trained on.
        assert a.log_text().count("Started rank 0 of job mig") == 1
        assert c.daemons["node-b"].log_text().count("Started rank 3 of job mig") == 1
        assert done["details"]["id"] == planned["details"]["id"]
        summary = json.loads((out / "rank1.json").read_text())
        assert summary["step"] == STEPS
        assert_bitwise_equal(reference, out, world=4)
    finally:
        c.stop_all(timeout=5)
