"""Which snapshot a rollback takes, and where each rank's copy comes from: the newest step every
rank holds in some tier, a copy in a live holder's memory before one in storage. Pure: no etcd,
no sockets, no clock."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.unit.test_control_logic import _crash, _recovery_view, _spec
from understudy.common.errors import RecordError
from understudy.common.records import Assignment, JobState, Migration, MigrationPhase
from understudy.common.snapshot_tiers import (
    STORAGE,
    MemoryCopies,
    RollbackPoint,
    SnapshotReport,
    Source,
    live_holders,
    memory_source,
    parse_source,
    report_counts,
    rollback_point,
    source_of,
    storage_source,
)
from understudy.common.store import KV
from understudy.daemon.controller import _JobTables
from understudy.daemon.localsock import RequestError, _warmth
from understudy.daemon.planner import ClusterView, SetJobState, StartMigration, plan

S1, S2 = "1111aaaa2222bbbb", "3333cccc4444dddd"


def test_memory_is_preferred_and_storage_used_only_where_memory_has_no_copy() -> None:
    storage = {0: (40, 60), 1: (40, 60)}
    memory = {0: MemoryCopies("s1", S1, (40, 60)), 1: MemoryCopies("s2", S2, (20, 40))}
    point = rollback_point(2, storage, memory, {"s1": S1, "s2": S2})
    assert point == RollbackPoint(60, (memory_source("s1", S1), STORAGE))
    assert point.summary() == "memory on s1 (rank 0); storage (rank 1)"


def test_the_newest_step_held_by_every_rank_in_some_tier_wins() -> None:
    # Memory is ahead of storage (the DCP write of 80 is still under way): 80 from memory.
    storage = {0: (40, 60), 1: (40, 60)}
    memory = {0: MemoryCopies("s1", S1, (60, 80)), 1: MemoryCopies("s1", S1, (60, 80))}
    point = rollback_point(2, storage, memory, {"s1": S1})
    assert point is not None and point.step == 80
    assert point.summary() == "memory on s1 (ranks 0, 1)"
    # Memory only, no directory at all.
    assert rollback_point(2, {}, memory, {"s1": S1}) == \
        RollbackPoint(80, (memory_source("s1", S1),) * 2)


def test_copies_of_a_holder_that_is_gone_or_was_restarted_do_not_count() -> None:
    storage = {0: (40,), 1: (40,)}
    memory = {0: MemoryCopies("s1", S1, (40, 60)), 1: MemoryCopies("s1", S1, (40, 60))}
    for holders in ({}, {"s1": S2}, {"s2": S1}):  # node gone; restarted; another node's id
        assert rollback_point(2, storage, memory, holders) == RollbackPoint(40, (STORAGE,) * 2)
        assert rollback_point(2, {}, memory, holders) is None


def test_a_rank_with_no_copy_anywhere_means_no_rollback_point() -> None:
    memory = {0: MemoryCopies("s1", S1, (40,))}
    assert rollback_point(2, {0: (40,)}, memory, {"s1": S1}) is None
    assert rollback_point(2, {0: (20,), 1: (40,)}, {}, {}) is None


def test_live_holders_come_from_the_live_records_warmth_and_skip_junk() -> None:
    warmth = {"s1": {"j": {"mode": "imports", "holder": S1}},
              "s2": {"j": {"mode": "imports"}, "k": {"holder": S2}},
              "s3": {"j": {"holder": "NOT-HEX"}}, "s4": {"j": "junk"}, "s5": "junk"}
    assert live_holders("j", warmth) == {"s1": S1}


def test_sources_parse_or_are_refused() -> None:
    assert parse_source(STORAGE) is None
    assert parse_source(memory_source("node-s1", S1)) == MemoryCopies("node-s1", S1, ())
    for bad in ("memory", "memory:node-s1", f"tape:node-s1:{S1}", "memory::" + S1,
                "memory:node-s1:xyz"):
        with pytest.raises(ValueError, match="neither 'storage' nor"):
            parse_source(bad)


def test_reports_parse_in_both_formats_and_garbage_is_refused() -> None:
    assert SnapshotReport.parse(b"[40, 20]") == SnapshotReport(storage=(20, 40))
    report = SnapshotReport((20, 40), MemoryCopies("node-s1", S1, (40, 60)))
    assert SnapshotReport.parse(report.encode()) == report
    assert SnapshotReport.parse(b'{"memory": null}') == SnapshotReport()
    for bad in (b"not json", b'"x"', b"[1, -2]", b"[true]", b'{"storage": [1.5]}',
                b'{"memory": []}', b'{"memory": {"node": "../x", "holder": "1111aaaa"}}',
                b'{"memory": {"node": "s1", "holder": "nope", "steps": []}}',
                b'{"memory": {"node": "s1", "holder": "1111aaaa", "steps": "40"}}'):
        with pytest.raises(ValueError):
            SnapshotReport.parse(bad)


def test_the_controller_keeps_both_tiers_of_each_report_and_drops_garbage() -> None:
    t = _JobTables()
    report = SnapshotReport((20,), MemoryCopies("s1", S1, (20, 40)))
    t.ingest_progress("j/snapshots/0", report.encode(), False)
    t.ingest_progress("j/snapshots/1", b"[20, 40]", False)  # an older worker's list
    assert t.snapshots == {"j": {0: (20,), 1: (20, 40)}}
    assert t.memory_snapshots == {"j": {0: MemoryCopies("s1", S1, (20, 40))}}
    t.ingest_progress("j/snapshots/0", b'{"memory": {"node": "s1"}}', False)
    assert t.snapshots == {"j": {1: (20, 40)}} and t.memory_snapshots == {"j": {}}
    t.ingest_progress("j/snapshots/1", report.encode(), False)
    t.ingest_progress("j/snapshots/1", b"", True)
    assert t.snapshots == {"j": {}} and t.memory_snapshots == {"j": {}}


def _with_holders(view: ClusterView, **holders: str) -> ClusterView:
    live = dict(view.live)
    for node, hid in holders.items():
        live[node] = dataclasses.replace(live[node], warmth={"j": {"mode": "imports",
                                                                   "holder": hid}})
    return dataclasses.replace(view, live=live)


def test_the_planner_rolls_back_from_memory_and_names_each_ranks_source() -> None:
    view = _recovery_view({1: _crash(1)}, tp=4)
    memory = {r: MemoryCopies("s2", S2, (40, 60)) for r in (0, 2, 3)}
    memory[1] = MemoryCopies("s1", S1, (40, 60))
    job = dataclasses.replace(view.jobs["j"], snapshots={r: (40,) for r in range(4)},
                              memory_snapshots=memory)
    view = dataclasses.replace(view, jobs={"j": job})
    (start,) = plan(_with_holders(view, s1=S1, s2=S2), 5.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert m.kind == "rollback" and m.snapshot_step == 60
    assert m.snapshot_from == (memory_source("s2", S2), memory_source("s1", S1),
                               memory_source("s2", S2), memory_source("s2", S2))
    assert start.reason.startswith("rollback of every rank to the snapshot of step 60: "
                                   "rank 1 -> s1; copies from memory on s2 (ranks 0, 2, 3); "
                                   "memory on s1 (rank 1)"), start.reason
    # s1's holder was restarted: rank 1 has only its storage copy of 40, so everyone goes
    # back to 40, from memory where there is a copy of 40 and from storage for rank 1.
    (start,) = plan(_with_holders(view, s1=S2, s2=S2), 5.0)
    assert isinstance(start, StartMigration)
    assert start.migration.snapshot_step == 40
    assert start.migration.snapshot_from[1] == STORAGE
    assert start.migration.snapshot_from[0] == memory_source("s2", S2)
    # No holder alive and no storage: nothing to roll back to.
    bare = dataclasses.replace(job, snapshots={})
    (failed,) = plan(dataclasses.replace(view, jobs={"j": bare}), 5.0)
    assert isinstance(failed, SetJobState) and failed.state == JobState.FAILED
    assert "no snapshot is held by every rank" in failed.reason


def _rollback(**changes: object) -> Migration:
    base = dict(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(1,), leavers=("b",),
                joiners=("s1",), phase=MigrationPhase.PLANNED, reason="r", created_at=1.0,
                deadline=2.0, updated_at=1.0, kind="rollback", snapshot_step=40,
                snapshot_from=(STORAGE, memory_source("s1", S1)))
    return Migration(**{**base, **changes})


def test_a_rollbacks_sources_travel_in_its_record_and_are_checked() -> None:
    m = _rollback()
    assert Migration.decode(m.encode()) == m
    body = json.loads(m.encode())
    del body["snapshot_from"]  # written by a controller that knew storage only
    assert Migration.decode(json.dumps(body).encode()).snapshot_from == ()
    body["snapshot_from"] = ["storage", "memory:s1:not-an-id"]
    with pytest.raises(RecordError, match="neither 'storage' nor"):
        Migration.decode(json.dumps(body).encode())
    with pytest.raises(ValueError, match="only a rollback names where the snapshots come"):
        _rollback(kind="recovery", donors=(0,), snapshot_step=-1)


def test_a_standby_reports_its_holder_with_its_warmth() -> None:
    assert _warmth({"mode": "imports", "holder": S1})["holder"] == S1
    assert "holder" not in _warmth({"mode": "imports"})
    for bad in ("x", 7, "A" * 8, "ab" * 40):
        with pytest.raises(RequestError, match="holder must be a holder id"):
            _warmth({"mode": "imports", "holder": bad})


# -- epochs: a replaced rank's writes never steer a rollback ---------------------------------


def test_reports_and_sources_carry_the_writers_epochs_and_bad_ones_are_refused() -> None:
    report = SnapshotReport((20, 40), MemoryCopies("s1", S1, (40, 60), (4, 5)), epoch=5,
                            storage_epochs=(4, 5))
    assert SnapshotReport.parse(report.encode()) == report
    assert report.storage_epoch(40) == 5 and report.memory is not None \
        and report.memory.epoch_of(60) == 5 and report.storage_epoch(60) is None
    # Listed out of order and with a repeat: sorted by step, each with its own epoch.
    body = {"storage": [40, 20, 40], "storage_epochs": [5, 4, 5], "epoch": 5, "memory": None}
    assert SnapshotReport.parse(json.dumps(body).encode()) == \
        SnapshotReport((20, 40), epoch=5, storage_epochs=(4, 5))
    for bad in ({"storage": [20, 40], "storage_epochs": [4]},
                {"storage": [20, 20], "storage_epochs": [4, 5]},
                {"storage": [20], "storage_epochs": [-1]},
                {"storage": [20], "epoch": True},
                {"storage": [20], "epoch": "5"},
                {"memory": {"node": "s1", "holder": S1, "steps": [40], "epochs": [4, 5]}}):
        with pytest.raises(ValueError):
            SnapshotReport.parse(json.dumps(bad).encode())
    assert storage_source(4) == "storage@4" and storage_source() == STORAGE
    assert source_of("storage@4") == Source(None, 4)
    assert source_of(memory_source("s1", S1, 5)) == Source(MemoryCopies("s1", S1, ()), 5)
    assert source_of(STORAGE) == Source(None, None)
    assert parse_source(memory_source("s1", S1, 5)) == MemoryCopies("s1", S1, ())
    for bad_source in ("storage@", "storage@x", "storage@-1", f"memory:s1:{S1}@",
                       f"memory:s1@3:{S1}", "storage@1@2"):
        with pytest.raises(ValueError, match="neither 'storage' nor"):
            source_of(bad_source)
    m = _rollback(snapshot_from=(storage_source(4), memory_source("s1", S1, 5)))
    assert Migration.decode(m.encode()) == m


def test_a_report_counts_only_under_the_assignments_epoch_or_the_one_before() -> None:
    assert report_counts(SnapshotReport((20,), epoch=5), 5)
    assert report_counts(SnapshotReport((20,), epoch=4), 5)  # written before 5 committed
    assert not report_counts(SnapshotReport((20,), epoch=3), 5)
    assert not report_counts(SnapshotReport((20,), epoch=6), 5)  # a switch not committed
    assert report_counts(SnapshotReport((20,)), 5)  # an older worker's: cannot be judged


def _tables_at(epoch: int) -> _JobTables:
    t = _JobTables()
    for path, record in (("j/spec", _spec(tp=2, dp=1)),
                         ("j/assignment", Assignment(job="j", epoch=epoch, ranks=("a", "b"),
                                                     standbys=("s1",), reason="",
                                                     updated_at=0))):
        t.ingest(path, KV(key=path, value=record.encode(), mod_revision=1, create_revision=1,
                          lease=0), False)
    return t


def _report(t: _JobTables, rank: int, report: SnapshotReport) -> None:
    t.ingest_progress(f"j/snapshots/{rank}", report.encode(), False)


def test_the_controller_ignores_reports_of_a_replaced_or_not_yet_committed_epoch() -> None:
    t = _tables_at(5)
    # Rank 0 was replaced two epochs ago and its process still reports; rank 1 reports under
    # a migration's next epoch that has not committed.
    _report(t, 0, SnapshotReport((20, 40), MemoryCopies("s1", S1, (40,), (3,)), epoch=3,
                                 storage_epochs=(3, 3)))
    _report(t, 1, SnapshotReport((40,), epoch=6, storage_epochs=(6,)))
    job = t.views()["j"]
    assert job.snapshots == {} and job.memory_snapshots == {} and job.storage_epochs == {}
    # Reports of this epoch and of the one before count, with each copy's epoch.
    _report(t, 0, SnapshotReport((40,), MemoryCopies("s1", S1, (40,), (4,)), epoch=4,
                                 storage_epochs=(4,)))
    _report(t, 1, SnapshotReport((40,), epoch=5, storage_epochs=(5,)))
    job = t.views()["j"]
    assert job.snapshots == {0: (40,), 1: (40,)}
    assert job.storage_epochs == {0: {40: 4}, 1: {40: 5}}
    assert job.memory_snapshots == {0: MemoryCopies("s1", S1, (40,), (4,))}
    assert t.snapshots == {"j": {0: (40,), 1: (40,)}}  # the newest report of each rank


def test_a_joiners_first_report_keeps_its_predecessors_copies_counted() -> None:
    # Rank 1 moved at epoch 5: its joiner's first report lists only its own copy of 60; the
    # copies the replaced process reported under epoch 4 (written before 5 committed) still
    # count, the joiner's copy of a step winning over the predecessor's.
    t = _tables_at(5)
    _report(t, 1, SnapshotReport((20, 40), MemoryCopies("s1", S1, (20, 40), (4, 4)), epoch=4,
                                 storage_epochs=(4, 4)))
    _report(t, 1, SnapshotReport((40, 60), MemoryCopies("s1", S1, (60,), (5,)), epoch=5,
                                 storage_epochs=(5, 5)))
    job = t.views()["j"]
    assert job.snapshots == {1: (20, 40, 60)}
    assert job.storage_epochs == {1: {20: 4, 40: 5, 60: 5}}
    assert job.memory_snapshots == {1: MemoryCopies("s1", S1, (20, 40, 60), (4, 4, 5))}
    # The joiner reports again under epoch 5: its predecessor's report stays beside it.
    _report(t, 1, SnapshotReport((60,), epoch=5, storage_epochs=(5,)))
    assert t.views()["j"].storage_epochs == {1: {20: 4, 40: 4, 60: 5}}
    # Two epochs on, the predecessor's copies no longer count.
    t = _tables_at(6)
    _report(t, 1, SnapshotReport((20,), epoch=4, storage_epochs=(4,)))
    _report(t, 1, SnapshotReport((60,), epoch=5, storage_epochs=(5,)))
    assert t.views()["j"].storage_epochs == {1: {60: 5}}


def test_the_plan_names_the_epoch_of_each_copy_it_rolls_back_to() -> None:
    view = _recovery_view({1: _crash(1)}, tp=4)
    memory = {r: MemoryCopies("s2", S2, (40, 60), (3, 3)) for r in (0, 2, 3)}
    job = dataclasses.replace(view.jobs["j"], snapshots={r: (40, 60) for r in range(4)},
                              storage_epochs={r: {40: 2, 60: 3} for r in range(4)},
                              memory_snapshots=memory)
    view = dataclasses.replace(view, jobs={"j": job})
    (start,) = plan(_with_holders(view, s2=S2), 5.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert m.snapshot_step == 60
    assert m.snapshot_from == (memory_source("s2", S2, 3), storage_source(3),
                               memory_source("s2", S2, 3), memory_source("s2", S2, 3))
    assert Migration.decode(m.encode()) == m
