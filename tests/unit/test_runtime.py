"""The worker API and runtime: the step loop, the vote, abortable waits, RNG capture; and the
plain-PyTorch example as four real processes (TP=2 x DP=2 on gloo), compared bitwise."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy
import psutil
import pytest
import torch
import torch.distributed as dist

from tests.once import build_once
from understudy.common import env
from understudy.common.errorfile import read_error
from understudy.common.layout import Layout
from understudy.worker import rng
from understudy.worker.api import (
    CollectiveAborted,
    JobContext,
    TrainingJob,
    applies_landing,
    replays,
    wait_abortable,
)
from understudy.worker.runtime import (
    Action,
    NoMigration,
    Outcome,
    Runtime,
    StaticGroups,
    StepFailed,
)
from understudy.worker.transfer import Landing, TransferError

pytestmark = pytest.mark.timeout(30)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plain_torch" / "train.py"


# --- layout and context ---------------------------------------------------------------------


def test_layout_is_tp_fastest() -> None:
    layout = Layout(4, 2)
    assert layout.group_ranks("tp", 0) == (0, 1)
    assert layout.group_ranks("tp", 3) == (2, 3)
    assert layout.group_ranks("dp", 0) == (0, 2)
    assert layout.group_ranks("dp", 3) == (1, 3)
    assert layout.group_ranks("world", 2) == (0, 1, 2, 3)
    assert layout.logical() == ("tp", "dp", "world")
    with pytest.raises(ValueError, match="'pp'"):
        layout.group_ranks("pp", 0)


def test_layout_with_stages_is_tp_then_dp_then_pp() -> None:
    layout = Layout(12, 2, pp=3)  # dp = 2
    assert layout.logical() == ("tp", "dp", "pp", "world")
    assert layout.coordinates(7) == (1, 1, 1)
    assert layout.group_ranks("tp", 7) == (6, 7)
    assert layout.group_ranks("dp", 7) == (5, 7)
    assert layout.group_ranks("pp", 7) == (3, 7, 11)
    assert layout.replicas(10) == (8, 10)
    assert layout.concrete(7) == {"tp": "tp-3", "dp": "dp-3", "pp": "pp-3", "world": "world"}
    # Every concrete group's members name it back, and the groups of one kind partition the
    # world.
    for kind in layout.logical():
        seen: set[int] = set()
        for name in {layout.concrete(r)[kind] for r in range(12)}:
            members = list(layout.members(name))
            assert all(layout.concrete(r)[kind] == name for r in members)
            assert not seen & set(members)
            seen |= set(members)
        assert seen == set(range(12))
    for bad in ("pp-4", "dp-6", "tp-x", "ring-0"):
        with pytest.raises(ValueError, match="unknown group"):
            layout.members(bad)
    with pytest.raises(ValueError, match="does not divide"):
        Layout(12, 5)


class _NoGroups:
    def current(self, name: str) -> Any:
        raise AssertionError("not used")


def test_context_derives_coordinates_and_rejects_bad_layouts() -> None:
    ctx = JobContext(job="j", rank=3, world_size=4, tp=2, groups=_NoGroups())
    assert (ctx.dp, ctx.tp_index, ctx.dp_index) == (2, 1, 1)
    with pytest.raises(ValueError, match="tp=3"):
        JobContext(job="j", rank=0, world_size=4, tp=3, groups=_NoGroups())
    with pytest.raises(ValueError, match="rank 4"):
        JobContext(job="j", rank=4, world_size=4, tp=2, groups=_NoGroups())


# --- abortable waits ------------------------------------------------------------------------


class FakeWork:
    def __init__(self) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future

    def wait(self) -> Any:
        return self.future.wait()


def test_wait_returns_when_the_work_completes_not_at_the_end_of_a_slice() -> None:
    work = FakeWork()
    timer = threading.Timer(0.05, work.future.set_result, args=(None,))
    timer.start()
    start = time.monotonic()
    wait_abortable(work, what="x", timeout=30, should_abort=lambda: False, poll_interval=10)
    assert time.monotonic() - start < 5
    timer.join()


def test_wait_turns_a_communicator_error_into_collective_aborted() -> None:
    work = FakeWork()
    work.future.set_exception(RuntimeError("Connection reset by peer"))
    with pytest.raises(CollectiveAborted, match=r"the vote failed .*Connection reset") as info:
        wait_abortable(work, what="the vote", timeout=30, should_abort=lambda: False)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_wait_gives_up_when_told_to_abort() -> None:
    polls = iter([False, True])
    with pytest.raises(CollectiveAborted, match="told to abort") as info:
        wait_abortable(FakeWork(), what="the vote", timeout=30,
                       should_abort=lambda: next(polls), poll_interval=0.001)
    assert info.value.what == "the vote"


def test_a_collective_issued_while_the_job_recovers_is_not_waited_for() -> None:
    # The job's waits are where a survivor's step stops: even a collective that completed
    # (its peers alive) ends the step once a peer elsewhere is known to be gone.
    work = FakeWork()
    work.future.set_result(None)
    recovering = JobContext(job="j", rank=2, world_size=4, tp=2, groups=_NoGroups(),
                            should_abort=lambda: True)
    with pytest.raises(CollectiveAborted, match="not waited for: the job is recovering") as info:
        recovering.wait(work, "the TP all-reduce")
    assert info.value.what == "the TP all-reduce" and info.value.waited == 0
    training = JobContext(job="j", rank=2, world_size=4, tp=2, groups=_NoGroups(),
                          should_abort=lambda: False)
    training.wait(work, "the TP all-reduce")


def test_wait_times_out_on_a_silent_peer() -> None:
    ticks = iter(range(100))
    with pytest.raises(CollectiveAborted, match=r"timed out after 3\.00 s") as info:
        wait_abortable(FakeWork(), what="the vote", timeout=3, should_abort=lambda: False,
                       poll_interval=0.001, clock=lambda: float(next(ticks)))
    assert info.value.waited == 3


# --- RNG ------------------------------------------------------------------------------------


class FakeTracker:
    def __init__(self) -> None:
        self.states = {"model-parallel-rng": torch.get_rng_state()}

    def get_states(self) -> dict[str, Any]:
        return self.states

    def set_states(self, states: dict[str, Any]) -> None:
        self.states = states


def _draw() -> tuple[torch.Tensor, float, Any]:
    return torch.rand(8), random.random(), numpy.random.rand(4)


def test_rng_restore_is_bitwise_and_survives_torch_save(tmp_path: Path) -> None:
    tracker = FakeTracker()
    saved = rng.capture(tracker)
    expected = _draw()
    _draw()
    tracker.states = {"model-parallel-rng": torch.zeros_like(tracker.states["model-parallel-rng"])}
    torch.save(saved, tmp_path / "rng.pt")
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True), tracker)
    again = _draw()
    assert torch.equal(again[0], expected[0])
    assert again[1] == expected[1]
    assert (again[2] == expected[2]).all()
    assert torch.equal(tracker.states["model-parallel-rng"],
                       saved["tracker"]["model-parallel-rng"])


def test_rng_restore_rejects_states_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="no 'cpu' entry"):
        rng.restore({"python": random.getstate()})
    with pytest.raises(ValueError, match="no tracker"):
        rng.restore(rng.capture(FakeTracker()))
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state = {**rng.capture(), "cuda": [torch.get_rng_state()] * (devices + 1)}
    with pytest.raises(ValueError, match="CUDA devices"):
        rng.restore(state)


# --- the loop, on one rank ------------------------------------------------------------------


class ScriptedJob(TrainingJob):
    """Draws from the global generator in compute; fails as ``failures`` says."""

    def __init__(self, failures: dict[int, list[BaseException]] | None = None) -> None:
        self.failures = failures or {}
        self.calls: list[tuple[str, int]] = []
        self.draws: list[tuple[int, float]] = []
        self.applied: list[int] = []

    def build(self, ctx: JobContext) -> None:
        self.ctx = ctx
        torch.manual_seed(7)

    def compute(self, step: int) -> float:
        self.calls.append(("compute", step))
        self.draws.append((step, torch.rand(1).item()))
        if self.failures.get(step):
            raise self.failures[step].pop(0)
        return 0.0

    def apply(self, step: int) -> None:
        self.calls.append(("apply", step))
        self.applied.append(step)

    def discard(self, step: int) -> None:
        self.calls.append(("discard", step))

    def state(self) -> dict[str, Any]:
        return {"applied": list(self.applied)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.applied = list(state["applied"])


@pytest.fixture
def solo(tmp_path: Path) -> JobContext:
    """A one-rank job on real gloo groups."""
    groups = StaticGroups(dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                          tp=1, timeout=10)
    return JobContext(job="solo", rank=0, world_size=1, tp=1, groups=groups,
                      collective_timeout=5)


def _runtime(job: TrainingJob, ctx: JobContext, **kwargs: Any) -> Runtime:
    runtime = Runtime(job, ctx, **kwargs)
    runtime.build()
    return runtime


def test_closed_static_groups_are_released(tmp_path: Path) -> None:
    groups = StaticGroups(dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                          tp=1, timeout=10)
    assert groups.current("dp").size() == 1
    groups.close()
    with pytest.raises(ValueError, match="unknown group 'dp'"):
        groups.current("dp")


def test_run_commits_every_step_and_times_it(solo: JobContext) -> None:
    job = ScriptedJob()
    runtime = _runtime(job, solo)
    assert runtime.run(4) is Outcome.COMPLETED
    assert job.applied == [0, 1, 2, 3] and runtime.step == 4
    assert [(t.step, t.attempt, t.committed) for t in runtime.timings] == [
        (0, 1, True), (1, 1, True), (2, 1, True), (3, 1, True)]
    assert all(t.compute >= 0 and t.vote >= 0 and t.apply >= 0 for t in runtime.timings)


def test_a_failed_compute_is_redone_from_the_same_rng_state(solo: JobContext) -> None:
    job = ScriptedJob({2: [ValueError("bad batch")]})
    runtime = _runtime(job, solo)
    assert runtime.run(4) is Outcome.COMPLETED
    assert job.applied == [0, 1, 2, 3] and runtime.redone == 1
    assert ("discard", 2) in job.calls and job.calls.count(("compute", 2)) == 2
    first, second = [value for step, value in job.draws if step == 2]
    assert first == second
    failed = [t for t in runtime.timings if not t.committed]
    assert [(t.step, t.attempt, t.error) for t in failed] == [(2, 1, "ValueError: bad batch")]


def test_a_step_that_keeps_failing_stops_the_run(solo: JobContext) -> None:
    job = ScriptedJob({1: [ValueError("nan loss")] * 5})
    runtime = _runtime(job, solo, max_attempts=3)
    with pytest.raises(StepFailed, match="step 1 failed its vote 3 times in a row; this "
                       "rank's last error was ValueError: nan loss") as info:
        runtime.run(4)
    assert (info.value.step, info.value.attempts) == (1, 3)
    assert job.applied == [0] and runtime.step == 1


def test_an_aborted_collective_rolls_back_and_propagates(solo: JobContext) -> None:
    aborted = CollectiveAborted("the TP all-reduce timed out", what="the TP all-reduce",
                                waited=2.0)
    job = ScriptedJob({1: [aborted]})
    runtime = _runtime(job, solo)
    with pytest.raises(CollectiveAborted):
        runtime.run(3)
    assert job.calls[-1] == ("discard", 1) and runtime.step == 1
    assert runtime.run(3) is Outcome.COMPLETED  # resumes at the step that aborted
    assert job.applied == [0, 1, 2]


class LosesAPeerInTheVote(NoMigration):
    """The vote of ``step`` aborts once, after this rank computed it (a peer died inside the
    all-reduce: this rank cannot know whether others received the result)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def vote_flag(self, step: int) -> int:
        if step == self.step:
            self.step = -1
            raise CollectiveAborted("the vote on step 2 failed: a peer is gone",
                                    what="the vote", waited=0.1)
        return 0


