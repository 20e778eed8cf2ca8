"""Pipeline reshape (worker/restage.py) in one process: what a job hands on and takes when its
stages change, and what the runtime refuses before anything moves. The whole protocol, with
real processes and bitwise training, is tests/integration/test_restage.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_runtime import _plain_example
from tests.unit.test_slots import _Plain
from understudy.common.layout import Layout
from understudy.groups.groupset import GroupSet
from understudy.worker.api import JobContext, restages
from understudy.worker.migration import JobGroups
from understudy.worker.reshape import Shape
from understudy.worker.restage import check_shapes
from understudy.worker.runtime import Runtime

LAYERS = 4


def _job(train: Any, pp: int, stage: int, *extra: str) -> tuple[Any, JobContext]:
    args = train.parse_args(["--steps", "1", "--slots", "1", "--layers", str(LAYERS),
                             "--microbatches", "2", "--tp", "1", *extra])
    job = train.make_job(args)
    store = dist.HashStore()
    # Groups built only when asked for: none is, the job builds and restages without them.
    group_set = GroupSet("j", f"s{stage}", timeout=5, backends={"cpu": "gloo"},
                         store_factory=lambda ns, cancel: dist.PrefixStore(ns, store))
    groups = JobGroups(group_set, stage, Layout(pp, 1, pp))
    ctx = JobContext(job="j", rank=stage, world_size=pp, tp=1, pp=pp, groups=groups, slots=1)
    job.build(ctx)
    return job, ctx


def _trained(job: Any, seed: int) -> None:
    """Give every parameter and Adam moment distinct values, as seven steps would."""
    g = torch.Generator().manual_seed(seed)
    for i, q in enumerate(job.params.values()):
        with torch.no_grad():
            q.copy_(torch.randn(q.shape, generator=g))
        job.optimizer.exp_avg[i].copy_(torch.randn(q.shape, generator=g))
        job.optimizer.exp_avg_sq[i].copy_(torch.rand(q.shape, generator=g))
        job.optimizer.steps[i].fill_(7.0)
    job.schedule.last_epoch = job.committed = 7


@pytest.mark.parametrize("adam", ["functional", "class"])
def test_a_stage_that_takes_its_neighbour_s_layers_holds_them_with_their_adam_state(
        adam: str) -> None:
    train = _plain_example()
    first, ctx = _job(train, 2, 0, "--rng-by-layer", "--adam", "functional")
    second, _ = _job(train, 2, 1, "--rng-by-layer", "--adam", "functional")
    _trained(first, 1)
    _trained(second, 2)
    assert first.stage_units(ctx) == [0, 1, 2] and second.stage_units(second.ctx) == [3, 4, 5]
    expected = {n: (q.detach().clone(), job.optimizer.exp_avg[i].clone(),
                    job.optimizer.exp_avg_sq[i].clone())
                for job in (first, second) for i, (n, q) in enumerate(job.params.items())}
    if adam == "class":  # the same state, held by torch.optim.Adam
        first.adam = "class"
        moments = list(zip(first.optimizer.exp_avg, first.optimizer.exp_avg_sq, strict=True))
        first._optimizer()
        for q, (m, v) in zip(first.params.values(), moments, strict=True):
            first.optimizer.state[q] = {"step": torch.tensor(7.0), "exp_avg": m,
                                        "exp_avg_sq": v}
    sent = {u: second.unit_state(u) for u in second.stage_units(second.ctx)}
    assert all(t.shape == second.empty_unit(u).shape for u, t in sent.items())
    whole = dataclasses.replace(ctx, world_size=1, pp=1)
    first.restage(whole, sent, 7)
    fresh, _ = _job(train, 1, 0, "--rng-by-layer", "--adam", "functional")
    assert list(first.params) == list(fresh.params)  # the order a fresh build gives
    for i, (name, q) in enumerate(first.params.items()):
        value, m, v = expected[name]
        if adam == "class":
            state = first.optimizer.state[q]
            got_m, got_v = state["exp_avg"], state["exp_avg_sq"]
            assert state["step"].item() == 7.0
        else:
            got_m, got_v = first.optimizer.exp_avg[i], first.optimizer.exp_avg_sq[i]
            assert first.optimizer.steps[i].item() == 7.0
        assert torch.equal(q, value) and torch.equal(got_m, m) and torch.equal(got_v, v), name
    assert first.committed == 7 and first.ctx is whole
    assert first.schedule.state_dict()["last_epoch"] == 7


def test_the_runtime_refuses_a_restage_that_would_change_the_arithmetic() -> None:
    train = _plain_example()
    cases = [((), "--rng-by-layer"),
             (("--rng-by-layer", "--shard-optimizer"), "--shard-optimizer keeps its stages")]
    for extra, why in cases:
        job, ctx = _job(train, 2, 0, *extra)
        runtime = Runtime(job, ctx)
        runtime.build()
        with pytest.raises(ValueError, match=why):
            runtime.restage(dataclasses.replace(ctx, world_size=1, pp=1), {}, 0)
        assert runtime.ctx is ctx
    job, ctx = _job(train, 2, 0, "--rng-by-layer")
    runtime = Runtime(job, ctx)
    runtime.build()
    for bad, why in [(dataclasses.replace(ctx, world_size=3, pp=3), "do not split over pp=3"),
                     (dataclasses.replace(ctx, seed=1), "also changes seed"),
                     (dataclasses.replace(ctx, world_size=4, tp=2), "also changes tp")]:
        with pytest.raises(ValueError, match=why):
            runtime.restage(bad, {}, 0)
        assert runtime.ctx is ctx
    plain = Runtime(_Plain(), ctx)
    plain.build()
    assert not restages(plain.job)
    with pytest.raises(ValueError, match="cannot move its layers"):
        plain.restage(dataclasses.replace(ctx, world_size=1, pp=1), {}, 0)


def test_a_pipeline_reshape_keeps_the_replicas_and_the_tensor_split() -> None:
    check_shapes(Shape((0, 1), tp=2, pp=1), Shape((0, 1), tp=2, pp=4))
    for after in (Shape((0,), tp=2, pp=2), Shape((0, 1), tp=1, pp=2)):
        with pytest.raises(ValueError, match="keeps the replicas and the TP degree"):
            check_shapes(Shape((0, 1), tp=2, pp=1), after)
