"""Fixtures for the end-to-end layer: real daemons around the real etcd of tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.scenarios import assert_no_tracebacks
from tests.once import build_once
from understudy.daemon.controller import PLANNER_BUG
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster


@pytest.fixture(autouse=True)
def _no_action_refused(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test's clusters: no controller among their daemons refused a planner action (a
    job state or migration phase its lifecycle does not allow) while the test ran."""
    clusters: list[LocalCluster] = []
    init = LocalCluster.__init__

    def tracked(self: LocalCluster, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        clusters.append(self)

    monkeypatch.setattr(LocalCluster, "__init__", tracked)
    yield
    for c in clusters:
        for name, d in c.daemons.items():
            refused = [line for line in d.log_text().splitlines() if PLANNER_BUG in line]
            if refused:
                pytest.fail(f"the controller on {name} refused {len(refused)} planner "
                            f"action(s); the first: {refused[0][-1500:]}")


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
