"""Fixtures shared by every layer: a real etcd server on free loopback ports."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from understudy.testing.embedded_etcd import EmbeddedEtcd


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_root = pytest.mark.skip(reason="needs root for network namespaces and nftables")
    for item in items:
        if "root" in item.keywords and os.geteuid() != 0:
            item.add_marker(skip_root)


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
