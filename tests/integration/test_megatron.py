"""The Megatron-core GPT job (``examples/megatron_gpt/train.py``), TP=2 x DP=2 on gloo.

0. The CPU substitutes for Megatron's CUDA RNG tracker and memory buffer behave as Megatron's
   (in this process; everything below runs megatron-core in worker processes only).
1. Standalone (four plain processes, groups bootstrapped through a file store): the loss falls,
   and the parameters Megatron replicates over the TP group (layer norms, row-parallel biases)
   are bitwise equal on both TP ranks. That a run repeats bit for bit is what 2-4 show: each
   compares an interrupted run with this one.
2. Under real daemons on a real etcd, with two standby nodes warmed in the sandbox: node-b is
   drained mid-run, its two ranks move live to the standbys (warmed as ranks 0 and 1, they
   build ranks 2 and 3 afresh), the job ends ``done`` at epoch 2, and the final state of
   every rank (parameters, Adam state, schedule, Megatron's TP RNG tracker, process RNGs, step)
   is bitwise equal to the uninterrupted standalone run; so are the losses of every step.
3. One rank per node: a rank whose TP and DP partners stay is drained, then drained again from
   the standby that took it; then another rank's joiner is killed in the middle of the state
   stream: that migration aborts, the leaver trains on to the end. Bitwise equal again.
4. Rank 1 killed mid-run (kill -9): the standby warmed in the sandbox as rank 1 (model built on
   the stable groups, replayed shadow iterations) is promoted and takes rank 3's state (its
   data-parallel replica), the aborted step is redone by everyone, and every loss and the final
   state are the uninterrupted run's. Then a fresh process with no network at all replays
   rank 1's recording the same way, opens no socket, and computes the run's first losses.

The states the workers save load as plain tensors and dictionaries, without megatron-core.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration import bitwise, scenarios
from tests.integration.bitwise import load_state
from tests.integration.scenarios import events, start, wait_log, wait_standbys, worker_pid
from tests.once import build_once
from tests.unit.test_sandbox import replay_without_a_network
from understudy.testing.embedded_etcd import EmbeddedEtcd
from understudy.testing.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN = str(Path(__file__).parents[2] / "examples" / "megatron_gpt" / "train.py")
STEPS = 80
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _job_args(out: Path, step_sleep: float = 0.05, sleep_off: Path | None = None) -> list[str]:
    # The sleep stands in for a bigger model's compute (room for slower scenarios); it never
    # changes the state. It stops once ``sleep_off`` exists (see ``_finished``).
    args = [TRAIN, "--steps", str(STEPS), "--step-sleep", str(step_sleep), "--save", str(out)]
    return args if sleep_off is None else [*args, "--step-sleep-off", str(sleep_off)]


def _finished(c: LocalCluster) -> Any:
    """The scenario is over: the job runs out at full speed; returns its status once it ends."""
    scenarios.faults_over(c).touch()
    c.wait_for("the job to finish", lambda s: s.job("gpt") is not None and
               s.job("gpt").state in ("done", "failed"), timeout=300)
    return c.status().job("gpt")


def _standalone(base: Path) -> Path:
    """The job on four plain processes, no daemons; returns its output directory."""
    procs = []
    for r in range(4):
        with open(base / f"r{r}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, *_job_args(base / "out", step_sleep=0), "--rank", str(r),
                 "--world-size", "4", "--tp", "2", "--store", str(base / "store")],
                env={**os.environ, **ONE_THREAD}, stdout=subprocess.DEVNULL, stderr=log))
    for r, p in enumerate(procs):
        assert p.wait(timeout=420) == 0, (base / f"r{r}.log").read_text()[-3000:]
    return base / "out"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of the seed the other runs are compared with (one per test run,
    shared by every xdist worker)."""
    return build_once(tmp_path_factory, "megatron-reference", _standalone)


def _state(directory: Path, rank: int) -> dict[str, Any]:
    return load_state(directory, rank)


def _summary(directory: Path, rank: int) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((directory / f"rank{rank}.json").read_text())
    return summary


def assert_bitwise_equal(expected_dir: Path, actual_dir: Path, world: int = 4) -> None:
    assert any("/job/tracker/model-parallel-rng" in k for k in load_state(expected_dir, 0))
    bitwise.assert_bitwise_equal(expected_dir, actual_dir, world)


def _cpu_module() -> Any:
    from understudy.worker.megatron import quiet_imports

    # megatron-core 0.16.1 warns at import (what this machine lacks, its deprecated modules);
    # pytest turns warnings into errors, so exactly these are ignored, for the import only.
    with quiet_imports():
        from understudy.worker.megatron import cpu
    return cpu