def _draws_uninterrupted(solo: JobContext, steps: int) -> list[tuple[int, float]]:
    job = ScriptedJob()
    _runtime(job, solo).run(steps)
    return job.draws


@pytest.mark.parametrize("peer_committed", [True, False])
def test_a_step_whose_vote_aborted_stays_pending_until_the_survivors_settle(
        solo: JobContext, peer_committed: bool) -> None:
    expected = _draws_uninterrupted(solo, 5)
    job = ScriptedJob()
    runtime = _runtime(job, solo, hook=LosesAPeerInTheVote(2))
    with pytest.raises(CollectiveAborted):
        runtime.run(5)
    assert runtime.pending is not None and runtime.pending[0] == 2
    assert job.applied == [0, 1] and ("discard", 2) not in job.calls  # gradients kept
    with pytest.raises(RuntimeError, match="call settle"):
        runtime.run(5)
    runtime.settle(3 if peer_committed else 2)
    assert runtime.pending is None
    assert runtime.run(5) is Outcome.COMPLETED
    assert job.applied == [0, 1, 2, 3, 4]
    if peer_committed:  # applied as computed: step 2 ran once, step 3 drew what it would have
        assert job.calls.count(("compute", 2)) == 1
    else:  # discarded and redone from the same generator state
        assert ("discard", 2) in job.calls and job.calls.count(("compute", 2)) == 2
    assert dict(job.draws) == dict(expected)


