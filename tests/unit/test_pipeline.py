"""The pipeline schedule over real gloo groups (one thread per rank, in one process), and the
plain job's stages: split over two stages, a step computes the gradients one stage computes;
a job built for one stage takes another keeping its blocks."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_runtime import assert_bitwise_equal
from tests.workers.sandbox_common import plain_example
from understudy.worker.api import CollectiveAborted, JobContext
from understudy.worker.pipeline import run_schedule
from understudy.worker.runtime import StaticGroups

JOB = {"dropout": 0.0, "layers": 4, "microbatches": 4}
SHARDED = {"dropout": 0.0}


def _ranks(world: int, pp: int, body: Callable[[JobContext], Any],
           timeout: float = 20.0) -> list[Any]:
    """Run ``body(ctx)`` on ``world`` ranks (TP=1), one thread each, over gloo groups."""
    store = dist.HashStore()
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            groups = StaticGroups(store, rank=rank, world_size=world, tp=1, pp=pp,
                                  timeout=timeout)
            ctx = JobContext(job="pp", rank=rank, world_size=world, tp=1, pp=pp,
                             groups=groups, seed=7, collective_timeout=timeout)
            results[rank] = body(ctx)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    if errors:
        raise errors[0]
    return results


def _step_gradients(ctx: JobContext) -> dict[str, Any]:
    job = plain_example().PlainJob(**JOB)
    job.build(ctx)
    loss = job.compute(0)
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in job.params.items()}}


def test_two_stages_compute_the_gradients_of_one() -> None:
    whole = _ranks(1, 1, _step_gradients)[0]
    staged = _ranks(2, 2, _step_gradients)
    first, last = staged[0]["grads"], staged[1]["grads"]
    assert set(first) == {"embed_w", "embed_b", *(f"block{i}_{p}" for i in (0, 1)
                                                  for p in ("w1", "b1", "w2", "b2"))}
    assert set(last) == {"head_w", "head_b", *(f"block{i}_{p}" for i in (2, 3)
                                               for p in ("w1", "b1", "w2", "b2"))}
    assert staged[0]["loss"] is None and staged[1]["loss"] == pytest.approx(whole["loss"])
    for name, grad in {**first, **last}.items():
        torch.testing.assert_close(grad, whole["grads"][name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_a_stage_waiting_on_a_silent_neighbour_is_released_by_the_timeout() -> None:
    # Stage 1 waits for an activation stage 0 never sends: gloo's recv has no future, and the
    # wait is still bounded by the collective timeout.
    done = threading.Event()

    def body(ctx: JobContext) -> str:
        if ctx.first_stage:  # alive and connected, but silent
            done.wait(10)
            return "silent"
        short = JobContext(job="pp", rank=ctx.rank, world_size=2, tp=1, pp=2,
                           groups=ctx.groups, collective_timeout=0.5)
        with pytest.raises(CollectiveAborted, match="activation of micro-batch 0 from stage 0 "
                                                   "timed out"):
            run_schedule(short, microbatches=1, stage=lambda mb, x: x, activation=(2,))
        done.set()
        return "released"

    assert _ranks(2, 2, body, timeout=5.0) == ["silent", "released"]


def test_a_job_built_for_the_last_stage_takes_a_first_stage_rank_keeping_its_blocks() -> None:
    def ctx(rank: int) -> JobContext:
        return JobContext(job="pp", rank=rank, world_size=4, tp=1, pp=2, groups=None,  # type: ignore[arg-type]
                          seed=7)

    job = plain_example().PlainJob(**JOB)
    job.build(ctx(2))  # last stage: blocks 2 and 3, the head
    blocks = [job.params[f"block{i}_w1"] for i in (2, 3)]
    what = job.retarget(ctx(1))
    assert what == ("kept 2 blocks, allocated embed_w, embed_b, dropped head_w, head_b")
    fresh = plain_example().PlainJob(**JOB)
    fresh.build(ctx(1))
    assert {n: p.shape for n, p in job.params.items()} == \
        {n: p.shape for n, p in fresh.params.items()}
    assert job.params["block0_w1"] is blocks[0] and job.params["block1_w1"] is blocks[1]
    job.load_state(fresh.state())  # the rank's state fits what it became
    for name, p in fresh.params.items():
        assert torch.equal(job.params[name], p)
    # Another TP split cannot be taken in place.
    other = JobContext(job="pp", rank=1, world_size=4, tp=2, pp=2,
                       groups=None, seed=7)  # type: ignore[arg-type]
    assert job.retarget(other) is None


class _Waits:
    """A job's context that notes what each of its waits was for."""

    def __init__(self, ctx: JobContext) -> None:
        self._ctx, self.what = ctx, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def wait(self, work: Any, what: str) -> Any:
        self.what.append(what)
        return self._ctx.wait(work, what)