def test_cpu_substitutes_fork_the_cpu_generator_and_refuse_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = _cpu_module()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import layers, random

    tracker = cpu.CPURNGStatesTracker()
    cpu.model_parallel_cpu_manual_seed(tracker, 7, tp_rank=1)
    assert set(tracker.get_states()) == {cpu.DATA_PARALLEL_RNG, cpu.MODEL_PARALLEL_RNG,
                                         cpu.EXPERT_PARALLEL_RNG}
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    # The block drew from the TP stream (Megatron's seed + 2718 + tp_rank); the default
    # generator is where it was, and the stream has advanced.
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(2726)))
    assert torch.equal(torch.get_rng_state(), outside)
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    with tracker.fork():
        second = torch.rand(4)
    assert not torch.equal(first, second)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), second)
    with pytest.raises(ValueError, match="already"):
        tracker.add("another", 7)
    with pytest.raises(ValueError, match="not added"), tracker.fork("missing"):
        pass

    for module, name in ((random, "_CUDA_RNG_STATE_TRACKER"),
                         (random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
                         (parallel_state, "_GLOBAL_MEMORY_BUFFER"),
                         (layers.linear_with_grad_accumulation_and_async_allreduce, "warned")):
        monkeypatch.setattr(module, name, getattr(module, name))  # undone after the test
    installed = cpu.install()
    assert tensor_parallel.get_cuda_rng_tracker() is installed
    buffer = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "mpu")
    assert buffer.device.type == "cpu" and buffer.shape == (2, 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="without a GPU"):
        cpu.install()


def test_the_standalone_run_learns_and_its_replicas_see_their_own_data(reference: Path) -> None:
    # That a run repeats bit for bit is what every other test here shows: each compares an
    # interrupted run with this one (a second uninterrupted run cost the suite ~25 CPU-s).
    for rank in range(4):
        losses = _summary(reference, rank)["losses"]
        assert [int(s) for s in losses] == list(range(STEPS))
        first, last = losses["0"], losses[str(STEPS - 1)]
        assert first > 4.5 and last < 0.6 * first, (first, last)  # ln(128) = 4.85 at start
    # TP ranks of one replica hold the same replicated parameters and see the same loss.
    for r0, r1 in ((0, 1), (2, 3)):
        a, b = _state(reference, r0), _state(reference, r1)
        replicated = [k for k in a if k.startswith("/job/model/") and k.endswith(
            ("layernorm.weight", "layernorm.bias", "linear_proj.bias", "linear_fc2.bias",
             "position_embeddings.weight"))]
        assert len(replicated) >= 10, replicated
        for key in replicated:
            assert torch.equal(a[key], b[key]), f"ranks {r0}, {r1}: {key} differs"
        sharded = "/job/model/decoder.layers.0.mlp.linear_fc1.weight"
        assert not torch.equal(a[sharded], b[sharded])
        assert _summary(reference, r0)["losses"] == _summary(reference, r1)["losses"]
    # The replicas saw different data.
    assert _summary(reference, 0)["losses"] != _summary(reference, 2)["losses"]


