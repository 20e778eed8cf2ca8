"""Pure control-plane logic: planner, fence timer, lifecycle, records. No etcd, no sleeps."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable

import pytest

from understudy.common.errors import RecordError
from understudy.common.records import (
    CANNOT_RESHAPE,
    MAX_VALUE_BYTES,
    NO_REPLICA_COPY,
    PAUSED,
    Assignment,
    DrainRequest,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    MigrationKind,
    MigrationPhase,
    NodeRecord,
    RankExit,
    RegistryEntry,
    Report,
    ResizeRequest,
    StopRequest,
    StuckReport,
    decode_job_record,
    job_misfit,
    stopped_cleanly,
)
from understudy.common.states import IllegalTransition, NodeLifecycle, NodeState
from understudy.daemon import planner
from understudy.daemon.fencing import FenceTimer
from understudy.daemon.planner import (
    Action,
    AddStandbys,
    AdvanceMigration,
    AssignJob,
    ClusterView,
    JobView,
    MarkFailed,
    PruneEvents,
    SetJobState,
    StartMigration,
    hung_ranks,
)
from understudy.worker.migration import Plan, _paused, committed
from understudy.worker.recovery import RETRY_S, wait_for_recovery


def plan(view: ClusterView, now: float, max_events: int = 1000) -> list[Action]:
    """The planner's actions, each checked against the lifecycles: every job state and
    migration phase it writes is one the view's record may take (what the controller refuses
    otherwise, as a bug). Every test here plans through it."""
    actions = planner.plan(view, now, max_events=max_events)
    for action in actions:
        job = view.jobs.get(getattr(action, "job", ""))
        if isinstance(action, SetJobState):
            before = job.status.state if job is not None and job.status is not None \
                else JobState.PENDING
            assert before.can_become(action.state), (before, action)
        elif isinstance(action, AdvanceMigration):
            m = job.migration if job is not None else None
            assert m is not None and m.id == action.id and m.can_become(action.phase), (
                m and (m.kind, m.phase), action)
    return actions


def _entry(name: str, state: NodeState = NodeState.ACTIVE, offline: bool = False
           ) -> RegistryEntry:
    return RegistryEntry(name=name, incarnation="i1", state=state, updated_at=1.0,
                         offline=offline)


def _record(name: str) -> NodeRecord:
    return NodeRecord(name=name, incarnation="i1", lease=7, state=NodeState.ACTIVE,
                      role="active", slots=1)


def test_planner_fails_only_nodes_without_a_live_record() -> None:
    view = ClusterView(
        registry={"a": (_entry("a"), 10), "b": (_entry("b"), 11),
                  "c": (_entry("c", NodeState.FAILED), 12),
                  "d": (_entry("d", NodeState.DRAINED, offline=True), 13)},
        live={"a": _record("a")},
    )
    actions = plan(view, now=100.0)
    assert actions == [MarkFailed("b", 11, actions[0].reason)]  # type: ignore[union-attr]
    assert "lease expired" in actions[0].reason  # type: ignore[union-attr]


def test_planner_is_deterministic_and_prunes_oldest_events() -> None:
    view = ClusterView(registry={}, live={}, event_keys=tuple(f"e{i}" for i in range(5)))
    assert plan(view, 1.0, max_events=3) == plan(view, 2.0, max_events=3)
    (prune,) = plan(view, 1.0, max_events=3)
    assert isinstance(prune, PruneEvents) and prune.keys == ("e0", "e1")


def test_fence_timer_says_when_the_lease_can_no_longer_be_proven() -> None:
    t = FenceTimer(margin=0.75)
    assert not t.expired(1e9), "no lease, nothing to prove"
    t.arm(sent_at=10.0, ttl=3)
    assert t.deadline == pytest.approx(12.25)
    assert not t.expired(12.2) and t.expired(12.25)
    t.arm(sent_at=9.0, ttl=3)  # a late ack of an older keep-alive never shortens the deadline
    assert t.deadline == pytest.approx(12.25)
    t.arm(sent_at=11.0, ttl=3)
    assert t.deadline == pytest.approx(13.25)
    t.disarm()
    assert not t.expired(1e9)


def test_lifecycle_allows_only_documented_transitions() -> None:
    lc = NodeLifecycle()
    lc.transition(NodeState.ACTIVE, 1.0, "joined")
    lc.transition(NodeState.DRAINING, 2.0, "drain")
    lc.transition(NodeState.DRAINED, 3.0, "done")
    with pytest.raises(IllegalTransition):
        lc.transition(NodeState.DRAINING, 4.0, "again")
    lc.transition(NodeState.FAILED, 5.0, "lease lost")
    with pytest.raises(IllegalTransition):
        lc.transition(NodeState.ACTIVE, 6.0, "skip joining")
    lc.transition(NodeState.JOINING, 7.0, "rejoin")
    assert (lc.state, lc.since, lc.reason) == (NodeState.JOINING, 7.0, "rejoin")


def test_job_states_and_migration_phases_move_only_as_their_lifecycles_say() -> None:
    pending, running = JobState.PENDING, JobState.RUNNING
    assert {s for s in JobState if pending.can_become(s)} == {pending, running, JobState.FAILED,
                                                              JobState.STOPPED}
    assert {s for s in JobState if running.can_become(s)} == {running, JobState.DONE,
                                                              JobState.FAILED, JobState.STOPPED}
    assert not any(end.can_become(s) for end in JobState if end.ended for s in JobState)

    now = 1.0

    def migration(kind: MigrationKind, phase: MigrationPhase) -> Migration:
        return Migration(
            job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(0,), leavers=("a",),
            joiners=("s",), phase=phase, reason="r", created_at=now, deadline=now + 60,
            updated_at=now, kind=kind, donors=(1,) if kind == MigrationKind.RECOVERY else (),
            snapshot_step=4 if kind == MigrationKind.ROLLBACK else -1)

    def path(kind: MigrationKind, *phases: MigrationPhase) -> bool:
        return all(migration(kind, a).can_become(b) for a, b in itertools.pairwise(phases))

    p = MigrationPhase
    drain, recovery = MigrationKind.PLANNED, MigrationKind.RECOVERY
    assert path(drain, p.PLANNED, p.PREPARING, p.READY, p.SWITCHING, p.DONE)
    assert path(drain, p.READY, p.DONE)  # the joiners took over before the switch was seen
    assert not path(drain, p.PREPARING, p.DONE) and not path(drain, p.PLANNED, p.DONE)
    assert path(recovery, p.PLANNED, p.PREPARING, p.DONE)
    assert path(MigrationKind.ROLLBACK, p.PREPARING, p.DONE)
    assert not path(recovery, p.PLANNED, p.DONE)
    assert not path(drain, p.READY, p.PREPARING) and not path(drain, p.SWITCHING, p.READY)
    for kind in (drain, recovery):
        assert all(migration(kind, a).can_become(p.ABORTED) for a in p
                   if a not in (p.DONE, p.ABORTED))
        assert not any(migration(kind, end).can_become(b) for end in (p.DONE, p.ABORTED)
                       for b in p)
    restart = Migration(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(0, 1),
                        leavers=("a", "b"), joiners=("a", "s"), phase=p.PLANNED, reason="r",
                        created_at=now, deadline=now + 60, updated_at=now,
                        kind=MigrationKind.RESTART)
    assert restart.can_become(p.DONE)


def test_a_migration_kind_and_a_pause_are_typed_on_the_wire() -> None:
    m = Migration(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(0,), leavers=("a",),
                  joiners=("s",), phase=MigrationPhase.PLANNED, reason="r", created_at=1.0,
                  deadline=9.0, updated_at=1.0, kind="recovery", donors=(1,))  # type: ignore[arg-type]
    assert m.kind is MigrationKind.RECOVERY and Migration.decode(m.encode()) == m
    assert json.loads(m.encode())["kind"] == "recovery"
    with pytest.raises(RecordError, match="wrong type"):
        Migration.decode(m.encode().replace(b'"kind":"recovery"', b'"kind":"teleport"'))
    with pytest.raises(ValueError, match="is not one of planned, recovery"):
        dataclasses.replace(m, kind="teleport")
    paused = JobStatus(job="j", state=JobState.RUNNING, reason=PAUSED + "rank 1 lost",
                       updated_at=1.0, paused=True)
    assert JobStatus.decode(paused.encode()) == paused
    # A status written before the flag existed reads as not paused, whatever its words.
    old = json.loads(paused.encode())
    del old["paused"]
    assert not JobStatus.decode(json.dumps(old).encode()).paused
    with pytest.raises(RecordError, match="only a running job can be paused"):
        JobStatus.decode(paused.encode().replace(b'"state":"running"', b'"state":"done"'))


def test_records_round_trip() -> None:
    rec = _record("a")
    assert NodeRecord.decode(rec.encode()) == rec
    req = DrainRequest(node="a", reason="r", source="operator", requested_at=1.0, deadline=2.0)
    assert DrainRequest.decode(req.encode()) == req


@pytest.mark.parametrize("value, problem", [
    (b"\xff\xfe", "not UTF-8 JSON"),
    (b"{not json", "not UTF-8 JSON"),
    (b"[1]", "not a JSON object"),
    (json.dumps({"schema": "x/v1", "record": "node"}).encode(), "schema"),
    (json.dumps({"schema": "understudy/v1", "record": "drain"}).encode(), "record"),
    (json.dumps({"schema": "understudy/v1", "record": "node", "name": "a"}).encode(), "lacks"),
    (json.dumps({"schema": "understudy/v1", "record": "node", "name": "a", "incarnation": "i",
                 "lease": "7", "state": "active", "role": "r", "slots": 1}).encode(),
     "wrong type"),
    (json.dumps({"schema": "understudy/v1", "record": "node", "name": "a", "incarnation": "i",
                 "lease": 7, "state": "exploded", "role": "r", "slots": 1}).encode(),
     "wrong type"),
    (b" " * (MAX_VALUE_BYTES + 1), "exceeds"),
])
def test_bad_values_raise_record_error(value: bytes, problem: str) -> None:
    with pytest.raises(RecordError, match=problem):
        NodeRecord.decode(value)


def test_a_deadline_that_is_no_json_number_is_a_bad_value() -> None:
    # Python's json writes and reads NaN and Infinity; JSON has neither, and a NaN deadline
    # passes every "<= 0" check and is never reached (a drain went to drained in 13 ms).
    req = DrainRequest(node="a", source="cli", reason="r", requested_at=1.0, deadline=2.0)
    for constant in ("NaN", "Infinity", "-Infinity"):
        value = req.encode().replace(b'"deadline":2.0', b'"deadline":' + constant.encode())
        with pytest.raises(RecordError, match=f"{constant} is not a JSON number"):
            DrainRequest.decode(value)


def test_decoding_resolves_a_record_class_s_field_types_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Resolving the annotations was ~70 % of a decode; the controller decodes every node's
    # records on each re-list (seconds of a blocked event loop at 4,096 nodes).
    import typing

    from understudy.common import records

    monkeypatch.setattr(records, "_FIELD_TYPES", {})
    calls: list[object] = []
    real = typing.get_type_hints

    def counting(obj: object, *args: object, **kwargs: object) -> object:
        calls.append(obj)
        return real(obj, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(typing, "get_type_hints", counting)
    rec = _record("a")
    for _ in range(3):
        assert NodeRecord.decode(rec.encode()) == rec
    with pytest.raises(RecordError, match="wrong type"):
        NodeRecord.decode(rec.encode().replace(b'"slots":1', b'"slots":"1"'))
    assert calls == [NodeRecord]


def test_a_value_is_decoded_once_per_revision_and_bytes_and_forgotten_when_gone() -> None:
    from understudy.common.records import DecodedRecords
    from understudy.common.store import KV

    calls: list[bytes] = []

    def counting(value: bytes) -> NodeRecord:
        calls.append(value)
        return NodeRecord.decode(value)

    memo = DecodedRecords()
    a, b = _record("a"), _record("b")
    kv_a = KV(key="n/a", value=a.encode(), mod_revision=5, create_revision=5, lease=1)
    kv_b = KV(key="n/b", value=b.encode(), mod_revision=6, create_revision=6, lease=2)
    for _ in range(3):
        assert memo.decode(kv_a, counting) == a and memo.decode(kv_b, counting) == b
    assert len(calls) == 2
    # A new revision is decoded again; so is another value at a revision seen before (an etcd
    # restored from a backup, or built afresh, numbers its revisions again).
    a2 = dataclasses.replace(a, slots=4)
    assert memo.decode(dataclasses.replace(kv_a, value=a2.encode(), mod_revision=7),
                       counting) == a2
    kv_b = dataclasses.replace(kv_b, value=a2.encode())
    assert memo.decode(kv_b, counting) == a2
    assert len(calls) == 4
    # A bad value raises each time it is looked at, decoded once (a fresh error each time: a
    # raised one would keep every traceback it was raised through).
    bad = KV(key="n/c", value=b"{", mod_revision=8, create_revision=8, lease=0)
    errors = []
    for _ in range(2):
        with pytest.raises(RecordError, match="not UTF-8 JSON") as caught:
            memo.decode(bad, counting)
        errors.append(caught.value)
    assert errors[0] is not errors[1] and len(calls) == 5
    # A pass forgets what it did not see; a deleted key is forgotten at once.
    memo.begin()
    memo.decode(kv_b, counting)
    with pytest.raises(RecordError):
        memo.decode(bad, lambda v: pytest.fail("decoded again"))
    memo.end()
    assert len(memo) == 2
    memo.forget("n/c")
    assert len(memo) == 1
    with pytest.raises(RecordError):
        memo.decode(bad, counting)
    assert len(calls) == 6


def test_registry_entry_rejects_bool_for_float() -> None:
    body = json.loads(_entry("a").encode())
    body["updated_at"] = True
    with pytest.raises(RecordError):
        RegistryEntry.decode(json.dumps(body).encode())


def _spec(name: str = "j", tp: int = 2, dp: int = 2, standby: int = 1) -> JobSpec:
    return JobSpec(name=name, argv=("python", "t.py"), cwd="/", tp=tp, dp=dp, standby=standby,
                   created_at=0.0)


def test_job_records_are_read_by_one_decoder_that_refuses_another_job_s_record() -> None:
    spec, status = _spec("j"), JobStatus(job="j", state=JobState.RUNNING, reason="", updated_at=1)
    assert decode_job_record("j/spec", spec.encode()) == ("j", "spec", spec)
    assert decode_job_record("j/status", status.encode()) == ("j", "status", status)
    assert decode_job_record("j/exits/1/0", b"anything") is None  # the controller's alone
    with pytest.raises(RecordError, match="under 'k' names job 'j'"):
        decode_job_record("k/spec", spec.encode())
    with pytest.raises(RecordError, match="under 'k' names job 'j'"):
        decode_job_record("k/status", status.encode())
    with pytest.raises(RecordError):
        decode_job_record("j/status", spec.encode())


def test_records_valid_alone_that_do_not_fit_together_are_named() -> None:
    spec = _spec("j")  # TP 2 x DP 2: four ranks, in replicas of two

    def a(*ranks: str) -> Assignment:
        return Assignment(job="j", epoch=1, ranks=ranks, standbys=("s",), reason="",
                          updated_at=0)

    def m(kind: str = "planned", ranks: tuple[int, ...] = (3,), leaver: str = "b",
          donors: tuple[int, ...] = (), replicas: tuple[int, ...] = (),
          from_dp: int = 0) -> Migration:
        return Migration(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=ranks,
                         leavers=(leaver,) * len(ranks), joiners=("s",) * len(ranks),
                         kind=kind, phase=MigrationPhase.PLANNED, reason="", created_at=1.0,
                         deadline=9.0, updated_at=1.0, donors=donors, replicas=replicas,
                         from_dp=from_dp)

    four, two = a("a", "a", "b", "b"), a("a", "a")
    assert job_misfit(spec, four, None) is None
    assert job_misfit(spec, two, None) is None  # shrunk to one replica
    assert job_misfit(spec, four, m()) is None
    assert job_misfit(spec, four, m("recovery", (1,), donors=(3,))) is None
    grow = m("reshape", (2, 3), leaver="", donors=(0, 1), replicas=(0, -1), from_dp=1)
    assert job_misfit(spec, two, grow) is None
    assert "places 5 rank(s); the job has 4, in replicas of 2" in str(
        job_misfit(spec, a("a", "a", "b", "b", "c"), None))
    assert "places 3 rank(s)" in str(job_misfit(spec, a("a", "a", "b"), None))
    assert "names rank(s) [4] of a world of 4" in str(job_misfit(spec, four, m(ranks=(4,))))
    assert "names rank(s) [1, 7] of a world of 4" in str(
        job_misfit(spec, four, m("recovery", (1,), donors=(7,))))
    assert "names rank(s) [3] of a world of 2" in str(job_misfit(spec, two, m()))
    too_big = m("reshape", (), leaver="", replicas=(0, 1, -1), from_dp=2)
    assert "makes 3 replica(s) of 2; the job has 4 rank(s)" in str(
        job_misfit(spec, four, too_big))


def _live(name: str, state: NodeState, slots: int) -> NodeRecord:
    return NodeRecord(name=name, incarnation="i", lease=1, state=state, role=str(state),
                      slots=slots)


def _cluster(**jobs: JobView) -> ClusterView:
    live = {"a": _live("a", NodeState.ACTIVE, 2), "b": _live("b", NodeState.ACTIVE, 2),
            "c": _live("c", NodeState.DRAINING, 8), "s": _live("s", NodeState.STANDBY, 1)}
    return ClusterView(registry={n: (_entry(n), 1) for n in live}, live=live, jobs=jobs)


def test_placement_fills_active_slots_in_order_and_reserves_standbys() -> None:
    (action,) = plan(_cluster(j=JobView(_spec())), now=5.0)
    assert isinstance(action, AssignJob)
    a = action.assignment
    assert (a.ranks, a.standbys, a.epoch) == (("a", "a", "b", "b"), ("s",), 1)


def test_jobs_pending_in_one_round_are_placed_on_different_slots_and_standbys() -> None:
    # Four free slots on a and b, one standby node: j1 (2 ranks, no standby) takes a, j2 (2
    # ranks, 1 standby) takes b and s; j3 finds nothing left and says so.
    view = _cluster(j1=JobView(_spec("j1", tp=2, dp=1, standby=0)),
                    j2=JobView(_spec("j2", tp=2, dp=1, standby=1)),
                    j3=JobView(_spec("j3", tp=1, dp=1, standby=0)))
    first, second, third = plan(view, now=5.0)
    assert isinstance(first, AssignJob) and isinstance(second, AssignJob)
    assert (first.assignment.ranks, first.assignment.standbys) == (("a", "a"), ())
    assert (second.assignment.ranks, second.assignment.standbys) == (("b", "b"), ("s",))
    assert isinstance(third, SetJobState) and third.state == JobState.PENDING
    assert "needs 1 slots on active nodes, 0 are free" in third.reason
    # A standby wanted by two jobs in one round goes to the first.
    view = _cluster(j1=JobView(_spec("j1", tp=1, dp=1, standby=1)),
                    j2=JobView(_spec("j2", tp=1, dp=1, standby=1)))
    first, second = plan(view, now=5.0)
    assert isinstance(first, AssignJob) and first.assignment.standbys == ("s",)
    assert isinstance(second, SetJobState) and "needs 1 standby nodes, 0 are free" in \
        second.reason


def test_placement_that_cannot_fit_says_why_once() -> None:
    view = _cluster(j=JobView(_spec(tp=4, dp=2)))
    (action,) = plan(view, now=5.0)
    assert isinstance(action, SetJobState) and action.state == JobState.PENDING
    assert "needs 8 slots" in action.reason
    status = JobStatus(job="j", state=JobState.PENDING, reason=action.reason, updated_at=5.0)
    assert plan(_cluster(j=JobView(_spec(tp=4, dp=2), status=status)), now=6.0) == []


def test_job_ends_done_or_pauses_without_a_standby_pool() -> None:
    a = Assignment(job="j", epoch=1, ranks=("a", "b"), standbys=(), reason="", updated_at=0)
    running = JobStatus(job="j", state=JobState.RUNNING, reason="", updated_at=0)

    def exit_(rank: int, code: int) -> RankExit:
        return RankExit(job="j", rank=rank, epoch=1, node="a", returncode=code,
                        failed=code != 0, description=f"code {code}", time=float(rank))

    spec = _spec(tp=1, dp=2, standby=0)
    done = plan(_cluster(j=JobView(spec, running, a, {0: exit_(0, 0), 1: exit_(1, 0)})), 1.0)
    assert done == [SetJobState("j", JobState.DONE, "every rank finished")]
    # Started with --standby 0: a crash takes the one free standby node there is (s)...
    (refill,) = plan(_cluster(j=JobView(spec, running, a, {1: exit_(1, 3)})), 1.0)
    assert isinstance(refill, AddStandbys) and refill.assignment.standbys == ("s",)
    # ... and with none anywhere the job pauses, its survivors holding their state: it is
    # never failed for want of a pool.
    bare = _cluster(j=JobView(spec, running, a, {1: exit_(1, 3)}))
    del bare.live["s"]  # type: ignore[attr-defined]
    (paused,) = [x for x in plan(bare, 1.0) if isinstance(x, SetJobState)]
    assert paused.state == JobState.RUNNING and paused.event == "job-paused" and paused.paused
    assert "rank 1 failed on a: code 3; waiting for a standby to take over (0 free, 1 needed)" \
        in paused.reason
    # The job's own code failed (an exception it raised, not a signal, a lost node or one of
    # understudy's errors): with no standby of its pool free it fails with the cause, never
    # waits, and never takes standbys beyond its pool to retry.
    raised = dataclasses.replace(exit_(1, 1), error_type="RuntimeError",
                                 description="code 1: RuntimeError: bad batch")
    (failed,) = plan(_cluster(j=JobView(spec, running, a, {1: raised})), 1.0)
    assert isinstance(failed, SetJobState) and failed.state == JobState.FAILED
    assert "RuntimeError: bad batch; the job's own code failed (rank 1)" in failed.reason
    ours = dataclasses.replace(raised, error_type="understudy.groups.errors.GroupBuildError")
    (refill,) = plan(_cluster(j=JobView(spec, running, a, {1: ours})), 1.0)
    assert isinstance(refill, AddStandbys)
    lost_view = _cluster(j=JobView(spec, running, a))
    del lost_view.live["s"], lost_view.live["b"]  # type: ignore[attr-defined]
    actions = plan(lost_view, 1.0)
    assert any(isinstance(x, MarkFailed) and x.node == "b" for x in actions)
    (lost,) = [x for x in actions if isinstance(x, SetJobState)]
    assert lost.state == JobState.RUNNING and "node b holding rank 1 is gone" in lost.reason


def test_a_stopped_job_ends_once_its_ranks_finish_or_its_grace_runs_out() -> None:
    stop = StopRequest(job="j", requested_at=10.0, grace=30.0, requested_by="op@h")
    # Not placed yet: stopped at once.
    (action,) = plan(_cluster(j=JobView(_spec(), stop=stop)), now=11.0)
    assert action == SetJobState("j", JobState.STOPPED, "stopped by op@h before it was placed")

    def exit_(rank: int, code: int = 0) -> RankExit:
        return RankExit(job="j", rank=rank, epoch=3, node="a", returncode=code,
                        failed=code != 0, description=f"code {code}", time=12.0)

    def stopping(exits: dict[int, RankExit], drop: tuple[str, ...] = ()) -> ClusterView:
        view = _recovery_view(exits, drop=drop)
        return dataclasses.replace(view, jobs={"j": dataclasses.replace(view.jobs["j"],
                                                                         stop=stop)})

    # Ranks finishing: nothing planned (no recovery, no migration) until every one has.
    assert plan(stopping({0: exit_(0), 1: exit_(1)}), now=12.0) == []
    (done,) = plan(stopping({r: exit_(r) for r in range(4)}), now=13.0)
    assert done.state == JobState.STOPPED and stopped_cleanly(JobStatus(
        job="j", state=done.state, reason=done.reason, updated_at=13.0))
    # A rank that failed, or whose node went, while the others stop: stopped, not recovered.
    (crashed,) = plan(stopping({0: exit_(0), 1: exit_(1, -9)}), now=13.0)
    assert crashed == SetJobState("j", JobState.STOPPED, "stopped by op@h: rank 1 failed "
                                  "while stopping; rank(s) 2, 3 stopped as they were")
    gone = [a for a in plan(stopping({}, drop=("b",)), now=13.0) if isinstance(a, SetJobState)]
    assert gone and "rank 2's node b is gone" in gone[0].reason
    # The grace runs out with ranks 2 and 3 still running: stopped, and they are named.
    assert plan(stopping({0: exit_(0), 1: exit_(1)}), now=39.9) == []
    (late,) = plan(stopping({0: exit_(0), 1: exit_(1)}), now=40.0)
    assert late.state == JobState.STOPPED and not stopped_cleanly(JobStatus(
        job="j", state=late.state, reason=late.reason, updated_at=40.0))
    assert "rank(s) 2, 3 did not finish within the grace of 30 s" in late.reason
    # An ended job stays as it is.
    ended = stopping({})
    ended = dataclasses.replace(ended, jobs={"j": dataclasses.replace(
        ended.jobs["j"], status=JobStatus(job="j", state=JobState.STOPPED, reason="x",
                                          updated_at=1.0))})
    assert plan(ended, now=50.0) == []
    with pytest.raises(ValueError, match="grace"):
        StopRequest(job="j", requested_at=1.0, grace=0.0)


def test_a_job_short_of_standbys_takes_more_than_its_standby_count() -> None:
    # --standby 1, one free standby (s1), ranks 0 and 3 lost at once: 1 free, 2 needed. A
    # standby node that joins (s2) is taken into the pool although the count says 1, and the
    # next round recovers both ranks.
    view = _recovery_view({0: _crash(0), 3: _crash(3, "b")}, standbys=("s1",))
    job = view.jobs["j"]
    view = dataclasses.replace(view, jobs={"j": dataclasses.replace(
        job, spec=_spec(standby=1))})
    (refill,) = plan(view, 5.0)
    assert isinstance(refill, AddStandbys) and refill.assignment.standbys == ("s1", "s2")
    view = _recovery_view({0: _crash(0), 3: _crash(3, "b")}, standbys=("s1", "s2"))
    (start,) = plan(view, 6.0)
    assert isinstance(start, StartMigration) and start.migration.ranks == (0, 3)
    assert start.migration.joiners == ("s1", "s2")
    # A cordoned standby in the pool takes no rank, so it does not count as one that can.
    view = _recovery_view({0: _crash(0), 3: _crash(3, "b")}, standbys=("s1",))
    view = dataclasses.replace(view, registry={**view.registry, "s1": (
        dataclasses.replace(_entry("s1"), cordoned=True), 1)})
    (refill,) = plan(view, 5.0)
    assert isinstance(refill, AddStandbys) and refill.assignment.standbys == ("s1", "s2")


def _recovery_view(exits: dict[int, RankExit] | None = None, drop: tuple[str, ...] = (),
                   standbys: tuple[str, ...] = ("s1", "s2"), tp: int = 2,
                   status_reason: str = "", paused: bool = False) -> ClusterView:
    a = Assignment(job="j", epoch=3, ranks=("a", "a", "b", "b"), standbys=standbys,
                   reason="", updated_at=0)
    running = JobStatus(job="j", state=JobState.RUNNING, reason=status_reason, updated_at=0,
                        paused=paused)
    live = {"a": _live("a", NodeState.ACTIVE, 2), "b": _live("b", NodeState.ACTIVE, 2),
            "s1": _live("s1", NodeState.STANDBY, 1), "s2": _live("s2", NodeState.STANDBY, 1)}
    for n in drop:
        live.pop(n)
    return ClusterView(registry={n: (_entry(n), 1) for n in ("a", "b", "s1", "s2")},
                       live=live, jobs={"j": JobView(_spec(tp=tp, dp=4 // tp), running, a,
                                                     exits=exits or {})})


def _crash(rank: int, node: str = "a") -> RankExit:
    return RankExit(job="j", rank=rank, epoch=3, node=node, returncode=-9, failed=True,
                    description="killed by SIGKILL", time=1.0)


def test_a_crashed_rank_is_recovered_from_its_data_parallel_replica() -> None:
    (start,) = plan(_recovery_view({1: _crash(1)}), 5.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert m.kind == "recovery" and m.ranks == (1,) and m.leavers == ("a",)
    assert m.joiners == ("s1",) and m.donors == (3,)  # rank 3 holds tp index 1 too
    assert (m.from_epoch, m.to_epoch) == (3, 4) and "killed by SIGKILL" in m.reason


def test_a_lost_node_is_recovered_rank_by_rank_onto_as_many_standbys() -> None:
    actions = plan(_recovery_view(drop=("b",)), 5.0)
    (start,) = [x for x in actions if isinstance(x, StartMigration)]
    m = start.migration
    assert m.ranks == (2, 3) and m.joiners == ("s1", "s2") and m.donors == (0, 1)


def test_a_recovery_of_a_lost_node_stands_only_while_that_node_has_no_record() -> None:
    # The controller writes it comparing each absent node's record to "none": a node that
    # joined again meanwhile (and kept its ranks: JobRunner.readopt) makes it fail.
    (start,) = [x for x in plan(_recovery_view(drop=("b",)), 5.0)
                if isinstance(x, StartMigration)]
    assert start.absent == ("b",)
    (crash,) = plan(_recovery_view({1: _crash(1)}), 5.0)
    assert isinstance(crash, StartMigration) and crash.absent == ()


def test_a_mass_disruption_is_held_no_node_failed_and_no_rank_recovered_until_it_ends() -> None:
    view = dataclasses.replace(_recovery_view(drop=("a", "b", "s1")), hold_losses_until=8.0)
    assert plan(view, 5.0) == []  # neither MarkFailed nor a recovery while held
    # A crashed rank is evidence of its own: it is recovered even during the hold.
    crashed = dataclasses.replace(_recovery_view({1: _crash(1)}), hold_losses_until=8.0)
    assert any(isinstance(x, StartMigration) for x in plan(crashed, 5.0))
    # Once the hold is over, nodes still without a record are lost.
    after = plan(view, 8.0)
    assert {x.node for x in after if isinstance(x, MarkFailed)} == {"a", "b", "s1"}
    # The probes' word on a node waits out the hold as well: etcd woke and revoked every
    # lease, and a daemon joining again answers its probes as a new incarnation, which to
    # the prober is the old one gone silent (seen in test_outage.py: a recovery planned for
    # a node that was about to take its ranks back, just before the next outage).
    silent = dataclasses.replace(view, evidence={"b": "it answered no probe for 0.61 s"})
    assert plan(silent, 5.0) == []
    assert {(x.node, x.reason) for x in plan(silent, 8.0) if isinstance(x, MarkFailed)} >= {
        ("b", "it answered no probe for 0.61 s")}


def test_a_node_is_lost_only_once_it_had_no_record_for_the_settle_time() -> None:
    view = dataclasses.replace(_recovery_view(drop=("b",)), absent_since={"b": 4.5},
                               loss_settle=1.0)
    assert plan(view, 5.0) == []  # a revoked lease's node is back within a keep-alive
    after = plan(view, 5.5)
    assert any(isinstance(x, MarkFailed) and x.node == "b" for x in after)
    assert any(isinstance(x, StartMigration) for x in after)


def test_recovery_without_a_replica_fails_the_job_with_the_reason() -> None:
    (failed,) = plan(_recovery_view({1: _crash(1)}, tp=4), 5.0)
    assert isinstance(failed, SetJobState) and failed.state == JobState.FAILED
    assert "no live data-parallel replica" in failed.reason


def _stuck(view: ClusterView, waits: dict[int, float], at: float = 100.0, epoch: int = 3,
           after: float = 10.0) -> ClusterView:
    """``view`` with job j's ranks ``waits`` (rank -> seconds) reporting they wait, at ``at``."""
    job = view.jobs["j"]
    stuck = {r: StuckReport(job="j", rank=r, epoch=epoch, step=40, waited=w,
                            what="the DP gradient all-reduce", at=at, after=after)
             for r, w in waits.items()}
    return dataclasses.replace(view, jobs={"j": dataclasses.replace(job, stuck=stuck)})