def test_settling_on_an_unreachable_step_is_refused(solo: JobContext) -> None:
    runtime = _runtime(ScriptedJob(), solo, hook=LosesAPeerInTheVote(2))
    with pytest.raises(CollectiveAborted):
        runtime.run(5)
    with pytest.raises(RuntimeError, match="has committed 2 steps and cannot settle on 4"):
        runtime.settle(4)


class ScriptedHook:
    def __init__(self, actions: dict[int, Action], log: list[tuple[str, int]]) -> None:
        self.actions, self.log = actions, log
        self.handed: dict[str, Any] | None = None

    def on_boundary(self, step: int) -> Action:
        return self.actions.get(step, Action.CONTINUE)

    def switch_groups(self, step: int) -> None:
        self.log.append(("switch", step))

    def hand_off(self, step: int, state: dict[str, Any]) -> bool:
        self.handed = state
        return self.accept_hand_off

    accept_hand_off = True
    flags: dict[int, int] = {}
    agreed: list[tuple[int, int]] = []

    def vote_flag(self, step: int) -> int:
        return self.flags.get(step, 0)

    def on_vote(self, step: int, flag: int) -> None:
        self.agreed.append((step, flag))


def test_boundary_hook_switches_stops_and_hands_off(solo: JobContext) -> None:
    job = ScriptedJob()
    hook = ScriptedHook({1: Action.SWITCH_GROUPS, 2: Action.STOP}, job.calls)
    runtime = _runtime(job, solo, hook=hook)
    assert runtime.run(5) is Outcome.STOPPED
    assert job.calls.index(("switch", 1)) < job.calls.index(("compute", 1))
    assert runtime.step == 2
    hook.actions = {3: Action.HAND_OFF}
    assert runtime.run(5) is Outcome.HANDED_OFF
    assert hook.handed is not None
    assert hook.handed["runtime"]["step"] == 3 and hook.handed["job"]["applied"] == [0, 1, 2]


