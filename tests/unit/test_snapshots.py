"""Snapshots of a rank's state (torch.distributed.checkpoint, written in the background) load
back bit for bit, into a fresh process's runtime too, whose optimizer has no state yet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_runtime import assert_bitwise_equal, solo  # noqa: F401
from understudy.worker import rng
from understudy.worker.api import JobContext, TrainingJob
from understudy.worker.runtime import Runtime
from understudy.worker.snapshots import (
    COMPLETE,
    Snapshotter,
    complete_steps,
    load_snapshot,
    snapshot_dir,
)


class AdamJob(TrainingJob):
    def build(self, ctx: JobContext) -> None:
        torch.manual_seed(ctx.seed)
        self.model = torch.nn.Linear(8, 4)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.committed = 0

    def reseed(self, step: int) -> None:
        rng.seed_all(1000 + step)

    def compute(self, step: int) -> float:
        self.optimizer.zero_grad()
        x = torch.randn(16, 8)
        loss = torch.nn.functional.dropout(self.model(x), 0.2).pow(2).mean()
        loss.backward()
        return loss.item()

    def apply(self, step: int) -> None:
        self.optimizer.step()
        self.committed = step + 1

    def discard(self, step: int) -> None:
        self.optimizer.zero_grad()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "committed": self.committed}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.committed = state["committed"]


def _runtime(ctx: JobContext) -> Runtime:
    runtime = Runtime(AdamJob(), ctx)
    runtime.build()
    return runtime


def test_a_snapshot_loads_into_a_fresh_runtime_and_training_goes_on_identically(
        solo: JobContext, tmp_path: Path) -> None:  # noqa: F811
    reports: list[list[int]] = []
    runtime = _runtime(solo)
    snapshots = Snapshotter(tmp_path / "snap", rank=0, every=3, report=reports.append, keep=2)
    runtime.after_commit.append(snapshots.after_commit)
    for steps in (3, 6, 9):  # one at a time: a snapshot due while one is written is skipped
        runtime.run(steps)
        snapshots.close()
    assert reports[-1] == [6, 9] and complete_steps(tmp_path / "snap", 0) == [6, 9]
    assert not snapshot_dir(tmp_path / "snap", 3, 0).exists()  # only the newest two are kept
    assert json.loads((snapshot_dir(tmp_path / "snap", 9, 0) / COMPLETE).read_text()) == \
        {"step": 9, "rank": 0}
    runtime.run(12)
    # A fresh process (its Adam has no state yet) goes back to step 6 and redoes 6..11.
    fresh = _runtime(solo)
    load_snapshot(tmp_path / "snap", 6, fresh)
    assert fresh.step == 6 and fresh.job.committed == 6  # type: ignore[attr-defined]
    fresh.run(12)
    assert_bitwise_equal(runtime.state()["job"], fresh.state()["job"])


def test_a_missing_snapshot_is_refused_with_the_step_and_rank(solo: JobContext,  # noqa: F811
                                                              tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no complete snapshot of step 40 for rank 0"):
        load_snapshot(tmp_path / "snap", 40, _runtime(solo))