def test_the_one_rank_its_peers_wait_on_is_taken_for_hung_and_recovered() -> None:
    # Ranks 0, 1 and 3 have waited 16 s (past 1.5 x their 10 s) in collectives: rank 2, held
    # and not waiting, hangs; it is recovered from its replica like a failed rank.
    (start,) = plan(_stuck(_recovery_view(tp=1), {0: 16.0, 1: 16.0, 3: 15.5}), 100.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert m.kind == "recovery" and m.ranks == (2,) and m.donors == (3,)
    assert "rank 2 on b hangs: rank(s) 0, 1, 3 have waited on it for 16 s (in the DP " \
           "gradient all-reduce)" in m.reason
    # The same 6 s later by the controller's clock: the wait goes on, so does the verdict.
    assert plan(_stuck(_recovery_view(tp=1), {0: 10.0, 1: 16.0, 3: 15.5}, at=100.0), 106.0)
    # A hung TP pair (both ranks of node b, say its GPU): two waiting name the two others.
    view = _stuck(_recovery_view(tp=2), {0: 16.0, 1: 16.0})
    assert set(hung_ranks(view.jobs["j"], view.jobs["j"].assignment, 100.0)) == {2, 3}  # type: ignore


@pytest.mark.parametrize("waits, now, at, epoch, why", [
    ({0: 12.0, 1: 12.0, 3: 12.0}, 100.0, 100.0, 3, "not yet 1.5 x the report threshold"),
    ({3: 16.0}, 100.0, 100.0, 3, "one waiter names no one: three suspects of four"),
    ({0: 16.0}, 100.0, 100.0, 3, "one waiter, three not waiting"),
    ({0: 16.0, 1: 16.0, 3: 16.0}, 131.0, 100.0, 3, "the reports are stale"),
    ({0: 16.0, 1: 16.0, 3: 16.0}, 100.0, 100.0, 2, "the reports are of another epoch"),
    ({0: 16.0, 1: 16.0, 2: 16.0, 3: 16.0}, 100.0, 100.0, 3, "every rank waits"),
])
def test_no_rank_is_taken_for_hung_on_thin_evidence(waits: dict[int, float], now: float,
                                                    at: float, epoch: int, why: str) -> None:
    view = _stuck(_recovery_view(tp=1), waits, at=at, epoch=epoch)
    assert hung_ranks(view.jobs["j"], view.jobs["j"].assignment, now) == {}, why  # type: ignore
    assert plan(view, now) == [], why


def test_a_hung_rank_without_a_replica_never_fails_the_job() -> None:
    # TP 4: no replica holds rank 2's state. A failed rank would fail the job; a suspicion
    # leaves it to the waiting ranks' own timeouts.
    view = _stuck(_recovery_view(tp=4), {0: 16.0, 1: 16.0, 3: 16.0})
    assert hung_ranks(view.jobs["j"], view.jobs["j"].assignment, 100.0)  # type: ignore
    assert plan(view, 100.0) == []


def test_a_recovery_donor_is_the_next_data_parallel_rank() -> None:
    # DP 4 (TP 1): rank 1's donor is rank 2, where a job that shards its optimizer state keeps
    # rank 1's copy; rank 3's is rank 0 (around the group); with rank 2 gone too, rank 3.
    (start,) = plan(_recovery_view({1: _crash(1)}, tp=1), 5.0)
    assert isinstance(start, StartMigration) and start.migration.donors == (2,)
    (start,) = plan(_recovery_view({3: _crash(3, "b")}, tp=1), 5.0)
    assert isinstance(start, StartMigration) and start.migration.donors == (0,)
    (start,) = plan(_recovery_view({1: _crash(1), 2: _crash(2, "b")}, tp=1), 5.0)
    assert isinstance(start, StartMigration) and start.migration.donors == (3, 3)


def test_a_recovery_whose_donor_keeps_no_copy_is_not_planned_from_a_replica_again() -> None:
    view = _recovery_view({1: _crash(1)}, tp=1)
    (start,) = plan(view, 5.0)
    assert isinstance(start, StartMigration)
    why = f"{NO_REPLICA_COPY}rank 1's optimizer shard exists nowhere else"
    aborted = dataclasses.replace(start.migration, phase=MigrationPhase.ABORTED, outcome=why)
    job = view.jobs["j"]
    again = dataclasses.replace(view, jobs={"j": dataclasses.replace(job, migration=aborted)})
    (failed,) = plan(again, 6.0)  # no snapshots: no rollback either
    assert isinstance(failed, SetJobState) and failed.state == JobState.FAILED
    assert "rank 1's optimizer shard exists nowhere else" in failed.reason
    # Called off for another reason, the next attempt takes a replica again.
    other = dataclasses.replace(aborted, outcome="joiner node s1 is gone")
    retry = dataclasses.replace(view, jobs={"j": dataclasses.replace(job, migration=other)})
    (start,) = plan(retry, 6.0)
    assert isinstance(start, StartMigration) and start.migration.donors == (2,)


def test_an_exhausted_pool_pauses_the_job_once_and_a_refill_resumes_it() -> None:
    view = _recovery_view({1: _crash(1)}, standbys=("s1", "s2"), drop=("s1", "s2"))
    paused = next(x for x in plan(view, 5.0) if not isinstance(x, MarkFailed))
    assert isinstance(paused, SetJobState) and paused.state == JobState.RUNNING
    assert paused.event == "job-paused" and "waiting for a standby" in paused.reason
    again = _recovery_view({1: _crash(1)}, standbys=("s1", "s2"), drop=("s1", "s2"),
                           status_reason=paused.reason, paused=True)
    assert [x for x in plan(again, 6.0) if not isinstance(x, MarkFailed)] == []  # said once
    # Capacity returns (a standby node comes online): it joins the pool, then the rank is
    # recovered onto it, then the job says it resumed.
    returned = _recovery_view({1: _crash(1)}, standbys=(), status_reason=paused.reason,
                              paused=True)
    (refill,) = plan(returned, 7.0)
    assert isinstance(refill, AddStandbys)
    assert refill.assignment.standbys == ("s1",) and refill.assignment.epoch == 3
    refilled = _recovery_view({1: _crash(1)}, standbys=("s1",), status_reason=paused.reason,
                              paused=True)
    (start,) = plan(refilled, 8.0)
    assert isinstance(start, StartMigration) and start.migration.joiners == ("s1",)
    # A failure of the job's own code is retried on a free standby of its pool, like a crash.
    raised = dataclasses.replace(_crash(1), returncode=1, error_type="ValueError")
    (retry,) = plan(_recovery_view({1: raised}, standbys=("s1",)), 8.0)
    assert isinstance(retry, StartMigration) and retry.migration.joiners == ("s1",)
    healed = _recovery_view(standbys=(), status_reason=paused.reason, paused=True)
    resumed = [x for x in plan(healed, 9.0) if isinstance(x, SetJobState)]
    assert resumed and resumed[0].event == "job-resumed" and not resumed[0].paused
    # Only the flag says the job is paused: the same words without it are no pause to end.
    worded = _recovery_view(standbys=(), status_reason=paused.reason)
    assert [x for x in plan(worded, 9.0) if isinstance(x, SetJobState)] == []


def _reshape_view(exits: dict[int, RankExit] | None = None, drop: tuple[str, ...] = (),
                  tp: int = 1) -> ClusterView:
    """DP 4 / tp on nodes a, a, b, b with no standby node online; the job may reshape."""
    view = _recovery_view(exits, drop=(*drop, "s1", "s2"), standbys=(), tp=tp)
    job = view.jobs["j"]
    spec = dataclasses.replace(job.spec, reshape=True)
    return dataclasses.replace(view, jobs={"j": dataclasses.replace(job, spec=spec)},
                               registry={n: e for n, e in view.registry.items()
                                         if n not in ("s1", "s2")})


def test_a_job_that_may_reshape_drops_a_lost_replica_instead_of_pausing() -> None:
    # DP 4 (TP 1): rank 1 crashed; replicas 0, 2 and 3 train on as ranks 0, 1 and 2.
    (start,) = plan(_reshape_view({1: _crash(1)}), 5.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert m.kind == "reshape" and m.replicas == (0, 2, 3) and m.from_dp == 4
    assert (m.ranks, m.leavers, m.joiners) == ((), (), ())
    assert m.renumbering(tp=1, pp=1) == {0: 0, 2: 1, 3: 2}
    assert "DP 4 -> 3" in start.reason and start.absent == ()
    # TP 2: node b lost takes replica 1 whole; replica 0 stays, its ranks keep their numbers.
    (start,) = [x for x in plan(_reshape_view(drop=("b",), tp=2), 5.0)
                if isinstance(x, StartMigration)]
    assert start.migration.replicas == (0,) and start.absent == ("b",)
    assert start.migration.renumbering(tp=2, pp=1) == {0: 0, 1: 1}
    # No replica left whole (TP 2, a rank of each lost): the job pauses as before.
    both = plan(_reshape_view({1: _crash(1), 2: _crash(2, "b")}, tp=2), 5.0)
    assert [x.event for x in both if isinstance(x, SetJobState)] == ["job-paused"]


def _planned(view: ClusterView) -> tuple[StartMigration, Callable[[set[str]], ClusterView]]:
    """The migration the planner starts for ``view``'s job, and ``view`` with it under way and
    given reports."""
    (start,) = plan(view, 5.0)
    assert isinstance(start, StartMigration)
    job = view.jobs["j"]

    def at(progress: set[str]) -> ClusterView:
        return dataclasses.replace(view, jobs={"j": dataclasses.replace(
            job, migration=start.migration, progress=frozenset(progress))})

    return start, at


def test_a_reshape_commits_once_every_rank_that_stays_holds_the_new_shape() -> None:
    view = _reshape_view({1: _crash(1)})
    start, at = _planned(view)
    job = view.jobs["j"]

    assert plan(at({Report.RESHAPED.of(0), Report.RESHAPED.of(2)}), 6.0) == []
    (done,) = plan(at({Report.RESHAPED.of(r) for r in (0, 2, 3)}), 6.0)
    assert isinstance(done, AdvanceMigration) and done.phase == MigrationPhase.DONE
    assert done.assignment is not None and done.assignment.epoch == 4
    assert done.assignment.migration == start.migration.id  # the epoch's maker, for laggards
    assert done.assignment.ranks == ("a", "b", "b")  # old ranks 0, 2, 3 renumbered 0, 1, 2
    # A rank that stays and fails before it reshaped calls the reshape off.
    failed = dataclasses.replace(view, jobs={"j": dataclasses.replace(
        job, migration=start.migration, exits={1: _crash(1), 3: _crash(3, "b")})})
    (off,) = plan(failed, 6.0)
    assert isinstance(off, AdvanceMigration) and off.phase == MigrationPhase.ABORTED
    assert "rank 3 failed" in off.reason


def test_the_surviving_nodes_of_a_dropped_replica_stand_by_for_the_job() -> None:
    # TP 2 on a, a, b, b: rank 1's process died, node a lives on. Replica 0 is dropped; at the
    # commit node a, holding nothing now, becomes a standby of the job in the same write.
    view = _reshape_view({1: _crash(1)}, tp=2)
    _, at = _planned(view)
    (done,) = plan(at({Report.RESHAPED.of(r) for r in (2, 3)}), 6.0)
    assert isinstance(done, AdvanceMigration) and done.assignment is not None
    assert done.assignment.ranks == ("b", "b") and done.assignment.standbys == ("a",)
    assert "a stand by for it now" in done.reason
    # Not a draining node (it leaves), a cordoned one, or one that holds another job's rank.
    for state in (NodeState.DRAINING,):
        live = {**view.live, "a": dataclasses.replace(view.live["a"], state=state)}
        _, at = _planned(dataclasses.replace(view, live=live))
        (done,) = plan(at({Report.RESHAPED.of(r) for r in (2, 3)}), 6.0)
        assert isinstance(done, AdvanceMigration) and done.assignment is not None
        assert done.assignment.standbys == ()
    entry, rev = view.registry["a"]
    cordoned = dataclasses.replace(view, registry={
        **view.registry, "a": (dataclasses.replace(entry, cordoned=True), rev)})
    _, at = _planned(cordoned)
    (done,) = plan(at({Report.RESHAPED.of(r) for r in (2, 3)}), 6.0)
    assert isinstance(done, AdvanceMigration) and done.assignment is not None
    assert done.assignment.standbys == ()


def test_a_job_whose_ranks_cannot_reshape_pauses_after_the_refusal() -> None:
    view = _reshape_view({1: _crash(1)})
    (start,) = plan(view, 5.0)
    assert isinstance(start, StartMigration)
    refused = dataclasses.replace(start.migration, phase=MigrationPhase.ABORTED,
                                  outcome=f"{CANNOT_RESHAPE}rank 0: PlainJob is not a SlottedJob")
    job = view.jobs["j"]
    again = dataclasses.replace(view, jobs={"j": dataclasses.replace(job, migration=refused)})
    (paused,) = plan(again, 6.0)
    assert isinstance(paused, SetJobState) and paused.event == "job-paused"


def _shrunk_view(standbys: tuple[str, ...] = ("s1", "s2"), tp: int = 1) -> ClusterView:
    """A --reshape job of 4 slots (DP 4 / tp) that shrank to DP 2 / tp on a and b; standby
    nodes s1 and s2 online and free."""
    view = _recovery_view(standbys=(), tp=tp)
    job = view.jobs["j"]
    assert job.assignment is not None
    shrunk = dataclasses.replace(job.assignment, ranks=("a", "b") if tp == 1 else ("a", "a"),
                                 standbys=standbys)
    up = {"j": {"mode": "imports", "roles": [], "detail": "", "since": 0.0}}
    live = {n: dataclasses.replace(r, warmth=up) if n in ("s1", "s2") else r
            for n, r in view.live.items()}
    return dataclasses.replace(view, live=live, jobs={"j": dataclasses.replace(
        job, spec=dataclasses.replace(job.spec, reshape=True), assignment=shrunk)})


def test_a_job_that_shrank_grows_back_onto_free_standbys() -> None:
    (start,) = plan(_shrunk_view(), 5.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert m.kind == "reshape" and m.replicas == (0, 1, -1, -1) and m.from_dp == 2
    assert m.ranks == (2, 3) and m.joiners == ("s1", "s2") and m.donors == (0, 0)
    assert "DP 2 -> 4" in start.reason
    # Standbys not in its pool yet are taken into it first; fewer than a replica: none.
    (refill,) = plan(_shrunk_view(standbys=()), 5.0)
    assert isinstance(refill, AddStandbys) and refill.assignment.standbys == ("s1", "s2")
    # Standbys in its pool whose workers are not up yet (no warmth): not yet.
    cold = _shrunk_view()
    cold = dataclasses.replace(cold, live={n: dataclasses.replace(r, warmth={})
                                           for n, r in cold.live.items()})
    assert plan(cold, 5.0) == []
    (start,) = plan(_shrunk_view(standbys=("s1", "s2"), tp=2), 5.0)  # TP 2: one replica more
    assert isinstance(start, StartMigration) and start.migration.ranks == (2, 3)
    assert start.migration.donors == (0, 1) and start.migration.replicas == (0, -1)
    view = _shrunk_view(standbys=("s1",), tp=2)
    view = dataclasses.replace(view, live={n: r for n, r in view.live.items() if n != "s2"},
                               registry={n: e for n, e in view.registry.items() if n != "s2"})
    assert plan(view, 5.0) == []
    # A job that may not reshape stays as it is.
    job = _shrunk_view().jobs["j"]
    fixed = dataclasses.replace(job, spec=dataclasses.replace(job.spec, reshape=False))
    assert not [x for x in plan(dataclasses.replace(_shrunk_view(), jobs={"j": fixed}), 5.0)
                if isinstance(x, StartMigration)]


def test_a_grow_binds_its_joiners_then_commits_the_larger_shape() -> None:
    view = _shrunk_view()
    _, at = _planned(view)

    (bound,) = plan(at({Report.BOUND.of(2), Report.BOUND.of(3)}), 6.0)
    assert isinstance(bound, AdvanceMigration) and bound.phase == MigrationPhase.PREPARING
    (done,) = plan(at({Report.RESHAPED.of(0), Report.RESHAPED.of(1)}), 7.0)
    assert isinstance(done, AdvanceMigration) and done.phase == MigrationPhase.DONE
    assert done.assignment is not None and done.assignment.ranks == ("a", "b", "s1", "s2")
    assert done.assignment.standbys == ()
    # A joiner's node lost before the commit calls it off.
    gone = dataclasses.replace(at(set()), live={n: r for n, r in view.live.items()
                                               if n != "s2"})
    (off,) = [x for x in plan(gone, 6.0) if isinstance(x, AdvanceMigration)]
    assert off.phase == MigrationPhase.ABORTED and "s2 is gone" in off.reason


def test_the_operator_s_resize_shrinks_at_once_and_caps_the_grow() -> None:
    view = _shrunk_view()  # DP 2 of 4, standbys s1 and s2 free
    job = view.jobs["j"]

    def resized(dp: int) -> ClusterView:
        r = ResizeRequest(job="j", dp=dp, requested_at=1.0, requested_by="ops@host")
        return dataclasses.replace(view, jobs={"j": dataclasses.replace(job, resize=r)})

    (down,) = plan(resized(1), 5.0)
    assert isinstance(down, StartMigration) and down.migration.replicas == (0,)
    assert "reshape to the operator's size: DP 2 -> 1" in down.reason
    assert "resized to DP 1 by ops@host" in down.migration.reason
    (up,) = plan(resized(3), 5.0)  # two standbys would make two replicas: one is wanted
    assert isinstance(up, StartMigration) and up.migration.replicas == (0, 1, -1)
    assert up.migration.ranks == (2,) and up.migration.joiners == ("s1",)
    assert not [x for x in plan(resized(2), 5.0) if isinstance(x, StartMigration)]
    (full,) = plan(resized(9), 5.0)  # a foreign value beyond its slots: all of them
    assert isinstance(full, StartMigration) and full.migration.replicas == (0, 1, -1, -1)


def test_a_drain_with_no_standby_free_shrinks_a_job_that_may_reshape() -> None:
    view, _ = _migrating_view()
    job = dataclasses.replace(view.jobs["j"], migration=None)
    live = {n: r for n, r in view.live.items() if n not in ("s1", "s2")}
    bare = dataclasses.replace(view, live=live, jobs={"j": job},
                               registry={n: e for n, e in view.registry.items()
                                         if n in live})
    assert plan(bare, 5.0) == []  # waits for the drain's deadline
    may = dataclasses.replace(bare, jobs={"j": dataclasses.replace(
        job, spec=dataclasses.replace(job.spec, reshape=True))})
    (start,) = plan(may, 5.0)
    assert isinstance(start, StartMigration) and start.migration.kind == "reshape"
    assert start.migration.replicas == (0,) and "drain of b" in start.migration.reason


def test_a_reshape_record_names_its_replicas_and_nothing_else_does() -> None:
    base = dict(job="j", id="e2-1", from_epoch=1, to_epoch=2, phase=MigrationPhase.PLANNED,
                reason="", created_at=0.0, deadline=1.0, updated_at=0.0)
    ok = Migration(**base, ranks=(), leavers=(), joiners=(), kind="reshape", replicas=(2, 0),
                   from_dp=3)
    assert Migration.decode(ok.encode()) == ok and ok.recovery
    grow = Migration(**base, ranks=(3,), leavers=("",), joiners=("s",), kind="reshape",
                     replicas=(0, -1), from_dp=1, donors=(1,))
    assert Migration.decode(grow.encode()) == grow
    for bad, match in (({"replicas": ()}, "names each once"),
                       ({"replicas": (0, 0)}, "names each once"),
                       ({"replicas": (-1,)}, "keeps at least one"),
                       ({"replicas": (3,)}, "below its size before"),
                       ({"ranks": (1,), "leavers": ("a",), "joiners": ("s",), "donors": (0,)},
                        "with no leaver"),
                       ({"ranks": (1,), "leavers": ("",), "joiners": ("s",)},
                        "from a donor")):
        with pytest.raises(ValueError, match=match):
            Migration(**{**base, "ranks": (), "leavers": (), "joiners": (), "kind": "reshape",
                         "replicas": (0,), "from_dp": 3, **bad})
    with pytest.raises(ValueError, match="only a reshape"):
        Migration(**base, ranks=(1,), leavers=("a",), joiners=("s",), replicas=(0,), from_dp=2)


def test_an_assignment_that_does_not_fit_its_job_plans_nothing() -> None:
    view = _recovery_view({1: _crash(1)})
    job = view.jobs["j"]
    assert job.assignment is not None
    for ranks in (("a", "a", "b"), ("a",) * 6):  # TP 2 does not divide 3; 3 replicas of 2 slots
        odd = dataclasses.replace(job.assignment, ranks=ranks)
        bad = dataclasses.replace(view, jobs={"j": dataclasses.replace(job, assignment=odd)})
        assert plan(bad, 5.0) == []


def test_a_rank_failing_during_a_drain_calls_the_drain_off() -> None:
    view, _ = _migrating_view(phase="preparing")
    job = view.jobs["j"]
    crashed = dataclasses.replace(job, exits={0: RankExit(
        job="j", rank=0, epoch=1, node="a", returncode=1, failed=True, description="code 1",
        time=1.0)})
    (abort,) = plan(dataclasses.replace(view, jobs={"j": crashed}), 10.0)
    assert isinstance(abort, AdvanceMigration) and abort.phase == MigrationPhase.ABORTED
    assert "rank 0 failed" in abort.reason


def _migrating_view(progress: frozenset[str] = frozenset(), phase: str = "planned",
                    now: float = 10.0, drop: str = "") -> tuple[ClusterView, Migration]:
    a = Assignment(job="j", epoch=1, ranks=("a", "a", "b", "b"), standbys=("s1", "s2"),
                   reason="", updated_at=0)
    running = JobStatus(job="j", state=JobState.RUNNING, reason="", updated_at=0)
    m = Migration(job="j", id="e2-1", from_epoch=1, to_epoch=2, ranks=(2, 3),
                  leavers=("b", "b"), joiners=("s1", "s2"), phase=MigrationPhase(phase),
                  reason="drain of b", created_at=1.0, deadline=100.0, updated_at=1.0)
    live = {"a": _live("a", NodeState.ACTIVE, 2), "b": _live("b", NodeState.DRAINING, 2),
            "s1": _live("s1", NodeState.STANDBY, 1), "s2": _live("s2", NodeState.STANDBY, 1)}
    live.pop(drop, None)
    view = ClusterView(registry={n: (_entry(n), 1) for n in ("a", "b", "s1", "s2")},
                       live=live, jobs={"j": JobView(_spec(), running, a, migration=m,
                                                     progress=progress)})
    return view, m


def test_a_drain_pairs_each_leaving_rank_with_a_standby() -> None:
    view, _ = _migrating_view()
    job = view.jobs["j"]
    fresh = ClusterView(registry=view.registry, live=view.live, jobs={"j": JobView(
        job.spec, job.status, job.assignment)}, drain_deadlines={"b": 50.0})
    (start,) = plan(fresh, now=10.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert (m.ranks, m.leavers, m.joiners) == ((2, 3), ("b", "b"), ("s1", "s2"))
    assert (m.from_epoch, m.to_epoch, m.deadline) == (1, 2, 50.0)
    assert "rank 2 b -> s1" in start.reason


def test_a_migration_deadline_is_capped_by_the_migration_timeout_and_a_retry_avoids_the_last_joiner(
        ) -> None:
    view, m = _migrating_view()
    job = view.jobs["j"]
    aborted = dataclasses.replace(m, phase=MigrationPhase.ABORTED, joiners=("s1", "s3"))
    live = {**view.live, "s3": _live("s3", NodeState.STANDBY, 1)}
    a = dataclasses.replace(job.assignment, standbys=("s1", "s2", "s3"))
    fresh = ClusterView(registry=view.registry, live=live, jobs={"j": JobView(
        job.spec, job.status, a, migration=aborted)}, drain_deadlines={"b": 500.0},
        migration_timeout=30.0)
    (start,) = plan(fresh, now=10.0)
    assert isinstance(start, StartMigration)
    assert start.migration.deadline == 40.0
    # s2 had no part in the aborted attempt; s1 and s3 did and come after it, in pool order.
    assert start.migration.joiners == ("s2", "s1")


def test_a_drain_without_enough_standbys_plans_nothing() -> None:
    view, _ = _migrating_view(drop="s2")
    job = view.jobs["j"]
    fresh = ClusterView(registry=view.registry, live=view.live, jobs={"j": JobView(
        job.spec, job.status, job.assignment)})
    assert not [x for x in plan(fresh, now=10.0) if isinstance(x, StartMigration)]
    # A cordoned standby takes no new rank either.
    view, _ = _migrating_view()
    registry = {**view.registry, "s2": (dataclasses.replace(view.registry["s2"][0],
                                                            cordoned=True), 1)}
    fresh = ClusterView(registry=registry, live=view.live, jobs={"j": JobView(
        job.spec, job.status, job.assignment)})
    assert not [x for x in plan(fresh, now=10.0) if isinstance(x, StartMigration)]


def test_migration_phases_follow_the_reports() -> None:
    def step(progress: set[str], phase: str) -> list[object]:
        view, _ = _migrating_view(frozenset(progress), phase)
        return [x for x in plan(view, now=10.0) if isinstance(x, AdvanceMigration)]

    assert step(set(), "planned") == []
    (a,) = step({"bound/2", "bound/3"}, "planned")
    assert a.phase == MigrationPhase.PREPARING  # type: ignore[attr-defined]
    world = {f"prepared/{r}" for r in range(4)}
    assert step(world, "preparing") == [], "the joiners have not prepared yet"
    (b,) = step(world | {"joiner-prepared/2", "joiner-prepared/3"}, "preparing")
    assert b.phase == MigrationPhase.READY  # type: ignore[attr-defined]
    (c,) = step({"switched/2", "switched/3"}, "ready")
    assert c.phase == MigrationPhase.DONE  # type: ignore[attr-defined]
    new = c.assignment  # type: ignore[attr-defined]
    assert (new.epoch, new.ranks, new.standbys) == (2, ("a", "a", "s1", "s2"), ())
    assert new.migration == c.id  # type: ignore[attr-defined]


def test_migrations_abort_on_deadline_dead_joiner_or_report() -> None:
    view, m = _migrating_view(phase="preparing")
    (late,) = [x for x in plan(view, now=m.deadline + 1) if isinstance(x, AdvanceMigration)]
    assert late.phase == MigrationPhase.ABORTED and "deadline" in late.reason
    view, _ = _migrating_view(phase="preparing", drop="s1")
    (gone,) = [x for x in plan(view, now=10.0) if isinstance(x, AdvanceMigration)]
    assert gone.phase == MigrationPhase.ABORTED and "s1 is gone" in gone.reason
    view, _ = _migrating_view(frozenset({"aborted"}), phase="switching")
    (told,) = [x for x in plan(view, now=10.0) if isinstance(x, AdvanceMigration)]
    assert told.phase == MigrationPhase.ABORTED
    # While switching, the ranks decide: a late deadline alone does not pull the plug.
    view, m = _migrating_view(phase="switching")
    assert not [x for x in plan(view, now=m.deadline + 1) if isinstance(x, AdvanceMigration)]


def test_a_leaver_dead_in_phase_2_is_named_as_the_cause_over_its_joiner_giving_up() -> None:
    # The leaver of rank 2 died while streaming its state; its joiner gave up when the stream
    # broke and its daemon called the migration off. Both reports are in: the leaver's death
    # is the cause the abort names.
    view, _ = _migrating_view(frozenset({"switching", "aborted"}), phase="switching")
    job = dataclasses.replace(view.jobs["j"], abort_reason="the joiner on s1 gave up",
                              exits={2: dataclasses.replace(_crash(2, node="b"), epoch=1)})
    (abort,) = [x for x in plan(dataclasses.replace(view, jobs={"j": job}), now=10.0)
                if isinstance(x, AdvanceMigration)]
    assert abort.phase == MigrationPhase.ABORTED
    assert "rank 2" in abort.reason and "before its state reached the joiner" in abort.reason


def test_a_loss_in_the_pass_that_first_sees_the_switch_agreed_counts_as_phase_2() -> None:
    # The ranks agreed on the switch step and the leaver of rank 2 died streaming its state;
    # the controller sees both in one pass, the record still in phase ready (the CI run of
    # 2026-11-27 named the death "during the migration", as if before the switch).
    view, _ = _migrating_view(frozenset({"switching"}), phase="ready")
    job = dataclasses.replace(view.jobs["j"],
                              exits={2: dataclasses.replace(_crash(2, node="b"), epoch=1)})
    (abort,) = [x for x in plan(dataclasses.replace(view, jobs={"j": job}), now=10.0)
                if isinstance(x, AdvanceMigration)]
    assert abort.phase == MigrationPhase.ABORTED
    assert "rank 2" in abort.reason and "in phase 2, before its state reached the joiner" in \
        abort.reason
    # A rank that stays, lost in that pass, calls nothing off: the ranks are switching, and it
    # is recovered once the joiners hold theirs. Nor does a deadline past: the record moves on
    # to switching.
    job = dataclasses.replace(view.jobs["j"],
                              exits={0: dataclasses.replace(_crash(0, node="a"), epoch=1)})
    (on,) = [x for x in plan(dataclasses.replace(view, jobs={"j": job}), now=1000.0)
             if isinstance(x, AdvanceMigration)]
    assert on.phase == MigrationPhase.SWITCHING
    # Before the switch is agreed, the same stayer's loss calls the migration off.
    view, _ = _migrating_view(phase="ready")
    job = dataclasses.replace(view.jobs["j"],
                              exits={0: dataclasses.replace(_crash(0, node="a"), epoch=1)})
    (abort,) = [x for x in plan(dataclasses.replace(view, jobs={"j": job}), now=10.0)
                if isinstance(x, AdvanceMigration)]
    assert abort.phase == MigrationPhase.ABORTED and "during the migration" in abort.reason


def test_a_joiner_dying_in_phase_2_after_its_state_was_sent_commits_the_migration() -> None:
    # The leaver of rank 3 sent its state and handed off; the joiner died before it said it
    # switched. Nobody else holds rank 3 under epoch 1 any more: the migration is committed,
    # and rank 3, lost under epoch 2, is the next round's recovery.
    died = RankExit(job="j", rank=3, epoch=2, node="s2", returncode=1, failed=True,
                    description="exit code 1", time=1.0)
    progress = frozenset({"switching", "switched/2", "transferred/2", "transferred/3"})
    view, _ = _migrating_view(progress, phase="switching")
    job = dataclasses.replace(view.jobs["j"], next_exits={3: died})
    view = dataclasses.replace(view, jobs={"j": job})
    (done,) = [x for x in plan(view, now=10.0) if isinstance(x, AdvanceMigration)]
    assert done.phase == MigrationPhase.DONE and done.assignment is not None
    assert done.assignment.ranks == ("a", "a", "s1", "s2")
    # Without the leaver's word that the state went out, nothing is committed: its failed
    # send calls the migration off (the "transferred/3" report says why).
    view, _ = _migrating_view(progress - {"transferred/3"}, phase="switching")
    view = dataclasses.replace(view, jobs={"j": dataclasses.replace(view.jobs["j"],
                                                                    next_exits={3: died})})
    assert not [x for x in plan(view, now=10.0) if isinstance(x, AdvanceMigration)]


def test_an_offline_standby_is_replaced_in_the_pool_by_a_fresh_one() -> None:
    view = _recovery_view(standbys=("s1",), drop=("s1",))
    (refill,) = [x for x in plan(view, 5.0) if isinstance(x, AddStandbys)]
    assert refill.assignment.standbys == ("s2",)


def test_a_promoted_joiner_still_reading_standby_is_not_put_back_in_the_pool() -> None:
    # Right after a recovery commits, the joiner's node holds rank 1 but its record still says
    # standby until its daemon catches up.
    view = _recovery_view(standbys=())
    job = view.jobs["j"]
    assert job.assignment is not None
    moved = dataclasses.replace(job.assignment, ranks=("a", "s1", "b", "b"))
    view = dataclasses.replace(view, jobs={"j": dataclasses.replace(job, assignment=moved)})
    (refill,) = [x for x in plan(view, 5.0) if isinstance(x, AddStandbys)]
    assert refill.assignment.standbys == ("s2",)


def test_a_rank_without_a_replica_rolls_every_rank_back_to_the_newest_common_snapshot() -> None:
    view = _recovery_view({1: _crash(1)}, tp=4)
    job = dataclasses.replace(view.jobs["j"], snapshots={0: (40, 60), 1: (40,), 2: (40, 60),
                                                         3: (40, 60)})
    (start,) = plan(dataclasses.replace(view, jobs={"j": job}), 5.0)
    assert isinstance(start, StartMigration)
    m = start.migration
    assert m.kind == "rollback" and m.snapshot_step == 40 and m.donors == ()
    assert m.ranks == (1,) and m.joiners == ("s1",)
    assert "rollback of every rank to the snapshot of step 40" in start.reason
    # A rank that holds no snapshot at all: nothing to roll back to.
    bare = dataclasses.replace(job, snapshots={0: (40,), 2: (40,), 3: (40,)})
    (failed,) = plan(dataclasses.replace(view, jobs={"j": bare}), 5.0)
    assert isinstance(failed, SetJobState) and failed.state == JobState.FAILED
    assert "no snapshot is held by every rank" in failed.reason


def test_snapshot_reports_from_workers_are_validated() -> None:
    from understudy.daemon.controller import _JobTables

    t = _JobTables()
    t.ingest_progress("j/snapshots/1", b"[20, 40]", False)
    t.ingest_progress("j/snapshots/2", b"not json", False)
    t.ingest_progress("j/snapshots/3", b'[20, "x"]', False)
    t.ingest_progress("j/snapshots/x", b"[20]", False)
    assert t.snapshots == {"j": {1: (20, 40)}}
    t.ingest_progress("j/snapshots/1", b"", True)
    assert t.snapshots == {"j": {}}


def test_a_standby_warmed_for_the_lost_rank_takes_it() -> None:
    view = _recovery_view({1: _crash(1)})
    s2 = dataclasses.replace(view.live["s2"], warmth={"j": {"mode": "replay", "roles": [],
                                                            "detail": "", "rank": 1}})
    view = dataclasses.replace(view, live={**view.live, "s2": s2})
    (start,) = plan(view, 5.0)
    assert isinstance(start, StartMigration) and start.migration.joiners == ("s2",)


def test_a_job_that_finishes_during_a_drain_ends_done_and_plans_no_more() -> None:
    view, _ = _migrating_view(phase="preparing")
    job = view.jobs["j"]
    done = {r: RankExit(job="j", rank=r, epoch=1, node="a", returncode=0, failed=False,
                        description="exited cleanly", time=1.0) for r in range(4)}
    finished = dataclasses.replace(job, exits=done)
    (abort,) = plan(dataclasses.replace(view, jobs={"j": finished}), 10.0)
    assert isinstance(abort, AdvanceMigration) and abort.phase == MigrationPhase.ABORTED
    assert "every rank finished" in abort.reason
    assert job.migration is not None
    over = dataclasses.replace(finished, migration=dataclasses.replace(
        job.migration, phase=MigrationPhase.ABORTED))
    (end,) = plan(dataclasses.replace(view, jobs={"j": over}), 11.0)
    assert end == SetJobState("j", JobState.DONE, "every rank finished")


def test_a_rank_gone_after_another_finished_ends_the_job_and_is_never_recovered() -> None:
    def finished(rank: int) -> RankExit:
        return RankExit(job="j", rank=rank, epoch=3, node="a", returncode=0, failed=False,
                        description="exited cleanly", time=2.0)

    # Node b went as the job ended: its ranks' exits were never reported. Ranks 0 and 1
    # finished, so the last step is committed everywhere, and a recovery could only wait for
    # groups nobody is left to build: the job is done, and the reason names the ranks.
    one = _recovery_view({0: finished(0)}, drop=("b",))
    assert [x for x in plan(one, 5.0) if not isinstance(x, MarkFailed)] == []  # rank 1 ends
    view = _recovery_view({0: finished(0), 1: finished(1)}, drop=("b",))
    (done,) = [x for x in plan(view, 5.0) if isinstance(x, SetJobState)]
    assert done.state == JobState.DONE and not any(isinstance(x, StartMigration)
                                                    for x in plan(view, 5.0))
    assert done.reason == ("every rank reached the job's last step (rank 0 finished it); "
                           "rank(s) 2, 3 went before reporting their exit: node b holding "
                           "rank 2 is gone; node b holding rank 3 is gone")
    # A rank whose process failed after another finished fails the job, with its cause.
    (failed,) = plan(_recovery_view({0: finished(0), 1: finished(1), 2: _crash(2, "b"),
                                     3: finished(3)}), 5.0)
    assert failed == SetJobState("j", JobState.FAILED, "rank 2 failed on b: killed by SIGKILL, "
                                 "after rank 0 finished the job's last step")
    # A recovery planned before the finished ranks' reports arrived is called off at once.
    (start,) = [x for x in plan(_recovery_view(drop=("b",)), 5.0)
                if isinstance(x, StartMigration)]
    racing = dataclasses.replace(view.jobs["j"], migration=start.migration)
    (abort,) = [x for x in plan(dataclasses.replace(view, jobs={"j": racing}), 6.0)
                if not isinstance(x, MarkFailed)]
    assert isinstance(abort, AdvanceMigration) and abort.phase == MigrationPhase.ABORTED
    assert abort.reason == "rank 0 finished the job's last step: no group can be rebuilt with it"


def test_a_pause_ends_when_a_recovery_is_planned_after_it() -> None:
    """The worker's reading of "paused" (worker.migration._paused): the status says so after
    the assignment and after the job's migration was planned, unless that one aborted."""
    paused = {"reason": PAUSED + "rank 3 failed; waiting for a standby", "updated_at": 10.0,
              "paused": True}
    assignment = {"updated_at": 5.0}
    assert _paused({"status": paused, "assignment": assignment})
    # The typed flag says it, not the reason's words.
    assert not _paused({"status": {**paused, "paused": False}, "assignment": assignment})
    assert not _paused({"status": {k: v for k, v in paused.items() if k != "paused"},
                        "assignment": assignment})
    assert not _paused({"status": {**paused, "paused": "yes"}, "assignment": assignment})
    assert _paused({"status": {**paused, "reason": "running"}, "assignment": assignment})
    # A newer assignment (the recovery committed) or a recovery planned after the pause ends it.
    assert not _paused({"status": paused, "assignment": {"updated_at": 12.0}})
    recovery = {"phase": "ready", "created_at": 11.0}
    assert not _paused({"status": paused, "assignment": assignment, "migration": recovery})
    # One planned before it, or one that aborted, does not.
    assert _paused({"status": paused, "assignment": assignment,
                    "migration": {**recovery, "created_at": 9.0}})
    assert _paused({"status": paused, "assignment": assignment,
                    "migration": {**recovery, "phase": "aborted"}})


def test_a_rank_that_lags_takes_its_plan_for_committed_only_from_the_epoch_it_made() -> None:
    """worker.migration.committed: the job's next migration may be planned before a lagging
    rank saw its own done; the assignment names the migration that made its epoch. An
    aborted plan's epoch is made again by its retry, which is not the aborted plan's commit."""
    record = Migration(job="j", id="e2-100", from_epoch=2, to_epoch=3, ranks=(0,),
                       leavers=("a",), joiners=("s1",), phase=MigrationPhase.PREPARING,
                       reason="rank 0 lost", created_at=100.0, deadline=200.0,
                       updated_at=100.0, kind="recovery", donors=(2,))
    mine = Plan.from_info({"migration": json.loads(record.encode())})
    assert mine is not None and mine == Plan.decode(record.encode())
    assert mine.moves == {0: ("a", "s1")} and mine.donor_of == {0: 2}
    assert mine.group_version == 100_000 and mine.recovers_from(2) and not mine.recovers_from(3)
    assert Plan.from_info({"migration": None}) is None and Plan.from_info(None) is None
    with pytest.raises(RecordError):  # the view's record, checked as etcd's was
        Plan.from_info({"migration": {**json.loads(record.encode()), "to_epoch": 4}})
    assert committed({"assignment": {"epoch": 3, "migration": "e2-100"}}, mine)
    assert not committed({"assignment": {"epoch": 2, "migration": "e1-50"}}, mine)
    assert not committed({"assignment": {"epoch": 3, "migration": "e2-140"}}, mine)  # a retry
    assert not committed({"assignment": {"epoch": 3}}, mine)  # written by an older controller
    assert not committed({"assignment": None}, mine) and not committed(None, mine)


class _Waiting:
    """What ``wait_for_recovery`` reads of a survivor's boundary hook: the job's recovery plan
    (none yet, unless the test sets one), and whether the job is paused or the daemon cut off
    from etcd (set by the test as time passes)."""

    def __init__(self) -> None:
        self.paused = False
        self.etcd_unreachable = False
        self.plan: Plan | None = None

    def recovery(self) -> Plan | None:
        return self.plan


def test_a_survivor_waits_for_its_recovery_as_long_as_etcd_is_unreachable() -> None:
    import threading
    import time

    hook, stop = _Waiting(), threading.Event()
    t0 = time.monotonic()
    assert wait_for_recovery(hook, stop, timeout=0.2) is None  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - t0 < 1.0
    # Unreachable for 0.6 s, three timeouts: the wait goes on until then, and ends at most one
    # timeout after.
    hook.etcd_unreachable = True
    threading.Timer(0.6, lambda: setattr(hook, "etcd_unreachable", False)).start()
    t0 = time.monotonic()
    assert wait_for_recovery(hook, stop, timeout=0.2) is None  # type: ignore[arg-type]
    assert 0.6 <= time.monotonic() - t0 < 2.0


def test_a_survivor_takes_up_a_plan_it_saw_called_off_only_once_etcd_answers_again() -> None:
    """A recovery called off on this rank's side (its report failed: etcd down) stays the job's
    plan until the controller acts: the survivor must not rerun it at once, again and again,
    for as long as the outage lasts (a spin seen in test_outage, every 3-5 ms). It waits for
    etcd, then a pause; a new plan it takes at once."""
    import threading
    import time

    record = Migration(job="j", id="e2-100", from_epoch=2, to_epoch=3, ranks=(0,),
                       leavers=("a",), joiners=("s1",), phase=MigrationPhase.PREPARING,
                       reason="rank 0 lost", created_at=100.0, deadline=200.0,
                       updated_at=100.0, kind="recovery", donors=(2,))
    plan = Plan.decode(record.encode())
    hook, stop = _Waiting(), threading.Event()
    hook.plan = plan
    # Not called off: taken at once.
    t0 = time.monotonic()
    assert wait_for_recovery(hook, stop, timeout=0.2) is plan  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 0.1
    # Called off, etcd reachable: taken up again after the pause, not before; the standing
    # plan keeps the wait from timing out meanwhile.
    t0 = time.monotonic()
    assert wait_for_recovery(hook, stop, timeout=0.2,  # type: ignore[arg-type]
                             called_off=plan.id) is plan
    assert RETRY_S <= time.monotonic() - t0 < RETRY_S + 0.5
    # Called off with etcd out for 1.2 s (six timeouts): not before etcd answers.
    hook.etcd_unreachable = True
    threading.Timer(1.2, lambda: setattr(hook, "etcd_unreachable", False)).start()
    t0 = time.monotonic()
    assert wait_for_recovery(hook, stop, timeout=0.2,  # type: ignore[arg-type]
                             called_off=plan.id) is plan
    assert 1.2 <= time.monotonic() - t0 < 1.7
    # Another plan replacing it (the controller's retry) is taken at once, outage or not.
    retry = Plan.decode(dataclasses.replace(record, id="e2-140").encode())
    hook.etcd_unreachable = True
    hook.plan = retry
    t0 = time.monotonic()
    assert wait_for_recovery(hook, stop, timeout=0.2,  # type: ignore[arg-type]
                             called_off=plan.id) is retry
    assert time.monotonic() - t0 < 0.1
    # The called-off plan gone (aborted) and no other: the timeout holds again.
    hook.etcd_unreachable, hook.plan = False, None
    t0 = time.monotonic()
    assert wait_for_recovery(hook, stop, timeout=0.2,  # type: ignore[arg-type]
                             called_off=plan.id) is None
    assert 0.2 <= time.monotonic() - t0 < 1.0


# -- restart-only jobs (understudy run --restart-only; docs/restart.md) ------------------------


def _restart_view(exits: dict[int, RankExit] | None = None, drop: tuple[str, ...] = (),
                  draining: tuple[str, ...] = (), standbys: tuple[str, ...] = ("s1", "s2"),
                  restarts: int = 0, max_restarts: int = 3,
                  migration: Migration | None = None) -> ClusterView:
    spec = dataclasses.replace(_spec(tp=1, dp=4), restart_only=True, max_restarts=max_restarts)
    a = Assignment(job="j", epoch=3, ranks=("a", "a", "b", "b"), standbys=standbys,
                   reason="", updated_at=0, restarts=restarts)
    running = JobStatus(job="j", state=JobState.RUNNING, reason="", updated_at=0)
    live = {"a": _live("a", NodeState.ACTIVE, 2), "b": _live("b", NodeState.ACTIVE, 2),
            "s1": _live("s1", NodeState.STANDBY, 1), "s2": _live("s2", NodeState.STANDBY, 1)}
    for n in draining:
        live[n] = dataclasses.replace(live[n], state=NodeState.DRAINING)
    for n in drop:
        live.pop(n)
    return ClusterView(registry={n: (_entry(n), 1) for n in ("a", "b", "s1", "s2")},
                       live=live, jobs={"j": JobView(spec, running, a, exits=exits or {},
                                                     migration=migration)})


def _ended(*ranks: int, code: int = -15) -> dict[int, RankExit]:
    return {r: RankExit(job="j", rank=r, epoch=3, node="ab"[r // 2], returncode=code,
                        failed=code != 0, description=f"code {code}", time=2.0) for r in ranks}


def _job_plan(view: ClusterView, now: float) -> list[object]:
    """The plan without the failure marks of the nodes a view dropped."""
    return [x for x in plan(view, now) if not isinstance(x, MarkFailed)]


def _restart_planned(view: ClusterView, now: float = 5.0) -> Migration:
    (start,) = _job_plan(view, now)
    assert isinstance(start, StartMigration), start
    m = start.migration
    assert m.kind == "restart" and m.ranks == (0, 1, 2, 3) and (m.from_epoch, m.to_epoch) == (3, 4)
    assert m.leavers == ("a", "a", "b", "b") and m.phase == MigrationPhase.PLANNED
    return m


def test_a_crashed_rank_of_a_restart_only_job_restarts_every_rank_in_place() -> None:
    m = _restart_planned(_restart_view({1: _crash(1)}))
    assert m.joiners == ("a", "a", "b", "b") and m.restarts == 1  # a failure counts
    assert "rank 1 failed on a: killed by SIGKILL" in m.reason
    # The new epoch waits for the exit of every rank of the old one (they were sent SIGTERM).
    assert _job_plan(_restart_view({1: _crash(1), **_ended(0, 2)}, migration=m), 6.0) == []
    (done,) = _job_plan(_restart_view({1: _crash(1), **_ended(0, 2), **_ended(3, code=0)},
                                 migration=m), 7.0)
    assert isinstance(done, AdvanceMigration) and done.phase == MigrationPhase.DONE
    a = done.assignment
    assert a is not None and a.epoch == 4 and a.ranks == ("a", "a", "b", "b")
    assert a.restarts == 1 and a.standbys == ("s1", "s2")


def test_a_drain_restarts_a_restart_only_job_onto_a_standby_without_using_up_a_restart() -> None:
    m = _restart_planned(_restart_view(draining=("b",), restarts=2))
    assert m.joiners == ("a", "a", "s1", "s2") and m.restarts == 2 and m.reason == "drain of b"
    (done,) = _job_plan(_restart_view(_ended(0, 1, 2, 3), draining=("b",), restarts=2,
                                 migration=m), 9.0)
    assert isinstance(done, AdvanceMigration) and done.assignment is not None
    assert done.assignment.ranks == ("a", "a", "s1", "s2") and done.assignment.standbys == ()
    # A standby node with two slots takes both ranks of the drained node.
    view = _restart_view(draining=("b",), standbys=("s1",))
    view = dataclasses.replace(view, live={**view.live, "s1": _live("s1", NodeState.STANDBY, 2)})
    assert _restart_planned(view).joiners == ("a", "a", "s1", "s1")


def test_a_lost_node_restarts_its_ranks_on_standbys_once_the_others_ended() -> None:
    (start,) = _job_plan(_restart_view(drop=("b",)), 5.0)
    assert isinstance(start, StartMigration) and start.absent == ("b",)
    m = start.migration
    assert m.joiners == ("a", "a", "s1", "s2") and m.restarts == 1
    # The lost node's ranks never report an exit: its loss stands for them.
    assert _job_plan(_restart_view(_ended(0), drop=("b",), migration=m), 6.0) == []
    (done,) = _job_plan(_restart_view(_ended(0, 1), drop=("b",), migration=m), 7.0)
    assert isinstance(done, AdvanceMigration) and done.assignment is not None
    assert done.assignment.ranks == ("a", "a", "s1", "s2")


def test_a_restart_only_job_fails_past_its_max_restarts_and_is_done_when_every_rank_is() -> None:
    (failed,) = _job_plan(_restart_view({1: _crash(1)}, restarts=3), 5.0)
    assert failed == SetJobState("j", JobState.FAILED, "rank 1 failed on a: killed by SIGKILL; "
                                 "restarted 3 time(s) after failures already, its "
                                 "--max-restarts is 3")
    (failed,) = _job_plan(_restart_view({1: _crash(1)}, max_restarts=0), 5.0)
    assert failed.state == JobState.FAILED  # type: ignore[union-attr]
    # Drains do not count: one at the limit still restarts.
    assert _restart_planned(_restart_view(draining=("b",), restarts=3)).restarts == 3
    (done,) = _job_plan(_restart_view(_ended(0, 1, 2, 3, code=0)), 5.0)
    assert done == SetJobState("j", JobState.DONE, "every rank finished")
    assert _job_plan(_restart_view(_ended(0, code=0)), 5.0) == []  # the others still run


def test_a_restart_called_off_is_planned_again_and_not_taken_for_the_job_s_end() -> None:
    m = _restart_planned(_restart_view({1: _crash(1)}))
    # Node b, chosen to keep its ranks, is lost while the ranks stop: called off.
    (abort,) = _job_plan(_restart_view({1: _crash(1)}, drop=("b",), migration=m), 6.0)
    assert isinstance(abort, AdvanceMigration) and abort.phase == MigrationPhase.ABORTED
    assert "node b chosen for the restart is gone" in abort.reason
    aborted = dataclasses.replace(m, phase=MigrationPhase.ABORTED, outcome=abort.reason)
    # Every rank ended meanwhile, most of them cleanly after their SIGTERM: not "done", and
    # the restarts are counted once.
    again = _restart_planned(_restart_view({**_ended(0, 2, 3, code=0), 1: _crash(1)},
                                           drop=("b",), migration=aborted), 7.0)
    assert again.joiners == ("a", "a", "s1", "s2") and again.restarts == 1


def test_a_restart_only_job_with_no_standby_free_takes_one_or_pauses() -> None:
    view = _restart_view(drop=("b",), standbys=("s1",))
    job = view.jobs["j"]
    view = dataclasses.replace(view, jobs={"j": dataclasses.replace(
        job, spec=dataclasses.replace(job.spec, standby=1))})
    (refill,) = _job_plan(view, 5.0)
    assert isinstance(refill, AddStandbys) and refill.assignment.standbys == ("s1", "s2")
    view = dataclasses.replace(view, live={n: r for n, r in view.live.items() if n != "s2"})
    (paused,) = _job_plan(view, 5.0)
    assert isinstance(paused, SetJobState) and paused.paused and paused.reason.startswith(PAUSED)
    # A drain with no standby free waits (its deadline stops the ranks).
    assert _job_plan(_restart_view(draining=("b",), drop=("s1", "s2")), 5.0) == []


def test_stopping_a_restart_only_job_waits_for_its_ranks_to_end_on_sigterm() -> None:
    from understudy.daemon.restarts import STOP_SLACK_S

    stop = StopRequest(job="j", requested_at=10.0, grace=30.0, requested_by="op@h")

    def stopping(exits: dict[int, RankExit], drop: tuple[str, ...] = ()) -> ClusterView:
        view = _restart_view(exits, drop=drop)
        return dataclasses.replace(view, jobs={"j": dataclasses.replace(view.jobs["j"],
                                                                         stop=stop)})

    assert _job_plan(stopping(_ended(0, 1)), 12.0) == []  # no restart while it stops
    (clean,) = _job_plan(stopping({**_ended(0, 1), **_ended(2, 3, code=0)}), 13.0)
    assert clean == SetJobState("j", JobState.STOPPED, "stopped by op@h: every rank ended "
                                "after its SIGTERM")
    assert stopped_cleanly(JobStatus(job="j", state=clean.state, reason=clean.reason,
                                     updated_at=13.0))
    (cut,) = _job_plan(stopping({**_ended(0, 1), 2: _crash(2, "b")}, drop=("b",)), 13.0)
    assert cut.reason == ("stopped by op@h: rank 2 killed by SIGKILL; rank 3's node b is "  # type: ignore[union-attr]
                          "gone")
    assert _job_plan(stopping(_ended(0)), 10.0 + 30.0 + STOP_SLACK_S - 0.1) == []
    (late,) = _job_plan(stopping(_ended(0)), 10.0 + 30.0 + STOP_SLACK_S)
    assert "no word of rank(s) 1, 2, 3 ending within the grace of 30 s" in late.reason  # type: ignore[union-attr]


def test_restart_records_say_what_they_may_hold() -> None:
    with pytest.raises(ValueError, match="cannot reshape"):
        dataclasses.replace(_spec(), restart_only=True, reshape=True)
    with pytest.raises(ValueError, match="max restarts"):
        dataclasses.replace(_spec(), restart_only=True, max_restarts=-1)
    m = _restart_planned(_restart_view({1: _crash(1)}))
    assert Migration.decode(m.encode()) == m
    with pytest.raises(ValueError, match="names every rank"):
        dataclasses.replace(m, ranks=(1, 0, 2, 3))
    with pytest.raises(ValueError, match="only a restart counts"):
        dataclasses.replace(m, kind="planned")
    from understudy.common.records import Rendezvous

    rdzv = Rendezvous(job="j", epoch=4, node="a", addr="10.0.0.1", port=29500)
    assert decode_job_record("j/rendezvous", rdzv.encode()) == ("j", "rendezvous", rdzv)
    with pytest.raises(ValueError, match="not an address and port"):
        Rendezvous(job="j", epoch=4, node="a", addr="10.0.0.1", port=0)


def test_a_restart_only_rank_gets_the_environment_torchrun_gives_its_workers() -> None:
    from understudy.common.records import Rendezvous
    from understudy.daemon.restarts import torchrun_env

    spec = dataclasses.replace(_spec(tp=1, dp=4), restart_only=True, max_restarts=5)
    a = Assignment(job="j", epoch=4, ranks=("a", "a", "s1", "s2"), standbys=(), reason="",
                   updated_at=0, restarts=2)
    rdzv = Rendezvous(job="j", epoch=4, node="a", addr="10.0.0.1", port=29500)
    assert torchrun_env(spec, a, 1, rdzv, {}) == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "4",
        "ROLE_NAME": "default", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    three = torchrun_env(spec, a, 3, rdzv, {"OMP_NUM_THREADS": "4"})
    assert (three["LOCAL_RANK"], three["GROUP_RANK"], three["OMP_NUM_THREADS"]) == ("0", "2", "4")
    own = dataclasses.replace(spec, env={"OMP_NUM_THREADS": "2"})
    assert "OMP_NUM_THREADS" not in torchrun_env(own, a, 0, rdzv, {})  # the job's own stays


def test_workers_get_torchs_allocator_on_huge_pages_unless_the_job_or_daemon_says_otherwise(
        ) -> None:
    from understudy.daemon.jobs import huge_pages

    assert huge_pages({}, {"PATH": "/bin"}) == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert huge_pages({"THP_MEM_ALLOC_ENABLE": "0"}, {}) == {}  # the job's --env
    assert huge_pages({}, {"THP_MEM_ALLOC_ENABLE": "0"}) == {}  # the daemon's environment


# -- what a committed migration leaves behind in etcd ------------------------------------------


def test_a_committed_migration_retires_its_groups_older_versions_and_earlier_attempts() -> None:
    from understudy.common.layout import pair_name, retired_bootstrap
    from understudy.common.records import group_version
    from understudy.daemon.controller import retired_reports

    base = "/u/kv/mig/"
    first, aborted, now = 1, group_version(1_700_000_000.0), group_version(1_700_000_100.0)
    keys = [
        # the first versions (the epoch); world and dp-1 rebuilt now, tp-1 and dp-0 untouched
        *(f"{base}{g}/v{first}/{k}" for g in ("tp-0", "tp-1", "dp-0", "dp-1", "world")
          for k in ("rank_0", "rank_1")),
        # an aborted attempt that had rebuilt world and tp-1, with its pair
        f"{base}world/v{aborted}/rank_0", f"{base}tp-1/v{aborted}/rank_1",
        f"{base}{pair_name(3, aborted)}/v{aborted}/rank_0",
        # this attempt: world and dp-1, its pair; a torch key with slashes in it
        f"{base}world/v{now}/rank_0", f"{base}dp-1/v{now}/a/b/c",
        f"{base}{pair_name(3, now)}/v{now}/rank_0",
        # not group versions: the job's own namespace, snapshots, reports, another job
        f"{base}holder-node-s1", f"{base}snapshots/r0", f"{base}migration/e1-1/bound/3",
        f"{base}migration/e2-2/switched/3", f"{base}migration/e2-2/downtime/3",
        f"{base}migration/e3-1/bound/3", f"{base}weird/vx/k", f"{base}tp-x/v1/k",
        "/u/kv/other/world/v1/rank_0", "/u/kv/mig2/world/v1/rank_0",
    ]
    assert retired_bootstrap(keys, base, now) == [
        f"{base}dp-1/v{first}/", f"{base}{pair_name(3, aborted)}/v{aborted}/",
        f"{base}world/v{first}/", f"{base}world/v{aborted}/"]
    # tp-1 keeps its current version and the aborted one: this attempt did not rebuild it.
    assert retired_bootstrap(keys, base, now + 1) == [
        f"{base}{pair_name(3, aborted)}/v{aborted}/", f"{base}{pair_name(3, now)}/v{now}/"]
    assert retired_reports(keys, base, "e3-1") == [f"{base}migration/e1-1/",
                                                   f"{base}migration/e2-2/"]
    assert retired_bootstrap([], base, now) == retired_reports([], base, "e3-1") == []


def test_the_controller_is_busy_while_a_job_is_submitted_pending_or_running() -> None:
    """What paces the probes (``probe.idle_interval`` while not busy)."""
    from understudy.daemon.controller import _JobTables

    tables = _JobTables()
    assert not tables.busy()
    tables.specs["j"] = _spec()
    assert tables.busy()  # submitted: no status written yet
    for state, busy in ((JobState.PENDING, True), (JobState.RUNNING, True),
                        (JobState.DONE, False), (JobState.FAILED, False),
                        (JobState.STOPPED, False)):
        tables.statuses["j"] = (JobStatus(job="j", state=state, reason="", updated_at=0), 1)
        assert tables.busy() is busy, state
    tables.specs["k"] = _spec("k")
    assert tables.busy()
