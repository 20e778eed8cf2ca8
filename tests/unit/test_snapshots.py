"""Snapshots of a rank's state, kept in the background in a holder's memory (over a real
socket) and in storage (torch.distributed.checkpoint), load back bit for bit, into a fresh
process's runtime too, whose optimizer has no state yet; a copy that is not there is refused
with the reason, and a holder that fails never fails training."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_runtime import assert_bitwise_equal, solo  # noqa: F401
from understudy.common.daemon_client import DaemonError
from understudy.common.snapshot_tiers import (
    STORAGE,
    MemoryCopies,
    SnapshotReport,
    memory_source,
    storage_source,
)
from understudy.worker import rng
from understudy.worker.api import JobContext, TrainingJob
from understudy.worker.holder import SnapshotHolder
from understudy.worker.holder_client import push
from understudy.worker.runtime import Runtime
from understudy.worker.snapshots import (
    COMPLETE,
    SnapshotError,
    Snapshotter,
    complete_copies,
    complete_steps,
    load_snapshot,
    restore,
    serialize,
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
    reports: list[SnapshotReport] = []
    runtime = _runtime(solo)
    snapshots = Snapshotter(tmp_path / "snap", rank=0, every=3, report=reports.append, keep=2)
    runtime.after_commit.append(snapshots.after_commit)
    for steps in (3, 6, 9):  # one at a time: a snapshot due while one is written is skipped
        runtime.run(steps)
        snapshots.close()
    assert reports[-1] == SnapshotReport(storage=(6, 9), epoch=0, storage_epochs=(0, 0))
    assert complete_steps(tmp_path / "snap", 0) == [6, 9]
    assert not snapshot_dir(tmp_path / "snap", 3, 0, 0).exists()  # only the newest two are kept
    assert json.loads((snapshot_dir(tmp_path / "snap", 9, 0, 0) / COMPLETE).read_text()) == \
        {"step": 9, "rank": 0, "epoch": 0}
    # No more snapshots: one of step 12 would drop step 6's (keep=2) while it is read below.
    runtime.after_commit.remove(snapshots.after_commit)
    runtime.run(12)
    # A fresh process (its Adam has no state yet) goes back to step 6 and redoes 6..11.
    fresh = _runtime(solo)
    load_snapshot(tmp_path / "snap", 6, fresh, 0)
    assert fresh.step == 6 and fresh.job.committed == 6  # type: ignore[attr-defined]
    fresh.run(12)
    assert_bitwise_equal(runtime.state()["job"], fresh.state()["job"])


def test_a_missing_snapshot_is_refused_with_the_step_and_rank(solo: JobContext,  # noqa: F811
                                                              tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no complete snapshot of step 40 for rank 0"):
        load_snapshot(tmp_path / "snap", 40, _runtime(solo))


@pytest.fixture
def holder() -> Iterator[SnapshotHolder]:
    h = SnapshotHolder("node-s1", host="127.0.0.1", keep=2)
    try:
        yield h
    finally:
        h.close()


def test_snapshots_kept_in_a_holders_memory_load_back_identically_without_a_directory(
        solo: JobContext, holder: SnapshotHolder) -> None:  # noqa: F811
    reports: list[SnapshotReport] = []
    runtime = _runtime(solo)
    snapshots = Snapshotter(None, rank=0, every=3, report=reports.append, keep=2,
                            holders=lambda: [holder.advertised()])
    runtime.after_commit.append(snapshots.after_commit)
    for steps in (3, 6, 9):
        runtime.run(steps)
        snapshots.close()
    assert reports[-1] == SnapshotReport(memory=MemoryCopies("node-s1", holder.id, (6, 9),
                                                             (0, 0)), epoch=0)
    assert holder.held() == {0: (6, 9)}
    # The reference goes on without snapshots: its copy of step 12 would evict step 6 from the
    # holder (it keeps two) while step 6 is being restored (a suite run lost that race).
    runtime.after_commit.remove(snapshots.after_commit)
    runtime.run(12)
    source = memory_source("node-s1", holder.id)
    # Over the network, as a survivor fetches its copy...
    fresh = _runtime(solo)
    where = restore(fresh, 6, source, directory=None,
                    holders=lambda node: holder.advertised())
    assert where == "from memory on node-s1" and fresh.step == 6
    fresh.run(12)
    assert_bitwise_equal(runtime.state()["job"], fresh.state()["job"])
    # ...and in the holder's own process, as the joiner it becomes takes its rank's copy.
    own = _runtime(solo)
    assert restore(own, 9, source, directory=None, holders=None, local=holder) == \
        "from this standby's own memory"
    own.run(12)
    assert_bitwise_equal(runtime.state()["job"], own.state()["job"])


def test_both_tiers_are_kept_and_reported_and_either_restores(
        solo: JobContext, holder: SnapshotHolder, tmp_path: Path) -> None:  # noqa: F811
    reports: list[SnapshotReport] = []
    runtime = _runtime(solo)
    snapshots = Snapshotter(tmp_path / "snap", rank=0, every=3, report=reports.append,
                            holders=lambda: [holder.advertised()])
    runtime.after_commit.append(snapshots.after_commit)
    runtime.run(3)
    snapshots.close()
    # One report after the memory copy, one after storage.
    memory = MemoryCopies("node-s1", holder.id, (3,), (0,))
    assert reports == [SnapshotReport(memory=memory, epoch=0),
                       SnapshotReport((3,), memory, epoch=0, storage_epochs=(0,))]
    from_memory, from_storage = _runtime(solo), _runtime(solo)
    restore(from_memory, 3, memory_source("node-s1", holder.id, 0), directory=None,
            holders=lambda node: holder.advertised())
    assert restore(from_storage, 3, storage_source(0), directory=tmp_path / "snap",
                   holders=None) == "from storage"
    assert_bitwise_equal(from_memory.state(), from_storage.state())
    # The holder is gone by the time the copy is wanted: the same step from storage will do.
    where = holder.advertised()
    holder.close()
    fallback = _runtime(solo)
    assert restore(fallback, 3, memory_source("node-s1", holder.id, 0),
                   directory=tmp_path / "snap", holders=lambda node: where, timeout=2).startswith(
        "from storage: rank 0's snapshot of step 3 is not to be had from memory: holder on "
        "node-s1")
    assert_bitwise_equal(from_memory.state(), fallback.state())


def test_a_failing_holder_costs_the_memory_copy_never_training(
        solo: JobContext, holder: SnapshotHolder, tmp_path: Path) -> None:  # noqa: F811
    gone = holder.advertised()
    holder.close()
    reports: list[SnapshotReport] = []
    runtime = _runtime(solo)
    snapshots = Snapshotter(tmp_path / "snap", rank=0, every=3, report=reports.append,
                            holders=lambda: [gone], push_timeout=2)
    runtime.after_commit.append(snapshots.after_commit)
    runtime.run(3)
    snapshots.close()
    assert runtime.step == 3
    assert reports == [SnapshotReport(storage=(3,), epoch=0, storage_epochs=(0,))]


def test_a_copy_that_is_not_there_is_refused_with_the_reason(
        solo: JobContext, holder: SnapshotHolder) -> None:  # noqa: F811
    runtime = _runtime(solo)
    with pytest.raises(SnapshotError, match="to come from storage, but UNDERSTUDY_SNAPSHOTS "
                                            "is not set here"):
        restore(runtime, 3, STORAGE, directory=None, holders=None)
    with pytest.raises(SnapshotError, match=r"step 3 of rank 0 is not held on node-s1"):
        restore(runtime, 3, memory_source("node-s1", holder.id), directory=None,
                holders=lambda node: holder.advertised())
    restarted = memory_source("node-s1", "0123456789abcdef")
    with pytest.raises(SnapshotError, match=f"the holder on node-s1 is now {holder.id}, not "
                                            "0123456789abcdef: it was restarted"):
        restore(runtime, 3, restarted, directory=None, holders=lambda node: holder.advertised())
    with pytest.raises(SnapshotError, match="neither 'storage' nor"):
        restore(runtime, 3, "tape:node-s1", directory=None, holders=None)
    assert runtime.step == 0


# -- epochs: a replaced rank may still write, but nothing a live rank reads comes from it -----


def test_a_copy_is_written_aside_then_made_visible_whole_under_its_writers_epoch(
        solo: JobContext, tmp_path: Path) -> None:  # noqa: F811
    snap = tmp_path / "snap"
    # Another process of this rank left a half-written copy (it crashed, or it was replaced
    # and still writes): nobody reads it, and this one leaves it alone.
    other = snap / "step-000000003" / "rank-0.tmp-4-999999"
    other.mkdir(parents=True)
    (other / "partial").write_bytes(b"x")
    reports: list[SnapshotReport] = []
    runtime = _runtime(solo)
    snapshots = Snapshotter(snap, rank=0, every=3, report=reports.append, epoch=lambda: 4)
    runtime.after_commit.append(snapshots.after_commit)
    runtime.run(3)
    snapshots.close()
    assert sorted(p.name for p in (snap / "step-000000003").iterdir()) == \
        ["rank-0.e4", "rank-0.tmp-4-999999"]
    assert json.loads((snapshot_dir(snap, 3, 0, 4) / COMPLETE).read_text()) == \
        {"step": 3, "rank": 0, "epoch": 4}
    assert reports == [SnapshotReport((3,), epoch=4, storage_epochs=(4,))]
    assert complete_copies(snap, 0) == [(3, 4)]


def test_two_writers_of_a_step_under_different_epochs_each_load_exactly_as_named(
        solo: JobContext, tmp_path: Path) -> None:  # noqa: F811
    snap = tmp_path / "snap"
    live, stale = _runtime(solo), _runtime(solo)
    live.run(3)
    stale.run(3)
    with torch.no_grad():  # the replaced process's state is not the live one's
        stale.job.model.weight.add_(1.0)  # type: ignore[attr-defined]
    for runtime, epoch in ((live, 5), (stale, 4)):
        writer = Snapshotter(snap, rank=0, every=3, report=lambda r: None,
                             epoch=lambda e=epoch: e)
        writer.after_commit(runtime)
        writer.close()
    assert complete_copies(snap, 0) == [(3, 4), (3, 5)]
    for epoch, expected in ((5, live), (4, stale)):
        fresh = _runtime(solo)
        assert restore(fresh, 3, storage_source(epoch), directory=snap, holders=None,
                       epoch=5) == "from storage"
        assert_bitwise_equal(fresh.state()["job"], expected.state()["job"])
    # A plan made at epoch 4 names no copy written under epoch 5.
    with pytest.raises(SnapshotError, match="named as written under epoch 5, after epoch 4"):
        restore(_runtime(solo), 3, storage_source(5), directory=snap, holders=None, epoch=4)
    with pytest.raises(SnapshotError, match="no complete snapshot of step 3 for rank 0"):
        restore(_runtime(solo), 3, storage_source(6), directory=snap, holders=None)
    # A folder whose marker names another copy is refused, not loaded.
    (snapshot_dir(snap, 3, 0, 5) / COMPLETE).write_text(
        json.dumps({"step": 3, "rank": 0, "epoch": 4}))
    with pytest.raises(SnapshotError, match=r"rank-0\.e5 was written under epoch 4, not "
                                            r"epoch 5"):
        restore(_runtime(solo), 3, storage_source(5), directory=snap, holders=None)
    (snapshot_dir(snap, 3, 0, 5) / COMPLETE).write_text(
        json.dumps({"step": 6, "rank": 0, "epoch": 5}))
    with pytest.raises(SnapshotError, match="holds step 6 of rank 0, not step 3 of rank 0"):
        restore(_runtime(solo), 3, storage_source(5), directory=snap, holders=None)


def test_a_visible_copy_is_never_rewritten_or_replaced(solo: JobContext,  # noqa: F811
                                                       tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    taken = snapshot_dir(snap, 3, 0, 4)  # another process of epoch 4 made it first
    taken.mkdir(parents=True)
    (taken / COMPLETE).write_text(json.dumps({"step": 3, "rank": 0, "epoch": 4}))
    runtime = _runtime(solo)
    runtime.run(3)
    reports: list[SnapshotReport] = []
    writer = Snapshotter(snap, rank=0, every=3, report=reports.append, epoch=lambda: 4)
    writer.after_commit(runtime)
    writer.close()
    assert [p.name for p in taken.iterdir()] == [COMPLETE] and reports == []
    assert [p.name for p in (snap / "step-000000003").iterdir()] == ["rank-0.e4"]


def test_a_rank_prunes_only_its_own_copies_and_only_once_a_report_was_taken(
        solo: JobContext, tmp_path: Path) -> None:  # noqa: F811
    snap = tmp_path / "snap"
    runtime = _runtime(solo)
    predecessor = Snapshotter(snap, rank=0, every=3, report=lambda r: None, epoch=lambda: 2)
    runtime.after_commit.append(predecessor.after_commit)
    for steps in (3, 6):
        runtime.run(steps)
        predecessor.close()
    runtime.after_commit.remove(predecessor.after_commit)
    taken: list[SnapshotReport] = []
    refused: list[str] = []

    def report(held: SnapshotReport) -> None:  # as the daemon answers a replaced rank
        if refused:
            raise DaemonError(refused[0])
        taken.append(held)

    mine = Snapshotter(snap, rank=0, every=3, report=report, keep=1, epoch=lambda: 3)
    runtime.after_commit.append(mine.after_commit)
    for steps in (9, 12):
        runtime.run(steps)
        mine.close()
    # Its own copy of 9 went once the report of 12 was taken; its predecessor's stay.
    assert complete_copies(snap, 0) == [(3, 2), (6, 2), (12, 3)]
    assert taken[-1] == SnapshotReport((12,), epoch=3, storage_epochs=(3,))
    # Replaced: its daemon refuses the report, so it deletes nothing (a plan may name 12).
    refused.append("a write of epoch 3 refused: job j is at epoch 4")
    runtime.run(15)
    mine.close()
    assert complete_copies(snap, 0) == [(3, 2), (6, 2), (12, 3), (15, 3)]
    assert taken[-1].storage == (12,)


def test_a_rank_whose_epoch_moved_reports_its_copies_again_under_the_new_one(
        solo: JobContext, tmp_path: Path) -> None:  # noqa: F811
    epoch, reports = [1], []
    runtime = _runtime(solo)
    snapshots = Snapshotter(tmp_path / "snap", rank=0, every=3, report=reports.append,
                            epoch=lambda: epoch[0])
    runtime.after_commit.append(snapshots.after_commit)
    runtime.run(3)
    snapshots.close()
    epoch[0] = 2  # it survived a recovery: its switch raised its epoch
    runtime.run(5)
    snapshots.close()
    assert reports == [SnapshotReport((3,), epoch=1, storage_epochs=(1,)),
                       SnapshotReport((3,), epoch=2, storage_epochs=(1,))]


def test_memory_copies_are_reported_and_fetched_by_epoch(
        solo: JobContext, holder: SnapshotHolder, tmp_path: Path) -> None:  # noqa: F811
    # The rank's predecessor left a copy of step 0 (epoch 3) in the holder: not this
    # process's to vouch for, so not in its report.
    push(holder.advertised(), 0, 0, serialize({"x": torch.zeros(1)}), epoch=3)
    reports: list[SnapshotReport] = []
    runtime = _runtime(solo)
    snapshots = Snapshotter(tmp_path / "snap", rank=0, every=3, report=reports.append,
                            holders=lambda: [holder.advertised()], epoch=lambda: 4)
    runtime.after_commit.append(snapshots.after_commit)
    runtime.run(3)
    snapshots.close()
    assert holder.held_epochs() == {0: {0: 3, 3: 4}}
    assert reports[0] == SnapshotReport(memory=MemoryCopies("node-s1", holder.id, (3,), (4,)),
                                        epoch=4)
    fresh = _runtime(solo)
    assert restore(fresh, 3, memory_source("node-s1", holder.id, 4), directory=None,
                   holders=lambda node: holder.advertised(), epoch=4) == \
        "from memory on node-s1"
    assert_bitwise_equal(fresh.state(), runtime.state())
    # A plan naming another epoch's copy gets neither the holder's nor another folder.
    with pytest.raises(SnapshotError, match="held on node-s1 from epoch 4, not epoch 3"):
        restore(_runtime(solo), 3, memory_source("node-s1", holder.id, 3),
                directory=tmp_path / "snap", holders=lambda node: holder.advertised())