@pytest.fixture
def cluster(etcd: EmbeddedEtcd, tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        for n in ("node-a", "node-b"):
            c.add(n, "active", extra=["--slots", "2"])
        for n in ("node-s1", "node-s2"):
            c.add(n, "standby")
        for n, s in (("node-a", "active"), ("node-b", "active"), ("node-s1", "standby"),
                     ("node-s2", "standby")):
            c.wait_state(n, s)
        c.wait_for("a controller", lambda s: s.controller is not None)
        yield c
    finally:
        c.stop_all(timeout=5, drain=False)


def _start_gpt(cluster: LocalCluster, out: Path, recordings: Path | None = None) -> None:
    """Run the job (TP=2 x DP=2, two standbys; ranks 0-1 on node-a, 2-3 on node-b) and wait
    until all four ranks have built their models (imports take a while on a loaded machine).
    With ``recordings``, ranks 0 and 1 record their first iterations there and the standbys
    warm in the sandbox (node-s1 as rank 0, node-s2 as rank 1)."""
    extra = {} if recordings is None else {"UNDERSTUDY_RECORDINGS": str(recordings)}
    env = [f"--env={k}={v}" for k, v in {**ONE_THREAD, **extra}.items()]
    run = cluster.cli("run", "--job", "gpt", "--tp", "2", "--dp", "2", "--standby", "2", *env,
                      "--", sys.executable,
                      *_job_args(out, sleep_off=scenarios.faults_over(cluster)))
    assert run.returncode == 0, run.stderr
    assert "rank 2 on node-b" in run.stdout and "rank 3 on node-b" in run.stdout
    deadline = time.monotonic() + 240
    while sum(cluster.daemons[n].log_text().count("built the Megatron GPT model")
              for n in ("node-a", "node-b")) < 4:
        assert time.monotonic() < deadline, "the ranks did not build their models in time"
        time.sleep(0.5)


def _wait_warm(cluster: LocalCluster) -> None:
    """Until both standbys built the model on their stable groups answered by the replay and
    ran the shadow iterations."""
    for node, rank in (("node-s1", 0), ("node-s2", 1)):
        wait_log(cluster.daemons[node], f"Standby is warm (replay) as rank {rank}", timeout=240)
    assert "warm: gpt: replay" in cluster.cli("status").stdout


def test_drain_moves_megatron_ranks_live_and_the_result_is_bitwise_identical(
        cluster: LocalCluster, reference: Path, tmp_path: Path) -> None:
    # The standbys warm in the sandbox as ranks 0 and 1; node-b holds ranks 2 and 3, so each
    # standby builds the new rank's job afresh (its imports warm) and rewires parallel_state.
    out = tmp_path / "out"
    _start_gpt(cluster, out, tmp_path / "recordings")
    _wait_warm(cluster)
    drain = cluster.cli("drain", "node-b", "--deadline", "240", "--wait", timeout=300)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    job = _finished(cluster)
    assert job is not None and job.state == "done", job.status
    assert job.assignment is not None and job.assignment.epoch == 2
    assert job.assignment.ranks == ("node-a", "node-a", "node-s1", "node-s2")
    events = [json.loads(line) for line in cluster.cli("events", "--json").stdout.splitlines()]
    assert "migration-done" in [e["kind"] for e in events]
    a_log = cluster.daemons["node-a"].log_text()
    assert a_log.count("Started rank 0 of job gpt") == 1
    assert a_log.count("Started rank 1 of job gpt") == 1
    for node, (warm, rank) in (("node-s1", (0, 2)), ("node-s2", (1, 3))):
        assert (f"Warmed as rank {warm}, chosen for rank {rank}: building that rank's job"
                in cluster.daemons[node].log_text())
    # The survivors trained through the migration; the joiners took over mid-run.
    for rank in (0, 1):
        assert _summary(out, rank)["losses"] == _summary(reference, rank)["losses"]
    for rank in (2, 3):
        summary = _summary(out, rank)
        assert summary["step"] == STEPS
        took_over = min(int(s) for s in summary["losses"])
        assert 1 < took_over < STEPS - 1, took_over  # mid-run, after a few steps
        expected = _summary(reference, rank)["losses"]
        assert summary["losses"] == {s: v for s, v in expected.items() if int(s) >= took_over}
    assert_bitwise_equal(reference, out)


def test_one_rank_drained_twice_then_a_joiner_killed_mid_stream(etcd: EmbeddedEtcd,
                                                                 reference: Path,
                                                                 tmp_path: Path) -> None:
    # node-s3's joiner stops after the first chunk of the state landed (a failpoint) and is
    # killed there. The first two drains move rank 1 with its state sent ahead (the adapter
    # implements apply_inputs), the Megatron model's gradients and TP RNG tracker forwarded
    # step by step.
    armed = {"node-s3": {"UNDERSTUDY_FAILPOINTS": "joiner.receive.chunk=sleep(120)"}}
    c = start(etcd, tmp_path / "cluster", {"node-a": 1, "node-b": 1, "node-c": 1, "node-d": 1},
              ("node-s1", "node-s2", "node-s3"), env=armed)
    try:
        out = tmp_path / "out"
        env = [f"--env={k}={v}" for k, v in ONE_THREAD.items()]
        run = c.cli("run", "--job", "gpt", "--tp", "2", "--dp", "2", "--standby", "3", *env,
                    "--", sys.executable, *_job_args(out, 0.9, scenarios.faults_over(c)))
        assert run.returncode == 0, run.stderr
        for n in ("node-a", "node-b", "node-c", "node-d"):
            wait_log(c.daemons[n], "built the Megatron GPT model", timeout=240)
        wait_standbys(c, ("node-s1", "node-s2", "node-s3"), timeout=240)
        # Rank 1: its TP partner (rank 0, node-a) and DP partner (rank 3, node-d) stay.
        for node, epoch in (("node-b", 2), ("node-s1", 3)):
            drain = c.cli("drain", node, "--deadline", "240", "--wait", timeout=300)
            assert drain.returncode == 0, drain.stdout + drain.stderr
            c.wait_for(f"epoch {epoch}",
                       lambda s, e=epoch: s.job("gpt").assignment.epoch == e)
        assert c.status().job("gpt").assignment.ranks == (
            "node-a", "node-s2", "node-c", "node-d")
        # Rank 2 (node-c) to node-s3, whose joiner dies mid-stream. node-s3 is cordoned first,
        # so no retry can follow: the leaver keeps rank 2 to the end.
        assert c.cli("drain", "node-c", "--deadline", "600").returncode == 0
        s3, node_c = c.daemons["node-s3"], c.daemons["node-c"]
        wait_log(s3, "failpoint joiner.receive.chunk fired", timeout=120)
        assert c.cli("cordon", "node-s3").returncode == 0
        os.kill(worker_pid(s3, "gpt.standby"), 9)
        c.wait_for("the migration to be aborted", lambda s: any(
            e["kind"] == "migration-aborted" for e in events(c)), timeout=60)
        # The adapter sends its state ahead: the leaver learns of the death before the switch.
        wait_log(node_c, "Sending the state ahead failed")
        job = _finished(c)
        assert job is not None and job.state == "done", job.status if job else None
        assert job.assignment is not None and job.assignment.epoch == 3
        assert job.assignment.ranks == ("node-a", "node-s2", "node-c", "node-d")
        for node, rank in (("node-a", 0), ("node-c", 2), ("node-d", 3)):
            assert c.daemons[node].log_text().count(f"Started rank {rank} of job gpt") == 1
        # node-c's rebuilt groups: only those with rank 1, i.e. the job-wide one.
        assert "rebuilding ['world']" in node_c.log_text()
        for rank in (0, 2, 3):
            assert _summary(out, rank)["losses"] == _summary(reference, rank)["losses"]
        assert_bitwise_equal(reference, out)
    finally:
        c.stop_all(timeout=5, drain=False)


def test_a_killed_megatron_rank_is_rebuilt_from_its_replica_bitwise(
        cluster: LocalCluster, reference: Path, tmp_path: Path) -> None:
    # Rank 1 dies by kill -9 mid-run; its TP partner (rank 0) and the other TP group abort
    # their step; a standby builds the model for rank 1 and takes rank 3's state (same TP
    # index: the same shards, Adam state and TP RNG tracker); the step is redone by everyone.
    # node-s2 warmed as rank 1 in the sandbox: it is promoted with its model built on the
    # stable groups, which the real versions are switched into.
    out = tmp_path / "out"
    _start_gpt(cluster, out, tmp_path / "recordings")
    a = cluster.daemons["node-a"]
    _wait_warm(cluster)
    os.kill(worker_pid(a, "gpt.r1"), 9)
    job = _finished(cluster)
    assert job is not None and job.state == "done", job.status
    assert job.assignment is not None and job.assignment.epoch == 2
    assert job.assignment.ranks == ("node-a", "node-s2", "node-b", "node-b")
    planned = next(e for e in events(cluster) if e["kind"] == "migration-planned")
    assert "recovery: rank 1 -> node-s2 (state from rank 3)" in planned["message"]
    assert ("Promoting the standby warmed as rank 1: its model is built."
            in cluster.daemons["node-s2"].log_text())
    assert a.log_text().count("Started rank 0 of job gpt") == 1
    # Every step's loss, the redone one included, is the uninterrupted run's.
    for rank in (0, 2, 3):
        assert _summary(out, rank)["losses"] == _summary(reference, rank)["losses"]
    summary = _summary(out, 1)
    took_over = min(int(s) for s in summary["losses"])
    assert 1 < took_over < STEPS - 1, took_over
    expected = _summary(reference, 1)["losses"]
    assert summary["losses"] == {s: v for s, v in expected.items() if int(s) >= took_over}
    assert_bitwise_equal(reference, out)
    _replay_without_a_network(tmp_path / "recordings", reference, tmp_path / "replay")


def _replay_without_a_network(recordings: Path, reference: Path, out: Path) -> None:
    """A fresh process in a network namespace of its own (only a loopback, down), watched from
    outside, warms up as rank 1 from the recording the run made, as the standby did: the
    Megatron model built on the stable groups, the replay standing in. It opens no socket, and
    its shadow iterations compute the uninterrupted run's losses of those steps."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare(1) and root for a network namespace")
    out.mkdir()
    replay = replay_without_a_network(
        ["--megatron", "--job", "gpt", "--recordings", str(recordings), "--rank", "1",
         "--world-size", "4", "--tp", "2", "--out", str(out)], {**os.environ, **ONE_THREAD},
        timeout=120)
    report = replay["report"]
    assert report["calls_answered"] > 0 and report["inputs_differed"] == 0
    expected = _summary(reference, 1)["losses"]
    assert report["losses"] == [expected["0"], expected["1"]]
