"""Data-parallel slots: which replica holds which slot, and the canonical sum of their gradients
over real gloo groups (ranks are threads of this process, bootstrapped through a HashStore)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_groups import run_ranks
from understudy.worker import slots as slots_mod
from understudy.worker.api import JobContext, SlottedJob, TrainingJob
from understudy.worker.runtime import Runtime, StaticGroups
from understudy.worker.slots import canonical_sum, chunk, compute_step, held


def test_each_replica_holds_a_contiguous_balanced_block_and_every_slot_is_held_once() -> None:
    for slots in range(1, 9):
        for dp in range(1, slots + 1):
            blocks = [held(slots, dp, i) for i in range(dp)]
            assert [s for b in blocks for s in b] == list(range(slots))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert [list(held(3, 2, i)) for i in range(2)] == [[0], [1, 2]]


@pytest.mark.parametrize(("slots", "dp", "index"), [(2, 3, 0), (2, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_a_layout_that_cannot_hold_the_slots_is_refused(slots: int, dp: int, index: int) -> None:
    with pytest.raises(ValueError, match="replica"):
        held(slots, dp, index)


def test_a_context_with_fewer_slots_than_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match="2 data-parallel slots cannot fill 4 replicas"):
        JobContext(job="j", rank=0, world_size=4, tp=1, groups=None, slots=2)  # type: ignore
    ctx = JobContext(job="j", rank=3, world_size=4, tp=2, groups=None, slots=5)  # type: ignore
    assert ctx.data_slots == 5 and ctx.held_slots == range(2, 5)
    plain = JobContext(job="j", rank=3, world_size=4, tp=2, groups=None)  # type: ignore
    assert plain.data_slots == 2 and plain.held_slots == range(1, 2)


def _slot_gradients(slots: int, numel: int) -> list[torch.Tensor]:
    # Magnitudes over many orders, so that the order of the additions shows in the bits.
    g = torch.Generator().manual_seed(7)
    return [torch.randn(numel, generator=g) * 10.0 ** torch.randint(-6, 7, (numel,), generator=g)
            for _ in range(slots)]


def _sum_on(dp: int, grads: list[torch.Tensor], tp: int = 1) -> list[torch.Tensor]:
    """canonical_sum on ``dp`` replicas (``tp`` ranks each): every rank's result."""
    store = dist.HashStore()
    world = dp * tp

    def rank(r: int) -> torch.Tensor:
        groups = StaticGroups(store, rank=r, world_size=world, tp=tp, timeout=10)
        ctx = JobContext(job="j", rank=r, world_size=world, tp=tp, groups=groups,
                         slots=len(grads), collective_timeout=10)
        return canonical_sum(ctx, {s: grads[s].clone() for s in ctx.held_slots})

    out = run_ranks({str(r): (lambda r=r: rank(r)) for r in range(world)}, timeout=30)
    return [out[str(r)] for r in range(world)]


