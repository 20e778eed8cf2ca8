"""Fixtures shared by every layer: a real etcd server on free loopback ports."""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.testing.embedded_etcd import EmbeddedEtcd

#: Seconds the longest tests took (``--durations``, call and setup, on two xdist workers on a
#: 2-core machine, the slowest case of a parametrized test; git 91c17b1). They start first, so
#: that under pytest-xdist no worker starts one of them while the others are about to finish.
LONGEST = {
    "integration/test_outage.py::test_training_goes_on_through_etcd_outages_and_ends_bitwise":
    80,
    # Its setup builds the session's Megatron reference (32 s), which two more tests wait for.
    "integration/test_megatron.py::test_one_rank_drained_twice_then_a_joiner_killed_mid_stream":
    78,
    # 60 s, but mostly waiting on etcd: not first, beside the other outage test (that left a
    # core idle for the suite's first minute), but mid-run, beside tests that compute
    "integration/test_outage.py::test_a_drain_caught_in_phase_1_by_an_outage_ends_whole_and_"
    "bitwise": 30,
    "integration/test_benchmarks.py::test_goodput_smoke": 72,
    "integration/test_benchmarks.py::test_soak_smoke": 67,
    "integration/test_benchmarks.py::test_downtime_smoke": 53,
    "integration/test_benchmarks.py::test_recovery_smoke": 42,
    "integration/test_benchmarks.py::test_overhead_smoke": 40,
    "integration/test_megatron.py::test_a_killed_megatron_rank_is_rebuilt_from_its_replica_"
    "bitwise": 37,
    "integration/test_reshape.py::test_a_job_shrunk_from_four_replicas_to_two_and_grown_back_"
    "keeps_every_bit": 36,
    "integration/test_recovery.py::test_a_sharded_optimizer_loses_no_step_to_a_crash_and_moves_"
    "whole_in_a_drain": 35,
    "integration/test_recovery.py::test_a_rank_crashing_during_a_drain_aborts_it_recovers_then_"
    "the_drain_completes": 34,
    "integration/test_megatron.py::test_drain_moves_megatron_ranks_live_and_the_result_is_"
    "bitwise_identical": 34,
    "integration/test_recovery.py::test_an_exhausted_pool_pauses_the_job_until_a_standby_joins":
    33,
    "integration/test_pipeline.py::test_a_drained_first_stage_moves_to_standbys_warmed_per_"
    "stage_type": 32,
    "integration/test_restage.py::test_a_job_whose_stages_go_from_one_to_four_and_back_keeps_"
    "every_bit": 30,
    "integration/test_slots.py::test_a_slotted_job_shrinks_live_with_no_standby_free_and_grows_"
    "back_bit_for_bit": 30,
    "integration/test_jobs.py::test_a_standby_reports_its_warmth_and_a_silent_one_is_replaced":
    30,
    "integration/test_restart.py::test_an_unmodified_script_restarts_from_its_checkpoint_after_a_"
    "crash_and_a_drain": 21,
    "integration/test_jobs.py::test_a_job_stopped_from_the_cli_finishes_its_step_saves_and_frees_"
    "its_nodes": 20,
    "integration/test_migration.py::test_a_migration_past_its_deadline_aborts_and_the_leaver_"
    "trains_on": 27,
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


#: ``UNDERSTUDY_TEST_CPU=FILE``: each test's CPU seconds, its own process's and its reaped
#: children's (the daemons it started, their workers, a benchmark's processes), are appended
#: to FILE as a JSON line. The suite is CPU-bound on two cores: this says which tests to trim.
CPU_LOG = os.environ.get("UNDERSTUDY_TEST_CPU")


def _cpu_seconds() -> float:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not CPU_LOG:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    with open(CPU_LOG, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 2),
                            "wall_s": round(time.monotonic() - wall, 2)}) + "\n")
