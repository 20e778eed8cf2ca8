"""Fixtures for the end-to-end layer: real daemons around the real etcd of tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.daemon.embedded_etcd import EmbeddedEtcd
from understudy.daemon.localcluster import LocalCluster


@pytest.fixture
def cluster(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    """An empty local cluster; daemons started with ``cluster.add`` are stopped afterwards, and
    none of them may have logged a traceback (but for failpoints armed to raise)."""
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop_all(timeout=5)
        for name, d in c.daemons.items():
            lines = d.log_text().splitlines()
            unexpected = [i for i, line in enumerate(lines)
                          if "Traceback" in line and "failpoints.FailpointFired" not in line]
            if unexpected:
                # A JSON log line holds its whole traceback; a raw one (printed by Python itself,
                # not our logger) runs over the lines after it: show both, with what led up to it.
                first = unexpected[0]
                shown = "\n".join(line[-2000:] for line in lines[max(0, first - 3):first + 40])
                pytest.fail(f"{name} logged {len(unexpected)} traceback(s); the first:\n{shown}")


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (TP=2 x DP=2, plain processes, no daemons) that the migration and
    recovery tests compare with bit for bit: one per session, shared by their modules."""
    from tests.integration.test_migration import standalone_run
    return standalone_run(tmp_path_factory.mktemp("reference"))