@pytest.fixture(params=["chunked", "gathered"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of the sum: two rounds of chunks, and (small gradients) one all-gather."""
    monkeypatch.setattr(slots_mod, "GATHER_ALL_BYTES", 0 if request.param == "chunked" else 1 << 30)
    return str(request.param)


@pytest.mark.parametrize("numel", [1000, 2])
def test_the_sum_is_the_slot_order_sum_bit_for_bit_on_any_number_of_replicas(
        numel: int, path: str) -> None:
    slots = 5
    grads = _slot_gradients(slots, numel)
    expected = grads[0].clone()
    for g in grads[1:]:
        expected = expected + g
    for dp in (1, 2, 3, 5):
        for got in _sum_on(dp, grads):
            assert torch.equal(got, expected), dp
    # Not trivially so: another order of the same additions gives other bits.
    if numel > 2:
        other = (grads[0] + grads[1]) + ((grads[2] + grads[3]) + grads[4])
        assert not torch.equal(other, expected)


@pytest.mark.parametrize("numel", [1000, 3])
def test_a_sum_that_stops_at_the_wanted_slots_chunks_has_their_bits(
        numel: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A job sharded by slot reads the chunks of its replica's slots and the previous
    # replica's (their copies): only those are summed and sent, in slot order all the same.
    # (Small gradients take the all-gather path whatever is wanted: off here.)
    monkeypatch.setattr(slots_mod, "GATHER_ALL_BYTES", 0)
    slots = 5
    grads = _slot_gradients(slots, numel)
    expected = grads[0].clone()
    for g in grads[1:]:
        expected = expected + g
    for dp in (2, 3, 5):
        def wanted(q: int, dp: int = dp) -> list[int]:
            return sorted({*held(slots, dp, q), *held(slots, dp, (q - 1) % dp)})

        store = dist.HashStore()

        def rank(r: int, dp: int = dp, store: Any = store, wanted: Any = wanted) -> Any:
            groups = StaticGroups(store, rank=r, world_size=dp, tp=1, timeout=10)
            ctx = JobContext(job="j", rank=r, world_size=dp, tp=1, groups=groups,
                             slots=slots, collective_timeout=10)
            return canonical_sum(ctx, {s: grads[s].clone() for s in ctx.held_slots},
                                 wanted).clone()

        out = run_ranks({str(r): (lambda r=r: rank(r)) for r in range(dp)}, timeout=30)
        for q in range(dp):
            for x in wanted(q):
                part = chunk(numel, slots, x)
                assert torch.equal(out[str(q)][part], expected[part]), (dp, q, x)


def test_the_sum_runs_on_each_tensor_parallel_rank_s_own_dp_group(path: str) -> None:
    grads = _slot_gradients(3, 64)
    expected = grads[0] + grads[1] + grads[2]
    results = _sum_on(3, grads, tp=2)
    assert len(results) == 6 and all(torch.equal(r, expected) for r in results)


def test_chunks_cover_the_tensor_once() -> None:
    for numel in (0, 1, 2, 7, 100):
        for parts in (1, 2, 3, 5):
            covered = [i for p in range(parts) for i in range(numel)[chunk(numel, parts, p)]]
            assert covered == list(range(numel))


def test_gradients_for_slots_the_replica_does_not_hold_are_refused() -> None:
    store = dist.HashStore()
    groups = StaticGroups(store, rank=0, world_size=1, tp=1, timeout=5)
    ctx = JobContext(job="j", rank=0, world_size=1, tp=1, groups=groups, slots=2)
    with pytest.raises(ValueError, match=r"holds slots \[0, 1\], got gradients for \[0\]"):
        canonical_sum(ctx, {0: torch.zeros(3)})


class _Grads(SlottedJob):
    """A slotted job whose gradients are given: only what compute_step reads of a job."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        self.grads = grads

    def build(self, ctx: JobContext) -> None: ...

    def compute_slot(self, step: int, slot: int) -> float | None:
        return None

    def gradients(self) -> list[torch.Tensor]:
        return self.grads

    def apply(self, step: int) -> None: ...

    def discard(self, step: int) -> None: ...

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None: ...


def test_one_replica_holding_every_slot_sums_them_into_the_gradients() -> None:
    groups = StaticGroups(dist.HashStore(), rank=0, world_size=1, tp=1, timeout=5)
    ctx = JobContext(job="j", rank=0, world_size=1, tp=1, groups=groups, slots=3)
    job = _Grads([torch.ones(2, 2), torch.full((3,), 2.0)])
    compute_step(job, ctx, step=0)  # the same gradients for each of the three slots
    assert torch.equal(job.grads[0], torch.full((2, 2), 3.0))
    assert torch.equal(job.grads[1], torch.full((3,), 6.0))
    with pytest.raises(TypeError, match="the runtime calls compute_slot"):
        job.compute(0)


def test_gradients_of_mixed_dtypes_are_refused_with_a_sentence() -> None:
    groups = StaticGroups(dist.HashStore(), rank=0, world_size=1, tp=1, timeout=5)
    ctx = JobContext(job="j", rank=0, world_size=1, tp=1, groups=groups, slots=2)
    job = _Grads([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="tensors of one dtype"):
        compute_step(job, ctx, step=0)


class _Plain(TrainingJob):
    """A job that is not slotted: it sums its own gradients."""

    def build(self, ctx: JobContext) -> None: ...

    def compute(self, step: int) -> float | None:
        return None

    def apply(self, step: int) -> None: ...

    def discard(self, step: int) -> None: ...

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None: ...


def test_a_reshape_takes_a_new_place_and_refuses_what_would_change_the_arithmetic() -> None:
    groups = StaticGroups(dist.HashStore(), rank=0, world_size=1, tp=1, timeout=5)
    ctx = JobContext(job="j", rank=0, world_size=1, tp=1, groups=groups, slots=4)
    runtime = Runtime(_Grads([torch.ones(2)]), ctx)
    runtime.build()
    wider = dataclasses.replace(ctx, rank=2, world_size=4)
    for bad, what in [(dataclasses.replace(wider, seed=1), "seed"),
                      (dataclasses.replace(wider, slots=8), "data_slots"),
                      (dataclasses.replace(ctx, world_size=2, tp=2), "tp")]:
        with pytest.raises(ValueError, match=f"also changes {what}"):
            runtime.reshape(bad)
        assert runtime.ctx is ctx
    runtime.reshape(wider)
    assert runtime.ctx is wider and list(runtime.ctx.held_slots) == [2]
    plain = Runtime(_Plain(), ctx)
    plain.build()
    with pytest.raises(ValueError, match="not a SlottedJob"):
        plain.reshape(wider)
    assert plain.ctx is ctx


def test_a_reshape_keeps_the_slot_count_a_context_left_to_the_replica_count() -> None:
    from understudy.common.layout import Layout
    from understudy.groups.groupset import GroupSet
    from understudy.worker.migration import JobGroups
    from understudy.worker.reshape import Shape, reshape

    def group_set(member: str) -> GroupSet:
        store = dist.HashStore()
        return GroupSet("j", member, timeout=5, backends={"cpu": "gloo"},
                        store_factory=lambda ns, cancel: dist.PrefixStore(ns, store))

    old = group_set("a")
    provider = JobGroups(old, 0, Layout(2, 1))
    ctx = JobContext(job="j", rank=0, world_size=2, tp=1, groups=provider)  # slots: 0 -> DP 2
    runtime = Runtime(_Grads([torch.ones(2)]), ctx)
    runtime.build()
    new = group_set("a")
    reshape(runtime, provider, old, new, Shape(("a",), tp=1), 0, ["a"], 2)
    assert (runtime.ctx.world_size, runtime.ctx.data_slots) == (1, 2)
    assert list(runtime.ctx.held_slots) == [0, 1]
    assert runtime.ctx.group("dp").size() == 1
    new.close()


def _on_replicas(dp: int, slots: int, work: Any) -> dict[int, Any]:
    """``work(ctx)`` on each of ``dp`` replicas (TP 1) of a job of ``slots`` slots."""
    store = dist.HashStore()

    def rank(r: int) -> Any:
        groups = StaticGroups(store, rank=r, world_size=dp, tp=1, timeout=10)
        ctx = JobContext(job="j", rank=r, world_size=dp, tp=1, groups=groups, slots=slots,
                         collective_timeout=10)
        return work(ctx)

    out = run_ranks({str(r): (lambda r=r: rank(r)) for r in range(dp)}, timeout=30)
    return {r: out[str(r)] for r in range(dp)}


def _state(slot: int) -> torch.Tensor:
    return torch.arange(3.0) + 10 * slot


def test_slot_states_go_where_they_are_wanted_from_a_replica_that_has_them() -> None:
    # Four slots on DP 2 after a shrink from DP 4: replica 0 kept slot 0 and the copy of slot 3,
    # replica 1 slot 2 and the copy of slot 1. Each now wants its two slots and the other's
    # (its copies): what it lacks comes from the other; what it does not want is dropped.
    had = {0: {0: _state(0), 3: _state(3)}, 1: {2: _state(2), 1: _state(1)}}

    def work(ctx: JobContext) -> dict[int, torch.Tensor]:
        return slots_mod.redistribute(ctx, had[ctx.dp_index], [0, 1, 2, 3],
                                      lambda x: torch.empty(3))

    out = _on_replicas(2, 4, work)
    for d in (0, 1):
        assert sorted(out[d]) == [0, 1, 2, 3]
        for x, t in out[d].items():
            assert torch.equal(t, _state(x))
    assert out[0][0] is had[0][0]  # kept, not copied

    def dropping(ctx: JobContext) -> dict[int, torch.Tensor]:
        return slots_mod.redistribute(ctx, had[ctx.dp_index], [ctx.dp_index],
                                      lambda x: torch.empty(3))

    out = _on_replicas(2, 4, dropping)
    assert sorted(out[0]) == [0] and sorted(out[1]) == [1]
    assert torch.equal(out[1][1], _state(1))


def test_a_slot_state_nobody_has_fails_on_every_replica_alike() -> None:
    def work(ctx: JobContext) -> str:
        try:
            slots_mod.redistribute(ctx, {ctx.dp_index: _state(ctx.dp_index)}, [0, 1, 2],
                                   lambda x: torch.empty(3))
        except ValueError as exc:
            return str(exc)
        return "no error"

    out = _on_replicas(2, 3, work)
    assert out[0] == out[1] and "slot 2's state is held by no member" in out[0]


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_the_slots_chunks_are_gathered_from_their_holders(dp: int) -> None:
    whole = torch.arange(23.0)  # 5 slots: chunks of 4 or 5 elements

    def work(ctx: JobContext) -> torch.Tensor:
        mine = {x: whole[chunk(23, 5, x)].clone() for x in ctx.held_slots}
        out = torch.full((23,), -1.0)
        slots_mod.gather_slots(ctx, mine, out)
        return out

    for got in _on_replicas(dp, 5, work).values():
        assert torch.equal(got, whole)
