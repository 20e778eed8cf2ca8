"""Fixtures shared by every layer: a real etcd server on free loopback ports."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.testing.embedded_etcd import EmbeddedEtcd

#: Seconds the longest tests took in serial runs on a 2-core machine (``--durations``, the
#: larger of two runs; the slowest case of a parametrized test). They start first, so that under
#: pytest-xdist no worker starts one of them while the others are about to finish.
LONGEST = {
    "integration/test_outage.py::test_training_goes_on_through_etcd_outages_and_ends_bitwise":
    87,
    # 50 s, but mostly waiting on etcd: not first, beside the other outage test (that left a
    # core idle for the suite's first minute), but mid-run, beside tests that compute
    "integration/test_outage.py::test_a_drain_caught_in_phase_1_by_an_outage_ends_whole_and_"
    "bitwise": 30,
    "integration/test_benchmarks.py::test_goodput_smoke": 66,
    "integration/test_benchmarks.py::test_soak_smoke": 63,
    "integration/test_benchmarks.py::test_downtime_smoke": 58,
    "integration/test_recovery.py::test_a_rank_crashing_during_a_drain_aborts_it_recovers_then_"
    "the_drain_completes": 43,
    "integration/test_partition.py::test_a_node_whose_probes_vanish_is_revoked_by_the_controller_"
    "fences_and_rejoins": 42,
    "integration/test_benchmarks.py::test_recovery_smoke": 38,
    "integration/test_megatron.py::test_one_rank_drained_twice_then_a_joiner_killed_mid_stream":
    33,
    "integration/test_recovery.py::test_the_controller_dying_right_after_planning_a_recovery_"
    "leaves_it_to_the_next": 31,
    "integration/test_benchmarks.py::test_overhead_smoke": 28,
    "integration/test_recovery.py::test_leavers_dying_in_phase_2_abort_the_drain_and_their_ranks_"
    "are_recovered": 28,
    "integration/test_partition.py::test_a_node_cut_off_from_etcd_is_replaced_and_its_old_ranks_"
    "never_commit_after": 23,
    "integration/test_recovery.py::test_an_exhausted_pool_pauses_the_job_until_a_standby_joins":
    23,
    "integration/test_jobs.py::test_a_standby_reports_its_warmth_and_a_silent_one_is_replaced":
    23,
    "integration/test_megatron.py::test_a_killed_megatron_rank_is_rebuilt_from_its_replica_"
    "bitwise": 22,
    "integration/test_migration.py::test_a_migration_past_its_deadline_aborts_and_the_leaver_"
    "trains_on": 22,
    "integration/test_benchmarks.py::test_migration_smoke": 19,
    "integration/test_recovery.py::test_a_sharded_optimizer_loses_no_step_to_a_crash_and_moves_"
    "whole_in_a_drain": 22,
}
#: Every other test marked slow is assumed to take this long (most take 5 to 20 s).
SLOW = 10


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_root = pytest.mark.skip(reason="needs root for network namespaces and nftables")
    for item in items:
        if "root" in item.keywords and os.geteuid() != 0:
            item.add_marker(skip_root)
    # Longest first (a stable sort: the same order in every xdist worker, as xdist requires).
    items.sort(key=lambda item: -_expected_seconds(item))


def _expected_seconds(item: pytest.Item) -> float:
    name = item.nodeid.removeprefix("tests/").split("[")[0]
    return LONGEST.get(name, SLOW if "slow" in item.keywords else 0)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """A fresh single-member etcd for one test."""
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: the test command installs it (scripts/test)")
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.cleanup()
