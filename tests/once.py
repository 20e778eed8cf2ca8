"""Expensive set-ups (the uninterrupted reference runs) built once per test run, however many
pytest-xdist workers need them: the first to ask builds, the others wait for it and share."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp directory of this whole test run: under xdist, the parent of every worker's own
    (``pytest-N/popen-gwK``); without it, the session's own. Another run has another."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], Path]) -> Path:
    """``build(directory)``'s result, built in ``<shared root>/name`` by the first caller of
    this run and returned to every later one. A build that raised is tried again by the next
    caller (it raises in each test that needs it, as a fixture does without sharing)."""
    root = shared_root(tmp_path_factory)
    directory, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # what a failed build left
            directory.mkdir(parents=True)
            result = build(directory)
            done.write_text(str(result.relative_to(directory)))
        return directory / done.read_text()
