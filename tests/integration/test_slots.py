"""Data-parallel slots end to end (issue 16, item 1): the plain example with ``--slots 2``
trains the same bits on two TP=2 replicas as on one under real daemons, through a live drain to
standbys warmed in the sandbox (whose shadow iterations replay the slots' point-to-point sums).
That any replica count trains the same bits as plain processes is test_reshape.py's (DP 4, 2
and 3 in one run, against an uninterrupted DP 4 run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.bitwise import assert_rank_equal
from tests.integration.scenarios import start, wait_log
from tests.integration.test_migration import _finish, _run_job, standalone_run
from tests.once import build_once
from understudy.testing.embedded_etcd import EmbeddedEtcd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SLOTS = ("--slots", "2")


@pytest.fixture(scope="session")
def one_replica(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The slotted job on one TP=2 replica holding both slots (plain processes, no daemons)."""
    return build_once(tmp_path_factory, "slotted-dp1",
                      lambda base: standalone_run(base, world=2, tp=2, extra=SLOTS))


def _assert_same_as_one_replica(one: Path, out: Path) -> None:
    # Rank r of TP=2 x DP=2 holds what rank r % 2 holds on one replica: parameters, Adam's
    # state, schedule, data position and step, bit for bit.
    for rank in range(4):
        assert_rank_equal(one, rank % 2, out, rank, rng=False)


def test_a_slotted_job_drained_live_keeps_the_bits_of_one_replica(
        etcd: EmbeddedEtcd, one_replica: Path, tmp_path: Path) -> None:
    c = start(etcd, tmp_path / "cluster", {"node-a": 2, "node-b": 2}, ("node-s1", "node-s2"))
    try:
        out = tmp_path / "out"
        _run_job(c, out, env={"UNDERSTUDY_RECORDINGS": str(tmp_path / "recordings")},
                 extra=SLOTS)
        # The standbys ran shadow iterations of the slotted step on the recorded sums.
        wait_log(c.daemons["node-s1"], "Standby is warm (replay) as rank", timeout=120)
        wait_log(c.daemons["node-s2"], "Standby is warm (replay) as rank", timeout=120)
        drain = c.cli("drain", "node-b", "--deadline", "120", "--wait", timeout=180)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        job = _finish(c)
        assert job.assignment is not None and job.assignment.epoch == 2
        assert "node-b" not in job.assignment.ranks
        _assert_same_as_one_replica(one_replica, out)
    finally:
        c.stop_all(timeout=5, drain=False)
