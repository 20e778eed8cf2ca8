"""The sandbox: record a rank's collectives on real gloo groups, replay them without a network.

Ranks are threads (bootstrap through a HashStore) in the fast tests, and processes (a FileStore)
in the slow one, which also replays in a fresh process inside a network namespace of its own
and watches its sockets from outside.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.unit import test_groups as _groups_tests
from understudy.groups.errors import NoCurrentVersionError
from understudy.groups.groupset import GroupSet
from understudy.groups.versioned import FORWARDED, VersionedGroup
from understudy.sandbox import ops
from understudy.sandbox.errors import RecordingError, RecordingMismatch, ReplayDiverged
from understudy.sandbox.manifest import (
    MANIFEST,
    CodeVersion,
    Expectation,
    Layout,
    RoleType,
    Stage,
    atomic_write,
    read_manifest,
    recording_ranks,
    role_directory,
)
from understudy.sandbox.recording import Recorder, RecordingGroup, RecordState
from understudy.sandbox.replay import Recording, ReplayGroups
from understudy.sandbox.warmup import SandboxTarget, WarmupOutcome, warm_up
from understudy.worker.api import JobContext, allreduce_options
from understudy.worker.migration import JobGroups
from understudy.worker.runtime import Runtime, StaticGroups

pytestmark = pytest.mark.timeout(60)

WORKERS = Path(__file__).resolve().parents[1] / "workers"


def _load_common() -> Any:
    """``tests/workers/sandbox_common.py``, shared with the worker scripts, without putting
    the workers' folder on ``sys.path`` for the whole session."""
    spec = importlib.util.spec_from_file_location("understudy_sandbox_common",
                                                  WORKERS / "sandbox_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_common = _load_common()
JOB, SCRIPT, SEED, plain_example = (_common.JOB, _common.SCRIPT, _common.SEED,
                                    _common.plain_example)

CODE = CodeVersion.of(SCRIPT)
ROLE = RoleType(Stage.ONLY, 0, 1)


def run_ranks(fns: dict[int, Callable[[], Any]], timeout: float = 30.0) -> dict[int, Any]:
    """As tests/unit/test_groups.py's, keyed by rank."""
    return _groups_tests.run_ranks(fns, timeout)  # type: ignore[arg-type,return-value]


def socket_inodes(pid: int | str = "self") -> set[str]:
    """The sockets a process holds, of any family, from its file descriptors."""
    found = set()
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:"):
                    found.add(target)
    return found


class LossJob(plain_example().PlainJob):  # type: ignore[misc]
    """The plain-torch example job, keeping each step's loss and the sockets the process held
    in the middle of each compute."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.losses: dict[int, float] = {}
        self.sockets: list[set[str]] = []

    def compute(self, step: int) -> float:
        loss = float(super().compute(step))
        self.losses[step] = loss
        self.sockets.append(socket_inodes())
        return loss


# Threads share the process-global generator; with dropout off, the job draws from it nowhere.
THREAD_JOB = {"dropout": 0.0}


# -- the op table ------------------------------------------------------------------------------

def test_the_sandbox_knows_every_method_a_versioned_group_forwards() -> None:
    assert set(FORWARDED) == set(ops.OPS)


# -- every collective, recorded and replayed ---------------------------------------------------

def gloo_groups(size: int) -> list[dist.ProcessGroup]:
    store = dist.HashStore()

    def build(rank: int) -> dist.ProcessGroup:
        s = dist.PrefixStore("g", store)
        backend = dist.ProcessGroupGloo(s, rank, size, timedelta(seconds=10))
        pg = dist.ProcessGroup(s, rank, size)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        return pg

    out = run_ranks({r: functools.partial(build, r) for r in range(size)})
    return [out[r] for r in range(size)]


def every_collective(g: dist.ProcessGroup, r: int) -> list[torch.Tensor]:
    """One call of each kind torch.distributed offers on a group, with rank-dependent inputs;
    returns every output."""
    out: list[torch.Tensor] = []
    t = torch.arange(3.0) + r
    dist.all_reduce(t, group=g)
    out.append(t)
    m = torch.tensor([r + 1], dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=g)
    out.append(m)
    gathered = [torch.zeros(2), torch.zeros(2)]
    dist.all_gather(gathered, torch.full((2,), float(r)), group=g)
    out += gathered
    with warnings.catch_warnings():  # torch 2.13 deprecates these two; Megatron calls them
        warnings.simplefilter("ignore", FutureWarning)
        flat = torch.zeros(4)
        dist.all_gather_into_tensor(flat, torch.full((2,), r + 0.5), group=g)
        scattered = torch.zeros(2)
        dist.reduce_scatter_tensor(scattered, torch.arange(4.0) * (r + 1), group=g)
    out += [flat, scattered]
    b = torch.full((2,), float(r + 7))
    dist.broadcast(b, group=g, group_src=1)
    out.append(b)
    red = torch.full((2,), float(r + 1))
    dist.reduce(red, group=g, group_dst=0)
    out.append(red)
    a2a = torch.zeros(2)
    dist.all_to_all_single(a2a, torch.tensor([10.0 * r, 10.0 * r + 1]), group=g)
    out.append(a2a)
    coalesced = [torch.ones(2) * (r + 1), torch.ones(3) * (r + 2)]
    g.allreduce_coalesced(coalesced, dist.AllreduceCoalescedOptions()).wait()
    out += coalesced
    if r == 0:
        dist.send(torch.tensor([5.0, 6.0]), group=g, group_dst=1)
    else:
        got = torch.zeros(2)
        dist.recv(got, group=g, group_src=0)
        out.append(got)
    dist.barrier(group=g)
    work = g.allreduce([torch.ones(1) * (r + 3)], dist.AllreduceOptions())
    work.wait()
    out += work.get_future().value()
    return out


class OneGroup:
    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg

    def current(self, name: str) -> dist.ProcessGroup:
        return self.pg


def test_every_collective_is_recorded_and_replayed_bitwise(tmp_path: Path) -> None:
    pgs = gloo_groups(2)
    layout = Layout(2, 1)
    for pg in pgs:  # as new_group would: dist.recv asks for the sender's global rank
        dist.distributed_c10d._world.pg_group_ranks[pg] = {0: 0, 1: 1}

    def record(r: int) -> list[torch.Tensor]:
        recorder = Recorder(tmp_path / f"rank{r}", job=JOB, layout=layout, rank=r,
                            iterations=1, code=CODE, background=False)
        group = recorder.provider(OneGroup(pgs[r])).current("world")
        assert isinstance(group, RecordingGroup)
        try:
            recorder.boundary(0)
            outputs = every_collective(group, r)
            recorder.boundary(1)
        finally:
            group.unregister()
        assert recorder.state is RecordState.WRITTEN, recorder.reason
        return outputs

    try:
        real = run_ranks({r: functools.partial(record, r) for r in range(2)})
    finally:
        for pg in pgs:
            dist.distributed_c10d._world.pg_group_ranks.pop(pg, None)
    for r in range(2):
        replay = ReplayGroups(Recording.load(tmp_path / f"rank{r}", ROLE))
        try:
            group = replay.current("world")
            assert (group.rank(), group.size()) == (r, 2)
            assert group._device_types == [torch.device("cpu")]
            replayed = every_collective(group, r)
        finally:
            replay.close()
        assert len(replayed) == len(real[r])
        for got, want in zip(replayed, real[r], strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), (r, got, want)
        assert replay.inputs_differed == 0 and replay.remaining() == 0
        assert replay.diverged is None


# -- a plain job: record in threads, replay in this process -----------------------------------

@dataclass
class Recorded:
    directory: Path
    losses: dict[int, dict[int, float]]
    states: dict[int, dict[str, Any]]  # after the recorded iterations
    summary: dict[str, Any]


RECORD, STEPS = 2, 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """TP=1 x DP=2 of the plain-torch job, three steps; rank 0 records the first two."""
    directory = tmp_path_factory.mktemp("recordings")
    store, layout = dist.HashStore(), Layout(2, 1)
    assert recording_ranks(layout) == {ROLE.key: 0}

    def rank(r: int) -> tuple[dict[int, float], dict[str, Any], dict[str, Any]]:
        real = StaticGroups(store, rank=r, world_size=2, tp=1, timeout=20)
        recorder = None
        if r == 0:
            recorder = Recorder(directory, job=JOB, layout=layout, rank=r, iterations=RECORD,
                                code=CODE)
        groups = real if recorder is None else recorder.provider(real)
        ctx = JobContext(job=JOB, rank=r, world_size=2, tp=1, groups=groups, seed=SEED)
        job = LossJob(**THREAD_JOB)
        runtime = Runtime(job, ctx)
        runtime.build()
        summary: dict[str, Any] = {}
        if recorder is not None:
            runtime.hook = recorder.hook(runtime.hook)
            summary["wrapped"] = all(isinstance(ctx.group(n), RecordingGroup)
                                     for n in ("tp", "dp", "world"))
        kept = ctx.group("world")
        runtime.run(RECORD)
        state = clone(job.state())
        runtime.run(STEPS)
        if recorder is not None:
            summary["state"] = recorder.wait(timeout=20)
            summary["manifest"] = recorder.manifest
            summary["real_after"] = all(ctx.group(n) is real.current(n)
                                        for n in ("tp", "dp", "world"))
        # A group object kept from the recording still works, and records nothing more.
        t = torch.ones(2)
        ctx.wait(kept.allreduce([t], allreduce_options(dist.ReduceOp.SUM)), "the kept group")
        summary["kept"] = t.tolist()
        if recorder is not None:
            summary["closed"] = recorder.close(timeout=20)
        return job.losses, state, summary

    results = run_ranks({r: functools.partial(rank, r) for r in range(2)})
    return Recorded(directory, {r: results[r][0] for r in results},
                    {r: results[r][1] for r in results}, results[0][2])


def clone(state: Any) -> Any:
    """A deep copy of a state's tensors (a job hands out its live ones)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(clone(v) for v in state)
    return state


def assert_same_state(got: Any, want: Any, where: str = "state") -> None:
    """Bitwise equality of two states, tensors included."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_same_state(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_state(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def target(rank: int = 0, **changes: Any) -> SandboxTarget:
    base = SandboxTarget(job=JOB, world_size=2, tp=1, rank=rank, script=SCRIPT, seed=SEED)
    return replace(base, **changes)


@contextlib.contextmanager
def own_rng() -> Iterator[None]:
    """The job seeds the process-global generators; give them back to the test session."""
    with torch.random.fork_rng(devices=[]):
        yield


def test_the_recorder_records_its_iterations_then_hands_out_the_real_groups(
        recorded: Recorded) -> None:
    s = recorded.summary
    assert s["wrapped"] and s["real_after"], "wrapped while recording, the real groups after"
    assert s["state"] is RecordState.WRITTEN and s["closed"] is RecordState.WRITTEN
    m = s["manifest"]
    # Per step: the TP all-reduce in forward and the one of the block's input gradient (a
    # group of one here), the DP gradient all-reduce, the vote.
    assert m.segments == {"build": 0, "0": 4, "1": 4} and m.calls == 8
    assert (m.iterations, m.first_step, m.rank, m.role_type) == (2, 0, 0, ROLE.key)
    assert m.groups == {"tp": [0, 1], "dp": [0, 2], "world": [0, 2]}
    assert s["kept"] == [2.0, 2.0]
    # Steps after the recording and the kept group's call left the recording as it was.
    assert read_manifest(role_directory(recorded.directory, ROLE)) == m
    folder = role_directory(recorded.directory, ROLE)
    assert sorted(p.name for p in folder.iterdir()) == sorted([MANIFEST, m.data_file])


def test_shadow_iterations_reproduce_the_recording_rank_bitwise(recorded: Recorded) -> None:
    before = socket_inodes()
    job = LossJob(**THREAD_JOB)
    with own_rng():
        warmed = warm_up(lambda: job, target(0), recorded.directory)
    report = warmed.report
    assert report.outcome is WarmupOutcome.SHADOWED, report.fallback_reason
    assert report.iterations == RECORD and len(report.shadow_s) == RECORD
    assert report.calls_answered == 8 and report.inputs_differed == 0
    assert list(report.losses) == [recorded.losses[0][s] for s in range(RECORD)]
    assert_same_state(job.state(), recorded.states[0])
    # Shadow results go nowhere: the runtime starts over, on the original job object.
    assert warmed.runtime.job is job and warmed.runtime.step == 0
    assert not warmed.runtime.timings
    # No socket was opened while the shadow iterations ran, nor after.
    assert all(s <= before for s in job.sockets) and socket_inodes() <= before
    assert "2 shadow iterations" in report.summary()


def test_another_replica_of_the_role_type_replays_the_same_recording(
        recorded: Recorded) -> None:
    """Rank 1 is the other DP replica of role type tp-0-of-1: its inputs differ (its own
    batches), and rank 0's recorded outputs answer it all the same."""
    job = LossJob(**THREAD_JOB)
    with own_rng():
        report = warm_up(lambda: job, target(1), recorded.directory).report
    assert report.outcome is WarmupOutcome.SHADOWED, report.fallback_reason
    # The TP all-reduces (a group of one: forward, input gradient) and the DP all-reduce of
    # each step; the votes were the same.
    assert report.inputs_differed == 3 * RECORD
    assert len(report.losses) == RECORD and job.committed == RECORD
    with own_rng():
        strict = warm_up(lambda: LossJob(**THREAD_JOB), target(1), recorded.directory,
                         strict_inputs=True).report
    assert strict.outcome is WarmupOutcome.PLAIN
    assert "inputs of allreduce differ" in str(strict.fallback_reason)


def test_promotion_points_the_warmed_job_at_the_real_groups(recorded: Recorded) -> None:
    with own_rng():
        warmed = warm_up(lambda: LossJob(**THREAD_JOB), target(0), recorded.directory, 1)
    assert warmed.report.iterations == 1
    sentinel = object()

    class Real:
        def current(self, name: str) -> Any:
            return sentinel

    runtime = warmed.promote(Real())
    assert runtime.ctx.group("dp") is sentinel
    with pytest.raises(RuntimeError, match="promoted already"):
        warmed.promote(Real())


def test_on_stable_groups_the_replay_stands_in_and_promotion_keeps_the_objects(
        recorded: Recorded) -> None:
    # What a standby's launcher does: the job is built on the stable groups of the rank it
    # warms as (Megatron keeps them), the replay answering as their version 0.
    groups = GroupSet(JOB, "r0-sandbox", store_factory=lambda ns, cancel: dist.HashStore())
    job = LossJob(**THREAD_JOB)
    with own_rng():
        warmed = warm_up(lambda: job, target(0), recorded.directory, groups=groups)
    assert warmed.report.outcome is WarmupOutcome.SHADOWED, warmed.report.fallback_reason
    assert warmed.report.calls_answered == 8
    assert_same_state(job.state(), recorded.states[0])
    dp = warmed.runtime.ctx.group("dp")
    assert isinstance(dp, VersionedGroup) and dp.version is not None and dp.version.number == 0
    layout = target(0).layout

    class Elsewhere:
        def current(self, name: str) -> Any:
            return VersionedGroup(name, 0, 2)

    with pytest.raises(ValueError, match="not the stable group the job was built on"):
        warmed.promote(Elsewhere())
    runtime = warmed.promote(JobGroups(groups, 0, layout))
    # The same objects, no stand-in left: nothing reaches the replay after promotion, and the
    # groups wait for the joiner's switch.
    assert runtime.ctx.group("dp") is dp and dp.version is None
    with pytest.raises(NoCurrentVersionError):
        dp.allreduce([torch.zeros(1)], allreduce_options(dist.ReduceOp.SUM))
    groups.close()


def test_a_diverging_job_falls_back_to_a_plain_warm_start(recorded: Recorded) -> None:
    # Another hidden size: the gradient all-reduce has another shape.
    job = LossJob(hidden=32, **THREAD_JOB)
    with own_rng():
        warmed = warm_up(lambda: job, target(0), recorded.directory)
    report = warmed.report
    assert report.outcome is WarmupOutcome.PLAIN and report.iterations == 0
    reason = str(report.fallback_reason)
    assert "shadow iteration 0 diverged" in reason and "call 0 on group 'dp'" in reason
    assert "float32[1616]" in reason and "float32[2672]" in reason, reason
    # The model is built and parked, at step 0, its shadow step rolled back.
    assert warmed.runtime.job is job and job.params["block0_w1"].shape == (32, 16)
    assert warmed.runtime.step == 0 and "Plain warm start" in report.summary()


def test_a_job_failing_in_the_sandbox_falls_back_without_applying(recorded: Recorded) -> None:
    """The replayed vote says what the recording rank voted (yes); a shadow step whose compute
    failed must still not be applied."""
    job = LossJob(fail_at=0, **THREAD_JOB)
    with own_rng():
        warmed = warm_up(lambda: job, target(0), recorded.directory)
    report = warmed.report
    assert report.outcome is WarmupOutcome.PLAIN
    assert report.fallback_reason == ("shadow iteration 0 failed: the job's compute raised "
                                      "RuntimeError: injected fault at step 0")
    assert job.committed == 0 and report.inputs_differed == 1  # the vote said no


def test_replay_refuses_a_call_that_is_not_the_recorded_one(recorded: Recorded) -> None:
    recording = Recording.load(recorded.directory, ROLE)
    replay = ReplayGroups(recording)
    try:
        dp = replay.current("dp")
        with pytest.raises(ReplayDiverged, match=r"call 0 on group 'dp'.*op is broadcast, the "
                                                 r"recording has allreduce"):
            dp.broadcast([torch.zeros(2128)], dist.BroadcastOptions())
        with pytest.raises(ReplayDiverged, match="diverged earlier"):
            replay.current("world").barrier()
        with pytest.raises(ValueError, match="unknown group 'pp'"):
            replay.current("pp")
    finally:
        replay.close()
    replay = ReplayGroups(recording)
    try:
        world = replay.current("world")
        votes = torch.tensor([1, 0, 0])
        for _ in range(RECORD):
            world.allreduce([votes], allreduce_options(dist.ReduceOp.MIN)).wait()
        with pytest.raises(ReplayDiverged, match=r"only 2 calls on this group \(it ran out\)"):
            world.allreduce([votes], allreduce_options(dist.ReduceOp.MIN))
    finally:
        replay.close()
    replay = ReplayGroups(recording)
    try:
        with pytest.raises(ReplayDiverged, match=r"parameters are \{'arg1': "
                                                 r"'AllreduceOptions\(reduceOp=MAX\)'\}"):
            replay.current("world").allreduce([votes], allreduce_options(dist.ReduceOp.MAX))
    finally:
        replay.close()


def test_a_recording_for_something_else_is_refused(recorded: Recorded) -> None:
    right = Expectation(JOB, Layout(2, 1), ROLE, CODE)
    Recording.load(recorded.directory, ROLE, right)
    cases = {
        "job": (replace(right, job="other"), "belongs to job 'sandbox-test', not 'other'"),
        "layout": (replace(right, layout=Layout(4, 1)),
                   "made with world 2 = TP 1 x DP 2 x PP 1, but this process runs world 4"),
        "code": (replace(right, code=replace(CODE, torch="9.9")),
                 "made by other code \\(torch '2.13"),
    }
    for field, (expect, message) in cases.items():
        with pytest.raises(RecordingMismatch, match=message) as info:
            Recording.load(recorded.directory, ROLE, expect)
        assert info.value.field == field
    other_role = RoleType(Stage.ONLY, 1, 2)
    with pytest.raises(RecordingError, match=r"no recording at .*stage-only\.tp-1-of-2"):
        Recording.load(recorded.directory, other_role, replace(right, role_type=other_role))
    # A standby with other code gets a plain warm start, and is told why.
    edited = recorded.directory / "train-edited.py"
    edited.write_bytes(SCRIPT.read_bytes() + b"\n# edited\n")
    with own_rng():
        report = warm_up(lambda: LossJob(**THREAD_JOB), target(0, script=edited),
                         recorded.directory).report
    assert report.outcome is WarmupOutcome.PLAIN
    assert "made by other code (training script sha256" in str(report.fallback_reason)


def test_a_torn_or_replaced_recording_is_refused(recorded: Recorded, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(recorded.directory, copy)
    folder = role_directory(copy, ROLE)
    manifest = read_manifest(folder)
    data = folder / manifest.data_file
    data.write_bytes(data.read_bytes()[:-10])  # torn
    with pytest.raises(RecordingError, match="does not match its manifest"):
        Recording.load(copy, ROLE)
    data.unlink()
    with pytest.raises(RecordingError, match="is gone: the recording was replaced"):
        Recording.load(copy, ROLE)
    (folder / MANIFEST).write_text('{"format": 1, "job": 3}')
    with pytest.raises(RecordingError, match="not a valid recording manifest"):
        Recording.load(copy, ROLE)
    (folder / MANIFEST).write_text('{"format": 99}')
    with pytest.raises(RecordingError, match="format 99"):
        Recording.load(copy, ROLE)
    # An interrupted atomic write leaves the old file and no temporary behind.
    (folder / MANIFEST).write_text("old")

    def fail(f: Any) -> None:
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(folder / MANIFEST, fail)
    assert (folder / MANIFEST).read_text() == "old"
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST]


# -- the recorder's iterations -----------------------------------------------------------------

def test_the_recorder_drops_rejected_attempts_and_gives_up_on_jumps(tmp_path: Path) -> None:
    (pg,) = gloo_groups(1)
    layout = Layout(1, 1)

    def recorder(name: str, iterations: int = 2) -> tuple[Recorder, Any]:
        rec = Recorder(tmp_path / name, job=JOB, layout=layout, rank=0,
                       iterations=iterations, code=CODE, background=False)
        return rec, rec.provider(OneGroup(pg)).current("world")

    def call(group: Any, n: int = 1) -> None:
        group.allreduce([torch.ones(n)], dist.AllreduceOptions()).wait()

    rec, group = recorder("redo")
    call(group, 5)  # build
    rec.boundary(0)
    call(group, 1)
    call(group, 1)
    rec.boundary(0)  # the vote said no: step 0 again
    call(group, 2)
    rec.boundary(1)
    call(group, 3)
    rec.boundary(2)
    assert rec.state is RecordState.WRITTEN and rec.manifest is not None
    assert rec.manifest.segments == {"build": 1, "0": 1, "1": 1}
    replay = ReplayGroups(Recording.load(tmp_path / "redo", "stage-only.tp-0-of-1"))
    specs = [c.call.specs for c in replay.current("world").calls]
    assert specs == [("[float32[5]@cpu]",), ("[float32[2]@cpu]",), ("[float32[3]@cpu]",)]
    replay.close()
    call(group)  # after the recording: forwarded only
    assert rec.manifest.calls == 3

    rec, group = recorder("jump")
    rec.boundary(0)
    call(group)
    rec.boundary(7)  # a state was loaded: the recorded calls would not replay in order
    assert rec.state is RecordState.ABANDONED and "jumped from step 0 to step 7" in str(
        rec.reason)
    assert not (tmp_path / "jump").exists()

    rec, group = recorder("short")
    rec.boundary(0)
    call(group)
    assert rec.close(timeout=5) is RecordState.ABANDONED
    assert "before one iteration was complete" in str(rec.reason)

    rec, group = recorder("partial", iterations=5)
    rec.boundary(0)
    call(group)
    rec.boundary(1)
    call(group, 4)  # step 1 never completes: it is not kept
    assert rec.close(timeout=5) is RecordState.WRITTEN and rec.manifest is not None
    assert (rec.manifest.iterations, rec.manifest.segments) == (1, {"build": 0, "0": 1})


# -- layouts and role types ----------------------------------------------------------------------

def test_one_rank_records_each_role_type() -> None:
    assert recording_ranks(Layout(8, 2)) == {"stage-only.tp-0-of-2": 0,
                                             "stage-only.tp-1-of-2": 1}
    # PP=3 x DP=2 x TP=2: first, middle and last stages, each TP index, first replica.
    layout = Layout(12, 2, pp=3)
    assert recording_ranks(layout) == {
        "stage-first.tp-0-of-2": 0, "stage-first.tp-1-of-2": 1,
        "stage-middle.tp-0-of-2": 4, "stage-middle.tp-1-of-2": 5,
        "stage-last.tp-0-of-2": 8, "stage-last.tp-1-of-2": 9}
    assert RoleType.of(11, layout).key == "stage-last.tp-1-of-2"
    assert layout.coordinates(11) == (1, 1, 2)
    assert recording_ranks(Layout(8, 2, pp=2)).keys() == {
        "stage-first.tp-0-of-2", "stage-first.tp-1-of-2",
        "stage-last.tp-0-of-2", "stage-last.tp-1-of-2"}
    with pytest.raises(ValueError, match="does not divide"):
        Layout(6, 4)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        target(2)


# -- real processes, and a replay with no network at all ---------------------------------------

def observe(proc: subprocess.Popen[bytes], every: float = 0.005) -> tuple[list[Any], set[str]]:
    """Poll ``proc`` until it exits: its internet and unix connections as psutil sees them,
    and the sockets among its file descriptors (which do not depend on the namespace)."""
    watched = psutil.Process(proc.pid)
    connections: list[Any] = []
    sockets: set[str] = set()
    while proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            connections += watched.net_connections(kind="all")
        sockets |= socket_inodes(proc.pid)
        time.sleep(every)
    return connections, sockets


def replay_without_a_network(args: list[str], env: dict[str, str],
                             timeout: float) -> dict[str, Any]:
    """Run ``tests/workers/sandbox_replay.py ARGS`` in a network namespace of its own (only a
    loopback, down), watched from outside; check that it shadowed the recording and that no
    socket was seen, from outside or inside, and return what it wrote (``replay.json``)."""
    out = Path(args[args.index("--out") + 1])
    proc = subprocess.Popen(
        ["unshare", "--net", sys.executable, str(WORKERS / "sandbox_replay.py"), *args,
         "--linger", "0.3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        connections, sockets = observe(proc)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert connections == [] and sockets == set()
    replay: dict[str, Any] = json.loads((out / "replay.json").read_text())
    report = replay["report"]
    assert report["outcome"] == "shadow-iterations", report["fallback_reason"]
    assert replay["sockets_in_compute"] == [[], []] and replay["sockets_after"] == []
    return replay


@pytest.mark.slow
@pytest.mark.root
def test_processes_record_and_a_fresh_process_replays_with_no_network(tmp_path: Path) -> None:
    """Two gloo processes run the example job (dropout on) and rank 0 records; a fresh
    process in a network namespace of its own (only a loopback, down) replays as rank 0,
    watched from outside; it opens no socket and reproduces rank 0 bitwise."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    # The instrument works: a process in such a namespace that holds a socket is seen to.
    control = subprocess.Popen(["unshare", "--net", sys.executable, "-c",
                                "import socket, time; s = socket.socket(); time.sleep(0.3)"])
    assert observe(control)[1], "the observer did not see the control process's socket"
    assert control.wait(timeout=10) == 0
    recordings, out = tmp_path / "recordings", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning"}
    procs = [subprocess.Popen(
        [sys.executable, str(WORKERS / "sandbox_record.py"), "--store", str(tmp_path / "store"),
         "--rank", str(r), "--world-size", "2", "--tp", "1", "--steps", "3", "--record", "2",
         "--recordings", str(recordings), "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=50)
        assert p.returncode == 0, err.decode()[-3000:]
    recorder = json.loads((out / "rank0.json").read_text())
    assert recorder["state"] == "written" and recorder["real_group_after"]
    assert recorder["calls_on_disk_at_close"] == recorder["manifest_calls"] == 8

    replay = replay_without_a_network(
        ["--recordings", str(recordings), "--rank", "0", "--world-size", "2", "--tp", "1",
         "--out", str(out)], env, timeout=50)
    report = replay["report"]
    assert report["inputs_differed"] == 0 and report["calls_answered"] == 8
    assert report["losses"] == [recorder["losses"][str(s)] for s in range(2)]
    assert_same_state(torch.load(out / "replay-state.pt", weights_only=True),
                      torch.load(out / "rank0-after2.pt", weights_only=True))