def test_declined_hand_off_keeps_training_and_the_vote_carries_the_flag(
        solo: JobContext) -> None:
    job = ScriptedJob()
    hook = ScriptedHook({1: Action.HAND_OFF}, job.calls)
    hook.accept_hand_off, hook.flags, hook.agreed = False, {0: 7, 2: 9}, []
    runtime = _runtime(job, solo, hook=hook)
    assert runtime.run(3) is Outcome.COMPLETED
    assert job.applied == [0, 1, 2], "a declined hand-off runs the step"
    assert hook.agreed == [(0, 7), (1, 0), (2, 9)], "one rank: the minimum is its own flag"


def test_state_moves_to_a_new_runtime(solo: JobContext) -> None:
    source = _runtime(ScriptedJob(), solo)
    source.run(3)
    state = source.state()
    expected = torch.rand(1).item()
    target_job = ScriptedJob()
    target = _runtime(target_job, solo)  # build reseeds the generator
    target.load_state(state)
    assert target.step == 3 and target_job.applied == [0, 1, 2]
    assert torch.rand(1).item() == expected
    with pytest.raises(ValueError, match="lacks"):
        target.load_state({"job": {}})


# --- the example job as four real processes -------------------------------------------------

WORLD, TP = 4, 2
STEPS, SNAPSHOT_AT, FAIL_AT, FREEZE_AT = 10, 4, 6, 3
LAUNCH_TIMEOUT = 60.0  # four processes importing torch on two cores take ~13 s


