"""Fixtures for the end-to-end layer: real daemons around the real etcd of tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.scenarios import assert_no_tracebacks
from tests.once import build_once
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster


@pytest.fixture
def cluster(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    """An empty local cluster; daemons started with ``cluster.add`` are stopped afterwards, and
    none of them may have logged a traceback (``assert_no_tracebacks``)."""
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)
        assert_no_tracebacks(c)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (TP=2 x DP=2, plain processes, no daemons) that the migration and
    recovery tests compare with bit for bit: one per test run, shared by their modules and by
    every xdist worker."""
    from tests.integration.test_migration import standalone_run
    return build_once(tmp_path_factory, "reference", standalone_run)


@pytest.fixture(scope="session")
def reference_dp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of TP=2 x DP=1 (two ranks, no replica), which the rollback tests
    compare with: built once per test run, as :func:`reference`."""
    from tests.integration.test_migration import standalone_run
    return build_once(tmp_path_factory, "reference-dp1",
                      lambda base: standalone_run(base, world=2, tp=2))