@pytest.mark.parametrize("dp", [2, 3])
def test_a_sharded_job_trains_the_same_bits_with_and_without_copies(dp: int) -> None:
    """The copies change nothing the job computes: plain ZeRO-1 (``copy=False``) all-gathers
    its parameters at every step, while at DP 2 a rank with both shards current takes them from
    its own shard and its copy instead. Every rank's shard, Adam state and parameters end
    bit for bit the same either way (a copy one update off would feed the next forward wrong
    parameters, and every shard would drift)."""
    train = plain_example()

    def trained(copy: bool) -> list[Any]:
        def run(ctx: JobContext) -> Any:
            job = train.ShardedJob(copy=copy, **SHARDED)
            job.build(ctx)
            for n in range(4):
                job.reseed(n)
                job.compute(n)
                job.apply(n)
            waited = job.ctx = _Waits(ctx)
            job.reseed(4)
            job.compute(4)  # its forward on the parameters of step 3's update
            state = job.state()
            return {"shard": state["shard"], "optimizer": state["optimizer"],
                    "params": job.gathered.clone(),
                    "gathers": waited.what.count("the DP parameter all-gather")}
        return _ranks(dp, 1, run)

    with_copies, without = trained(True), trained(False)
    for rank in range(dp):
        got, want = dict(with_copies[rank]), dict(without[rank])
        assert want.pop("gathers") == 1
        assert got.pop("gathers") == (0 if dp == 2 else 1)
        assert_bitwise_equal(want, got, f"rank {rank}")


@pytest.mark.parametrize("source", ["its own state (a drain)",
                                    "the copy on the next rank (a recovery)"])
def test_a_sharded_job_warmed_as_one_dp_rank_takes_another_keeping_its_buffers(
        source: str) -> None:
    """A standby warmed as DP rank 0 of a ZeRO-1 job, chosen for rank 1 (a node loss takes the
    other replica), keeps its model, flat buffers and shards: re-making them put twice the
    model on the recovery's path. Loaded with rank 1's state of step 3 it goes on bitwise:
    rank 1's own, or (a recovery) the one rank 0 rebuilds from its copy of rank 1's shard,
    which leaves out rank 1's copy of rank 0's shard: rank 0 sends it during step 3."""
    train = plain_example()
    steps, world = 5, 2
    # No dropout: the two ranks are threads of one process, sharing torch's generator.
    recovery = "recovery" in source
    handed: list[Any] = []
    ready = threading.Event()

    def run(job: Any, first: int, last: int) -> None:
        for n in range(first, last):
            job.reseed(n)
            job.compute(n)
            job.apply(n)

    def uninterrupted(ctx: JobContext) -> Any:
        job = train.ShardedJob(**SHARDED)
        job.build(ctx)
        run(job, 0, steps)
        return job.state()

    def retargeted(ctx: JobContext) -> Any:
        job = train.ShardedJob(**SHARDED)
        job.build(ctx)
        run(job, 0, 3)
        if ctx.rank == 0:
            if recovery:
                handed.append(copy.deepcopy(job.replica_state(1)))
            ready.set()
            run(job, 3, steps)
            return job.state()
        assert ready.wait(20), "rank 0 never got to step 3"
        # as it arrives: no tensor shared
        state = handed[0] if recovery else copy.deepcopy(job.state())
        assert (state["buddy"] is None and state["buddy_missing"]) == recovery
        standby = train.ShardedJob(**SHARDED)
        standby.build(dataclasses.replace(ctx, rank=0))
        kept = (standby.gathered, standby.grad_buffer, standby.shard, standby.buddy)
        assert standby.buddy_index == 1
        what = standby.retarget(ctx)
        assert what == "kept its model, buffers and shards (DP rank 0 -> 1), allocated nothing"
        now = (standby.gathered, standby.grad_buffer, standby.shard, standby.buddy)
        assert all(a is b for a, b in zip(now, kept, strict=True))
        assert standby.buddy_index == 0
        standby.load_state(state)
        if recovery:
            assert standby.buddy_missing and not standby.buddy[1].state
            assert_bitwise_equal(state["shard"], standby.state()["shard"])
        else:
            assert_bitwise_equal(state, standby.state())
        run(standby, 3, steps)
        assert not standby.buddy_missing
        return standby.state()

    expected = _ranks(world, 1, uninterrupted)
    got = _ranks(world, 1, retargeted)
    for rank in range(world):
        assert_bitwise_equal(expected[rank], got[rank], f"rank {rank}")
    # Another TP split is not taken in place.
    job = train.ShardedJob()
    job.build(JobContext(job="pp", rank=0, world_size=2, tp=1, groups=None,  # type: ignore[arg-type]
                         seed=7))
    assert job.retarget(JobContext(job="pp", rank=1, world_size=2, tp=2,
                                   groups=None, seed=7)) is None  # type: ignore[arg-type]