@contextmanager
def ranks(base: Path, name: str, *args: str,
          per_rank: dict[int, list[str]] | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start the example as ranks 0..3 under ``base/name``; kill what is left on the way out."""
    where = base / name
    where.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(WORLD):
            child_env = {**os.environ, "OMP_NUM_THREADS": "1",
                         env.CHILD_ERROR_FILE: str(where / f"error-rank{r}.json")}
            with open(where / f"log-rank{r}.txt", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(EXAMPLE), "--rank", str(r), "--world-size", str(WORLD),
                     "--tp", str(TP), "--store", str(where / "store"), "--save",
                     str(where / "out"), "--adam", "functional", *args,
                     *(per_rank or {}).get(r, [])],
                    stdout=log, stderr=subprocess.STDOUT, env=child_env))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a SIGSTOPped process
        for p in procs:
            p.wait(timeout=10)


def _logs(where: Path) -> str:
    return "\n".join(f"--- rank {r}:\n" + (where / f"log-rank{r}.txt").read_text()[-3000:]
                     for r in range(WORLD))


def _wait_for(ready: Callable[[], bool], procs: list[subprocess.Popen[bytes]], where: Path,
              what: str, failure_ends_it: bool = True) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not ready():
        codes = [p.poll() for p in procs]
        if failure_ends_it and any(c not in (None, 0) for c in codes):
            pytest.fail(f"a rank failed (exit codes {codes}) while waiting for {what}:\n"
                        f"{_logs(where)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {LAUNCH_TIMEOUT:g} s:\n{_logs(where)}")
        time.sleep(0.05)


def run_job(base: Path, name: str, *args: str,
            per_rank: dict[int, list[str]] | None = None) -> Path:
    """Run the example to completion on every rank; its output directory."""
    with ranks(base, name, *args, per_rank=per_rank) as procs:
        _wait_for(lambda: all(p.poll() == 0 for p in procs), procs, base / name,
                  "clean exit of every rank")
    return base / name / "out"


def load(out: Path, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(out / f"rank{rank}.pt", weights_only=True)
    return state


def assert_bitwise_equal(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                           b.reshape(-1).contiguous().view(torch.uint8)), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_training(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same parameters, optimizer, schedule, data position, RNGs and step."""
    assert_bitwise_equal(a["job"], b["job"], "job")
    assert_bitwise_equal(a["rng"], b["rng"], "rng")
    assert a["runtime"]["step"] == b["runtime"]["step"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of STEPS steps, with a snapshot after SNAPSHOT_AT (one per test
    run, shared by every xdist worker: four ranks importing torch on two cores take ~14 s)."""
    return build_once(tmp_path_factory, "runtime-baseline",
                      lambda base: run_job(base, "baseline", "--steps", str(STEPS),
                                           "--snapshot-at", str(SNAPSHOT_AT)))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_runs_are_bitwise_identical(baseline: Path, tmp_path: Path) -> None:
    again = run_job(tmp_path, "again", "--steps", str(STEPS))
    for r in range(WORLD):
        final = load(baseline, r)
        assert final["runtime"]["step"] == STEPS
        assert_same_training(final, load(again, r))
        # It trained, and the DP all-reduce kept the replicas of each shard in step.
        snapshot = load(baseline / "snapshot", r)
        w1 = "block0_w1"
        assert not torch.equal(final["job"]["params"][w1], snapshot["job"]["params"][w1])
        replica = load(baseline, (r + TP) % WORLD)
        assert_bitwise_equal(final["job"]["params"], replica["job"]["params"])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_state_moved_to_fresh_processes_continues_bitwise(baseline: Path,
                                                          tmp_path: Path) -> None:
    resumed = run_job(tmp_path, "resumed", "--steps", str(STEPS), "--load",
                      str(baseline / "snapshot"))
    for r in range(WORLD):
        assert load(baseline / "snapshot", r)["runtime"]["step"] == SNAPSHOT_AT
        assert_same_training(load(baseline, r), load(resumed, r))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_step_failing_on_one_rank_applies_nowhere_and_is_redone(baseline: Path,
                                                                   tmp_path: Path) -> None:
    out = run_job(tmp_path, "fault", "--steps", str(STEPS),
                  per_rank={1: ["--fail-at", str(FAIL_AT)]})
    for r in range(WORLD):
        state = load(out, r)
        assert state["runtime"]["redone"] == 1
        # Transient: the redone step leaves exactly what an uninterrupted run has.
        assert_same_training(load(baseline, r), state)
        timings = [t for t in _summary(out, r)["timings"] if t["step"] == FAIL_AT]
        assert [(t["attempt"], t["committed"]) for t in timings] == [(1, False), (2, True)]
        expected = f"RuntimeError: injected fault at step {FAIL_AT}" if r == 1 else None
        assert timings[0]["error"] == expected


def _summary(out: Path, rank: int) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / f"rank{rank}.json").read_text())
    return summary


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_vote_is_released_when_a_peer_freezes(tmp_path: Path) -> None:
    timeout = 2.0
    where = tmp_path / "freeze"
    errors = [where / f"error-rank{r}.json" for r in range(WORLD - 1)]
    with ranks(tmp_path, "freeze", "--steps", str(STEPS), "--collective-timeout", str(timeout),
               "--group-timeout", "60", per_rank={3: ["--freeze-at", str(FREEZE_AT)]}) as procs:
        _wait_for(lambda: all(e.exists() for e in errors), procs, where,
                  "CollectiveAborted from every survivor", failure_ends_it=False)
        frozen_at = float((where / "out" / "frozen-rank3").read_text())
        assert psutil.Process(procs[3].pid).status() == psutil.STATUS_STOPPED
        for path in errors:
            record = read_error(path)
            assert record is not None
            assert record.exc_type == "understudy.groups.errors.CollectiveTimeout"
            assert f"the vote on step {FREEZE_AT} timed out" in record.message
            assert timeout - 0.5 <= record.time - frozen_at <= timeout + 1.0


# --- a joiner following its leaver (the state sent ahead) -----------------------------------


def _plain_example() -> Any:
    spec = importlib.util.spec_from_file_location("plain_train_runtime", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Forwarding:
    """The leaver's side as :class:`~understudy.worker.migration.MigrationHook` drives it, with
    each message deep-copied where the wire would carry it: the state at ``ahead``'s boundary,
    each committed step's apply inputs, the RNGs and counters at ``switch``."""

    def __init__(self, ahead: int, switch: int) -> None:
        self.ahead, self.switch = ahead, switch
        self.state: dict[str, Any] | None = None
        self.inputs: list[tuple[int, dict[str, Any]]] = []
        self.after: list[dict[str, Any]] = []
        self.tail: dict[str, Any] | None = None

    def on_boundary(self, step: int) -> Action:
        if step == self.switch:
            return Action.HAND_OFF
        return Action.SEND_AHEAD if step == self.ahead else Action.CONTINUE

    def send_ahead(self, step: int, state: dict[str, Any]) -> None:
        self.state = copy.deepcopy(state)

    def before_apply(self, step: int, job: TrainingJob, after: dict[str, Any]) -> None:
        if self.state is not None:
            self.inputs.append((step, copy.deepcopy(job.apply_inputs(step))))
            self.after.append(after)

    def hand_off(self, step: int, state: dict[str, Any]) -> bool:
        self.tail = copy.deepcopy({"rng": state["rng"], "runtime": state["runtime"]})
        return True

    def switch_groups(self, step: int) -> None:
        raise AssertionError("a leaver never switches")

    def vote_flag(self, step: int) -> int:
        return 0

    def on_vote(self, step: int, flag: int) -> None:
        return None


def _tensors(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    items = tree.items() if isinstance(tree, dict) else \
        enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{path}/{key}").items()}


def test_a_joiner_that_replays_its_leavers_steps_ends_bitwise_equal(solo: JobContext) -> None:
    train = _plain_example()
    assert replays(train.PlainJob()) and not replays(train.WholeHandOffJob())
    assert not replays(ScriptedJob())
    reference = _runtime(train.PlainJob(), solo)
    reference.run(12)
    want = copy.deepcopy(reference.state())

    hook = Forwarding(ahead=4, switch=8)
    leaver = _runtime(train.PlainJob(), solo, hook=hook)
    assert leaver.run(12) is Outcome.HANDED_OFF and leaver.step == 8
    assert hook.state is not None and hook.state["runtime"]["step"] == 4
    assert [s for s, _ in hook.inputs] == [4, 5, 6, 7]

    joiner = _runtime(train.PlainJob(), solo)
    joiner.load_state(hook.state)
    with pytest.raises(ValueError, match="step 5 cannot be replayed here: the next step is 4"):
        joiner.replay(5, hook.inputs[1][1])
    for step, inputs in hook.inputs:
        joiner.replay(step, inputs)
    assert hook.tail is not None
    with pytest.raises(ValueError, match="the leaver has committed 9 steps, this joiner "
                                         "applied 8"):
        joiner.load_counters(hook.tail["rng"], {**hook.tail["runtime"], "step": 9})
    joiner.load_counters(hook.tail["rng"], hook.tail["runtime"])
    assert joiner.run(12) is Outcome.COMPLETED
    _assert_same_run(joiner.state(), want)


def _assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Two runtimes' states are the same run: counters, and every tensor bit for bit."""
    assert got["runtime"] == want["runtime"]
    mine, theirs = _tensors(got["job"]), _tensors(want["job"])
    assert mine.keys() == theirs.keys() and len(mine) > 10
    different = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not different, different


def _land(inputs: dict[str, Any], piece: int) -> tuple[dict[str, Any], Landing, Callable[[], None]]:
    """``inputs`` as a joiner's receive would hand them out: a tree of empty tensors, a
    :class:`Landing`, and what writes the values in, ``piece`` bytes at a time (tensors in
    order), telling the landing as it goes, with pauses, so that the job waits on it."""
    tree = copy.deepcopy(inputs)
    want = list(_tensors(inputs).values())
    got = list(_tensors(tree).values())
    for t in got:
        t.zero_()
    landing = Landing()
    landing.begin(tree, got)

    def feed() -> None:
        for k, (src, dst) in enumerate(zip(want, got, strict=True)):
            s, d = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
            for lo in range(0, s.numel(), piece):
                d[lo:lo + piece] = s[lo:lo + piece]
                landing.landed(k, min(s.numel(), lo + piece))
                time.sleep(0.0005)
        landing.finish()

    return tree, landing, feed


@pytest.mark.parametrize("adam", ["class", "functional"])
def test_a_joiner_applying_each_step_as_it_lands_ends_bitwise_equal(
        solo: JobContext, adam: str) -> None:
    # The example's apply_landing: Adam a landed range at a time (the pieces here are 64 B, a
    # parameter's gradient lands in many), on another thread than the one writing the bytes.
    train = _plain_example()
    assert applies_landing(train.LandingJob()) and not applies_landing(train.PlainJob())
    assert not applies_landing(train.ShardedJob()) and not applies_landing(ScriptedJob())
    with pytest.raises(ValueError, match="not with --shard-optimizer"):
        train.landing_hand_off(train.ShardedJob)
    reference = _runtime(train.PlainJob(adam=adam), solo)
    reference.run(12)
    want = copy.deepcopy(reference.state())

    hook = Forwarding(ahead=4, switch=8)
    leaver = _runtime(train.PlainJob(adam=adam), solo, hook=hook)
    assert leaver.run(12) is Outcome.HANDED_OFF
    assert hook.after == [{"step": s + 1, "redone": 0} for s in (4, 5, 6, 7)]
    joiner = _runtime(train.LandingJob(adam=adam), solo)
    joiner.load_state(hook.state)
    for step, inputs in hook.inputs:
        tree, landing, feed = _land(inputs, piece=64)
        feeder = threading.Thread(target=feed)
        feeder.start()
        joiner.replay_landing(step, tree, landing)
        feeder.join()
    assert hook.tail is not None
    joiner.load_counters(hook.tail["rng"], hook.tail["runtime"])
    assert joiner.run(12) is Outcome.COMPLETED
    _assert_same_run(joiner.state(), want)


class HandingOff(Forwarding):
    """:class:`Forwarding`, whose hook says the joiner took the step before ``switch`` with the
    rank (``before_apply`` returns True there), as MigrationHook does once the switch's word
    went with that step's inputs."""

    def before_apply(self, step: int, job: TrainingJob, after: dict[str, Any]) -> bool:
        super().before_apply(step, job, after)
        return step == self.switch - 1


def test_a_leaver_whose_joiner_took_the_step_leaves_without_applying_it(
        solo: JobContext) -> None:
    train = _plain_example()
    reference = _runtime(train.PlainJob(), solo)
    reference.run(7)  # the leaver applies steps 0..6; step 7 is the joiner's
    hook = HandingOff(ahead=4, switch=8)
    leaver = _runtime(train.PlainJob(), solo, hook=hook)
    assert leaver.run(12) is Outcome.HANDED_OFF and leaver.left
    assert leaver.step == 8 and leaver.job.committed == 8  # the step counts as committed
    assert [t.step for t in leaver.timings if t.committed][-1] == 7
    assert hook.tail is None, "no hand-off at a boundary: the rank left at step 7's apply"
    mine, theirs = _tensors(leaver.state()["job"]["params"]), \
        _tensors(reference.state()["job"]["params"])
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs), "step 7 was not applied here"
    # and the joiner, replaying 4..7, ends where an uninterrupted run does
    want = _runtime(train.PlainJob(), solo)
    want.run(12)
    joiner = _runtime(train.PlainJob(), solo)
    joiner.load_state(hook.state)
    for step, inputs in hook.inputs:
        joiner.replay(step, inputs)
    joiner.load_counters(leaver.state()["rng"], hook.after[-1])
    assert joiner.run(12) is Outcome.COMPLETED
    _assert_same_run(joiner.state(), want.state())


def test_a_hook_with_the_two_argument_before_apply_still_works(solo: JobContext) -> None:
    class Old(NoMigration):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def before_apply(self, step: int, job: TrainingJob) -> None:
            self.seen.append(step)

    hook = Old()
    runtime = _runtime(_plain_example().PlainJob(), solo, hook=hook)
    assert runtime.run(3) is Outcome.COMPLETED and hook.seen == [0, 1, 2]


def test_a_transfer_failing_mid_landing_fails_the_apply(solo: JobContext) -> None:
    train = _plain_example()
    hook = Forwarding(ahead=2, switch=4)
    assert _runtime(train.PlainJob(), solo, hook=hook).run(6) is Outcome.HANDED_OFF
    joiner = _runtime(train.LandingJob(), solo)
    joiner.load_state(hook.state)
    tree, landing, _ = _land(hook.inputs[0][1], piece=64)
    landing.landed(0, 64)
    threading.Timer(0.05, landing.fail, (TransferError("the leaver died"),)).start()
    with pytest.raises(TransferError, match="the transfer failed: the leaver died"):
        joiner.replay_landing(2, tree, landing)
    with pytest.raises(ValueError, match="is not one of this transfer's"):
        landing.wait(torch.zeros(3))


def test_the_functional_adam_trains_the_bits_of_torch_optim_adam(solo: JobContext) -> None:
    # The tests run the example with --adam functional (torch.optim.adam.adam, without the
    # class that imports torch._dynamo): it must be the class's update, bit for bit.
    train = _plain_example()
    runs = {}
    for adam in ("class", "functional"):
        runtime = _runtime(train.PlainJob(adam=adam), solo)
        runtime.run(25)
        runs[adam] = runtime.state()["job"]
    cls, fn = runs["class"], runs["functional"]
    names = list(cls["params"])
    assert names == list(fn["params"]) and len(names) >= 6
    for i, name in enumerate(names):
        assert torch.equal(cls["params"][name], fn["params"][name]), name
        kept = cls["optimizer"]["state"][i]
        for part in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(kept[part], fn["optimizer"][part][i]), (name, part)
    assert cls["schedule"]["last_epoch"] == fn["schedule"]["last_epoch"] == 25
    # and it learned something: Adam moved every parameter off its start
    fresh = train.PlainJob(adam="functional")
    fresh.build(solo)
    assert all(not torch.equal(fresh.params[n], fn["params"][n]) for n in names)


def test_a_held_job_starts_no_step_from_the_hold_on_until_its_file_exists(
        solo: JobContext, tmp_path: Path) -> None:
    # examples/plain_torch/train.py --hold-until (the benchmarks hold their job once the
    # standbys' recording is taken, until the standbys are warm): it never changes the state.
    train = _plain_example()
    gate = tmp_path / "go"
    held = _runtime(train.PlainJob(adam="functional", hold=(2, gate)), solo)
    runner = threading.Thread(target=held.run, args=(6,), daemon=True)
    runner.start()
    deadline = time.monotonic() + 20  # steps 0 and 1 run, however loaded the machine
    while held.step < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)
    assert held.step == 2 and runner.is_alive()  # step 2 waits
    gate.touch()
    runner.join(timeout=20)
    assert not runner.is_alive() and held.step == 6
    plain = _runtime(train.PlainJob(adam="functional"), solo)
    plain.run(6)
    a, b = held.state()["job"], plain.state()["job"]
    assert list(a["params"]) == list(b["params"])
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "3", "--hold-at", "-1"])
    args = train.parse_args(["--steps", "3", "--hold-until", str(gate)])
    assert args.hold_at == 2 and args.hold_until == gate
