"""Versioned process groups in one process: ranks are threads, bootstrap is a HashStore.

The first tests are the experiments that chose the mechanism (docs/groups.md): what a Python
subclass of ``ProcessGroup`` receives on torch 2.13, and why retiring a communicator must be
enforced in Python rather than by the backend.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from understudy.common import env
from understudy.groups import abortable
from understudy.groups.errors import (
    CollectiveAborted,
    CollectiveFailed,
    CollectiveTimeout,
    GroupBuildError,
    NoCurrentVersionError,
    RetiredVersionError,
)
from understudy.groups.groupset import GroupSet
from understudy.groups.versioned import VersionedGroup, VersionState

GLOO = dist.ProcessGroup.BackendType.GLOO
CPU = torch.device("cpu")


def run_ranks(fns: dict[str, Callable[[], Any]], timeout: float = 15.0) -> dict[str, Any]:
    """Run each function on its own thread; return results, re-raise the first error."""
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            results[name] = fn()
        except BaseException as exc:
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(n, f), name=f"rank {n}") for n, f in
               fns.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish in time"
    if errors:
        name, exc = next(iter(errors.items()))
        raise AssertionError(f"rank {name} failed: {exc!r}") from exc
    return results


def not_none(work: dist.Work | None) -> dist.Work:
    assert work is not None
    return work


def gloo_pair(prefix: str, size: int = 2, timeout: float = 5.0) -> list[dist.ProcessGroup]:
    """``size`` real ProcessGroups with a gloo backend, one per rank, built on threads."""
    store = dist.HashStore()

    def build(rank: int) -> dist.ProcessGroup:
        s = dist.PrefixStore(prefix, store)
        backend = dist.ProcessGroupGloo(s, rank, size, timedelta(seconds=timeout))
        pg = dist.ProcessGroup(s, rank, size)
        pg._register_backend(CPU, GLOO, backend)
        pg._set_default_backend(GLOO)
        return pg

    out = run_ranks({str(r): functools.partial(build, r) for r in range(size)})
    return [out[str(r)] for r in range(size)]


@contextlib.contextmanager
def deprecated_gather_scatter() -> Iterator[None]:
    """torch 2.13 deprecates all_gather_into_tensor, reduce_scatter_tensor, their _base forms and
    all_gather_coalesced (FutureWarning); Megatron still calls the first two, so the
    experiment must too. Only those warnings are ignored."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=FutureWarning,
            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor|"
                    r"_all_gather_base|_reduce_scatter_base|all_gather_coalesced)`")
        yield


# -- evidence: what reaches a Python subclass of ProcessGroup on torch 2.13 --------------------

class Recorder(dist.ProcessGroup):
    """Records the method names torch.distributed calls on it, forwarding to a real group."""

    def __init__(self, inner: dist.ProcessGroup) -> None:
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]
        self.inner = inner
        self.seen: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name in FORWARD_NAMES:
            seen = object.__getattribute__(self, "seen")
            inner = object.__getattribute__(self, "inner")
            seen.append(name)
            return getattr(inner, name)
        return object.__getattribute__(self, name)


FORWARD_NAMES = {
    "allreduce", "broadcast", "allgather", "all_gather_single", "_allgather_base",
    "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter", "allgather_coalesced",
    "send", "recv", "barrier", "reduce", "gather", "scatter", "alltoall_base", "all_to_all_single",
}

# dist function -> (call on group g at rank r, the method name that must be reached)
CALLS: dict[str, tuple[Callable[[Any, int], Any], str]] = {
    "all_reduce": (lambda g, r: dist.all_reduce(torch.ones(2), group=g), "allreduce"),
    "broadcast": (lambda g, r: dist.broadcast(torch.ones(2), group=g, group_src=0),
                  "broadcast"),
    "all_gather": (lambda g, r: dist.all_gather([torch.zeros(2), torch.zeros(2)],
                                                torch.ones(2), group=g), "allgather"),
    "all_gather_into_tensor": (lambda g, r: dist.all_gather_into_tensor(
        torch.zeros(4), torch.ones(2), group=g), "all_gather_single"),
    "_all_gather_base": (lambda g, r: dist._all_gather_base(
        torch.zeros(4), torch.ones(2), group=g), "all_gather_single"),
    "reduce_scatter_tensor": (lambda g, r: dist.reduce_scatter_tensor(
        torch.zeros(2), torch.ones(4), group=g), "reduce_scatter_single"),
    "_reduce_scatter_base": (lambda g, r: dist._reduce_scatter_base(
        torch.zeros(2), torch.ones(4), group=g), "reduce_scatter_single"),
    # dist.recv itself also asks torch for the sender's global rank: see register().
    "send/irecv": (lambda g, r: dist.send(torch.ones(2), group=g, group_dst=1) if r == 0
                   else not_none(dist.irecv(torch.zeros(2), group=g, group_src=0)).wait(),
                   "send|recv"),
    "barrier": (lambda g, r: dist.barrier(group=g), "barrier"),
    "reduce": (lambda g, r: dist.reduce(torch.ones(2), group=g, group_dst=0), "reduce"),
    "all_to_all_single": (lambda g, r: dist.all_to_all_single(torch.zeros(2), torch.ones(2),
                                                              group=g), "all_to_all_single"),
    "all_gather_coalesced": (lambda g, r: dist.all_gather_coalesced(
        [[torch.zeros(2)], [torch.zeros(2)]], [torch.ones(2)], group=g), "allgather_coalesced"),
}


def test_every_dist_collective_reaches_python_overrides_by_method_name() -> None:
    inner = gloo_pair("evidence")
    groups = [Recorder(pg) for pg in inner]
    reached: dict[str, list[str]] = {}
    for fname, (call, _) in CALLS.items():
        for g in groups:
            g.seen.clear()
        with deprecated_gather_scatter():
            run_ranks({str(r): functools.partial(call, groups[r], r) for r in range(2)})
        reached[fname] = groups[0].seen + groups[1].seen
    for fname, (_, expected) in CALLS.items():
        assert reached[fname] and set(reached[fname]) <= set(expected.split("|")), \
            (fname, reached[fname])
    # The _base forms are never what torch calls: overriding _allgather_base alone misses
    # all_gather_into_tensor, which is how "it does not reach Python" can be observed.
    assert not any("_base" in m for seen in reached.values() for m in seen)


def test_cpp_dispatcher_paths_refuse_a_python_group() -> None:
    g = VersionedGroup("solo", 0, 1)
    with pytest.raises(RuntimeError, match="Expected a value of type"):
        torch.ops.c10d.allreduce_([torch.ones(1)], g, torch.classes.c10d.ReduceOp(), None,
                                  -1, False)


def test_registering_a_second_backend_on_a_process_group_is_ignored() -> None:
    a, b = gloo_pair("first", size=1)[0], gloo_pair("second", size=1)[0]
    pg = dist.ProcessGroup(dist.HashStore(), 0, 1)
    pg._register_backend(CPU, GLOO, a._get_backend(CPU))
    pg._register_backend(CPU, GLOO, b._get_backend(CPU))  # silently ignored
    assert pg._get_backend(CPU) is a._get_backend(CPU)


def test_shutdown_and_abort_do_not_fence_a_gloo_group() -> None:
    """A rebinding pass that missed one reference would keep talking over the old membership:
    after shutdown() and abort() on every rank, gloo still all-reduces."""
    groups = gloo_pair("fence")

    def use(r: int) -> float:
        groups[r].shutdown()
        groups[r].abort()
        t = torch.ones(1)
        dist.all_reduce(t, group=groups[r])
        return float(t.item())

    assert run_ranks({str(r): functools.partial(use, r) for r in range(2)}) == {
        "0": 2.0, "1": 2.0}


# -- the stable group and the group set -----------------------------------------------------

@pytest.fixture
def shared_store() -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    return store


def make_set(store: dist.Store, member: str, timeout: float = 5.0) -> GroupSet:
    def factory(namespace: str, cancel: threading.Event) -> dist.Store:
        return dist.PrefixStore(namespace, store)

    return GroupSet("job", member, store_factory=factory, timeout=timeout)


def test_versioned_group_forwards_megatron_style_collectives(shared_store: dist.Store) -> None:
    sets = {m: make_set(shared_store, m) for m in ("a", "b")}

    def rank(m: str) -> dict[str, list[float]]:
        g = sets[m].create("tp", ["a", "b"])
        g.register([5, 9])  # dist.recv and get_global_rank need the job-wide ranks
        r = g.rank()
        out: dict[str, list[float]] = {}
        t = torch.full((2,), float(r + 1))
        dist.all_reduce(t, group=g)
        out["all_reduce"] = t.tolist()
        gathered = torch.zeros(4)
        scattered = torch.zeros(2)
        with deprecated_gather_scatter():
            dist.all_gather_into_tensor(gathered, torch.full((2,), float(r)), group=g)
            dist.reduce_scatter_tensor(scattered, torch.arange(4.0) * (r + 1), group=g)
        out["all_gather_into_tensor"] = gathered.tolist()
        out["reduce_scatter_tensor"] = scattered.tolist()
        b = torch.full((1,), float(r + 7))
        dist.broadcast(b, group=g, group_src=1)
        out["broadcast"] = b.tolist()
        if r == 0:
            dist.send(torch.tensor([5.0]), group=g, group_dst=1)
        else:
            got = torch.zeros(1)
            dist.recv(got, group=g, group_src=0)
            out["recv"] = got.tolist()
        dist.barrier(group=g)
        assert dist.get_world_size(group=g) == 2 and dist.get_global_rank(g, 1) == 9
        sets[m].close()
        return out

    res = run_ranks({m: functools.partial(rank, m) for m in sets})
    for m in sets:
        assert res[m]["all_reduce"] == [3.0, 3.0]
        assert res[m]["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert res[m]["broadcast"] == [8.0]
    assert res["a"]["reduce_scatter_tensor"] == [0.0, 3.0]
    assert res["b"]["reduce_scatter_tensor"] == [6.0, 9.0]
    assert res["b"]["recv"] == [5.0]


GRID = {  # TP=2 x DP=2: w3 leaves, s0 joins in its slot
    "world": ["w0", "w1", "w2", "w3"],
    "tp-0": ["w0", "w1"], "tp-1": ["w2", "w3"],
    "dp-0": ["w0", "w2"], "dp-1": ["w1", "w3"],
}


ROLE = {"w0": 0, "w1": 1, "w2": 2, "w3": 3, "s0": 3}
SWITCH_AT, STEPS = 5, 8


def grid_step(gs: GroupSet, role: int, step: int) -> float:
    """One step's collectives: all-reduce over TP, DP and the whole job."""
    x = torch.full((1,), float(role + 1 + step))
    for name in (f"tp-{role // 2}", f"dp-{role % 2}", "world"):
        dist.all_reduce(x, group=gs.current(name))
    return float(x.item())


def test_replacement_rebuilds_only_the_leavers_groups_and_no_collective_reaches_v1(
        shared_store: dist.Store) -> None:
    sets = {m: make_set(shared_store, m) for m in ROLE}
    joiner_go = threading.Event()

    def create(m: str) -> list[str]:
        mine = [n for n, ms in GRID.items() if m in ms]
        for name in mine:
            sets[m].create(name, GRID[name])
        return mine

    def survivor(m: str) -> dict[str, Any]:
        gs = sets[m]
        mine = create(m)
        before = {n: gs.current(n).version for n in mine}
        sums, steps_in_phase1 = [], 0
        for step in range(STEPS):
            if step == 1:
                rebuilt = gs.prepare_replacement("w3", "s0")
            if step == SWITCH_AT:
                ops_at_switch = {n: before[n].ops for n in rebuilt}
                gs.switch(rebuilt)
            if 1 <= step < SWITCH_AT and not gs.ready(rebuilt):
                steps_in_phase1 += 1  # v1 still serving while v2 is not yet built
            sums.append(grid_step(gs, ROLE[m], step))
            if m == "w0" and step == 2:
                joiner_go.set()
        with pytest.raises(RetiredVersionError):
            before["world"].call("allreduce", [torch.ones(1)])
        out = {
            "rebuilt": rebuilt, "stats": gs.stats, "sums": sums, "phase1": steps_in_phase1,
            "v1_ops_frozen": all(before[n].ops == ops_at_switch[n]
                                 for n in rebuilt),
            "v1_retired": all(before[n].state is VersionState.RETIRED
                              for n in rebuilt),
            "untouched_same": all(gs.current(n).version is before[n] for n in mine
                                  if n not in rebuilt),
            "versions": {n: gs.version(n) for n in mine},
        }
        gs.close()
        return out

    def leaver() -> list[float]:
        create("w3")
        sums = [grid_step(sets["w3"], 3, step) for step in range(SWITCH_AT)]
        sets["w3"].close()
        return sums

    def joiner() -> list[float]:
        gs = sets["s0"]
        assert joiner_go.wait(10)
        names = [n for n, ms in GRID.items() if "w3" in ms]
        for name in names:
            gs.prepare(name, 2, ["s0" if x == "w3" else x for x in GRID[name]])
        gs.switch(names)
        sums = [grid_step(gs, 3, step) for step in range(SWITCH_AT, STEPS)]
        gs.close()
        return sums

    fns: dict[str, Callable[[], Any]] = {m: functools.partial(survivor, m)
                                         for m in ("w0", "w1", "w2")}
    fns["w3"], fns["s0"] = leaver, joiner
    res = run_ranks(fns)
    # Each value goes through TP (x2), DP (x2 of TP sums), world (x4): 4 * sum over roles.
    expected = [4.0 * sum(r + 1 + step for r in range(4)) for step in range(STEPS)]
    assert res["w3"] + res["s0"] == expected
    expect_rebuilt = {"w0": ["world"], "w1": ["dp-1", "world"], "w2": ["tp-1", "world"]}
    for m, rebuilt in expect_rebuilt.items():
        r = res[m]
        assert r["sums"] == expected
        assert sorted(r["rebuilt"]) == rebuilt
        assert r["stats"].untouched == 3 - len(rebuilt)
        assert r["stats"].switched == 3 + len(rebuilt)
        assert r["phase1"] >= 1
        assert r["v1_ops_frozen"] and r["v1_retired"] and r["untouched_same"]
        assert r["versions"] == {n: 2 if n in rebuilt else 1 for n in r["versions"]}


def test_caller_mistakes_are_value_errors(shared_store: dist.Store) -> None:
    gs = make_set(shared_store, "a")
    gs.create("solo", ["a"])
    with pytest.raises(ValueError, match="not above"):
        gs.prepare("solo", 1, ["a"])
    with pytest.raises(ValueError, match="not among the members"):
        gs.prepare("solo", 2, ["b"])
    with pytest.raises(ValueError, match="repeat"):
        gs.prepare("other", 1, ["a", "a"])
    with pytest.raises(ValueError, match="rank 1 of 2"):
        gs.prepare("solo", 2, ["b", "a"])
    with pytest.raises(ValueError, match="group name"):
        gs.prepare("bad/name", 1, ["a"])
    with pytest.raises(ValueError, match="no prepared version"):
        gs.switch(["solo"])
    with pytest.raises(ValueError, match="no group named"):
        gs.current("missing")
    with pytest.raises(ValueError, match="is the leaver"):
        gs.prepare_replacement("a", "z")
    gs.prepare("solo", 3, ["a"])
    with pytest.raises(ValueError, match="already being prepared"):
        gs.prepare("solo", 4, ["a"])
    gs.switch(["solo"])
    assert gs.version("solo") == 3
    gs.close()


def test_switch_is_all_or_nothing_and_an_abandoned_version_burns_its_number(
        shared_store: dist.Store) -> None:
    gs = make_set(shared_store, "a", timeout=0.5)
    g = gs.create("solo", ["a"])
    gs.prepare("solo", 2, ["a"])
    gs.prepare("pair", 1, ["a", "never-comes"])  # its build waits for a member in vain
    with pytest.raises(GroupBuildError):
        gs.switch(["solo", "pair"], timeout=2)
    assert gs.version("solo") == 1 and gs.names() == ["solo"], "nothing may switch"
    t = torch.ones(1)
    dist.all_reduce(t, group=g)  # the current version still serves
    assert sorted(gs.abandon()) == ["pair", "solo"] and gs.pending() == []
    with pytest.raises(ValueError, match="not above"):
        gs.prepare("solo", 2, ["a"])
    assert gs.stats.failed == 1 and gs.stats.abandoned == 2
    gs.close()


def test_fenced_group_refuses_collectives_until_the_next_switch(
        shared_store: dist.Store) -> None:
    gs = make_set(shared_store, "a")
    g = gs.create("solo", ["a"])
    gs.fence(["solo"])
    with pytest.raises(NoCurrentVersionError):
        dist.all_reduce(torch.ones(1), group=g)
    gs.prepare("solo", 2, ["a"])
    gs.switch(["solo"])
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    assert t.item() == 1.0 and gs.current("solo") is g
    gs.close()


# -- abortable waits -----------------------------------------------------------------------

def test_abortable_wait_is_released_by_abort_timeout_or_completion() -> None:
    groups = gloo_pair("abort", timeout=3.0)
    work = dist.all_reduce(torch.ones(1), group=groups[0], async_op=True)  # rank 1 is silent
    gone = threading.Event()
    threading.Timer(0.2, gone.set).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveAborted):
        abortable.wait(work, abort=gone.is_set, slice_s=0.02)
    assert 0.2 <= time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout):
        abortable.wait(work, timeout=0.1, slice_s=0.02)
    assert time.monotonic() - t0 < 0.4
    # Rank 1 joins late: the same work completes, and the wait returns.
    dist.all_reduce(torch.ones(1), group=groups[1])
    abortable.wait(work, timeout=2)
    with pytest.raises(ValueError):
        abortable.wait(work, slice_s=0)


def test_a_nudge_makes_a_wait_ask_its_abort_predicate_before_its_slice_ends() -> None:
    """A wait with a 30 s slice on a collective that never completes: set its predicate and
    nudge, and it gives up at once (without the nudge it would look again after 30 s); a
    completed work is not mistaken for a nudge, nor a nudge for completion."""
    groups = gloo_pair("nudge", timeout=60.0)
    work = dist.all_reduce(torch.ones(1), group=groups[0], async_op=True)  # rank 1 is silent
    gone = threading.Event()
    nudges = 0

    def tell() -> None:
        nonlocal nudges
        abortable.nudge()  # the predicate is still false: the wait goes on
        nudges += 1
        gone.set()
        abortable.nudge()
        nudges += 1

    threading.Timer(0.2, tell).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveAborted, match="told to abort"):
        abortable.wait(work, abort=gone.is_set, slice_s=30.0)
    assert time.monotonic() - t0 < 10.0, "the wait looked again only at its slice's end"
    assert nudges >= 1
    abortable.nudge()  # no wait in progress: nothing to wake
    # Rank 1 joins: the completed work ends a wait with a long slice too, not as an abort.
    dist.all_reduce(torch.ones(1), group=groups[1])
    abortable.wait(work, abort=gone.is_set, slice_s=30.0)


def test_abortable_wait_reports_a_failed_collective() -> None:
    groups = gloo_pair("fail", timeout=0.3)
    work = dist.all_reduce(torch.ones(1), group=groups[0], async_op=True)
    with pytest.raises(CollectiveFailed, match="failed"):
        abortable.wait(work, timeout=5)


# -- the store contract, on torch's own HashStore (the integration tests run DaemonStore) ----

def check_store_contract(store: dist.Store, timeout: float) -> None:
    """What a bootstrap store must do; ``timeout`` is the store's own (``set_timeout``)."""
    store.set("a", "1")
    store.set("s", "text")
    assert store.get("a") == b"1" and store.get("s") == b"text"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x"  # absent, empty expected: set
    assert store.compare_set("c", "", "y") == b"x"  # mismatch: the current value
    assert store.compare_set("c", "x", "z") == b"z"
    assert store.compare_set("absent", "e", "d") == b"e" and not store.check(["absent"])
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    count = store.num_keys()
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == count - 1
    timer = threading.Timer(0.1, lambda: store.set("late", "v"))
    timer.start()
    assert store.get("late") == b"v"  # get waits for a later set
    timer.join()
    store.wait(["late", "n"])
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    assert timeout - 0.05 <= time.monotonic() - t0 < timeout + 1.0
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["late", "never"], timedelta(seconds=0.2))
    assert time.monotonic() - t0 < 1.2


def test_hash_store_defines_the_store_contract() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=0.3))
    check_store_contract(store, 0.3)


def test_a_reserved_group_exists_before_its_first_version() -> None:
    from understudy.groups.errors import NoCurrentVersionError
    from understudy.groups.groupset import GroupSet

    gs = GroupSet("job", "w0", store_factory=lambda ns, cancel: dist.HashStore())
    group = gs.reserve("tp-0", 0, 2)
    assert gs.current("tp-0") is group and (group.rank(), group.size()) == (0, 2)
    with pytest.raises(NoCurrentVersionError):
        group.allreduce([torch.zeros(1)], dist.AllreduceOptions())
    assert gs.reserve("tp-0", 0, 2) is group
    with pytest.raises(ValueError, match="rank 0 of 2"):
        gs.reserve("tp-0", 1, 2)
    gs.close()


def test_a_stand_in_answers_a_stable_group_until_its_first_real_version(
        shared_store: dist.Store) -> None:
    # The sandbox's use: a model is built on the stable object while someone else's
    # communicator (here a real one-rank gloo group) answers; the real version replaces it.
    gs = make_set(shared_store, "a")
    other = gloo_pair("stand-in", size=1)[0]
    g = gs.stand_in("solo", 0, 1, other)
    t = torch.full((1,), 3.0)
    dist.all_reduce(t, group=g)
    assert t.item() == 3.0 and g.version is not None and g.version.number == 0
    with pytest.raises(ValueError, match="current version already"):
        gs.stand_in("solo", 0, 1, other)
    with pytest.raises(ValueError, match="rank 0 of 1, not 1 of 2"):
        gs.stand_in("duo", 1, 2, other)
    assert gs.retire_stand_ins() == ["solo"] and gs.retire_stand_ins() == []
    with pytest.raises(NoCurrentVersionError):
        dist.all_reduce(torch.ones(1), group=g)
    gs.prepare("solo", 1, ["a"])
    gs.switch(["solo"])
    dist.all_reduce(t, group=g)
    assert gs.current("solo") is g and g.version is not None and g.version.number == 1
    assert g.version.ops == 1
    # A switch straight over a stand-in retires it too; neither touched the communicator.
    g2 = gs.stand_in("solo2", 0, 1, other)
    gs.prepare("solo2", 1, ["a"])
    gs.switch(["solo2"])
    assert g2.version is not None and g2.version.number == 1
    dist.all_reduce(t, group=other)
    gs.close()


def test_a_tap_sees_each_collective_on_its_way_until_it_is_removed(
        shared_store: dist.Store) -> None:
    gs = make_set(shared_store, "a")
    g = gs.create("solo", ["a"])
    seen: list[str] = []

    def tap(op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
            issue: Callable[..., Any]) -> Any:
        seen.append(op)
        return issue(*args, **kwargs)

    g.tap(tap)
    t = torch.full((1,), 2.0)
    dist.all_reduce(t, group=g)
    dist.barrier(group=g)
    assert seen == ["allreduce", "barrier"] and t.item() == 2.0
    g.tap(None)
    dist.all_reduce(t, group=g)
    assert seen == ["allreduce", "barrier"]
    assert g.version is not None and g.version.ops == 3
    gs.close()


def test_a_lone_group_answers_every_collective_of_one_member_without_a_backend() -> None:
    from understudy.groups.lone import LoneGroup

    g = LoneGroup(global_rank=5)
    assert (g.rank(), g.size()) == (0, 1) and dist.get_global_rank(g, 0) == 5
    t = torch.arange(4.0)
    dist.all_reduce(t, group=g)
    dist.broadcast(t, group=g, group_src=0)
    dist.barrier(group=g)
    assert torch.equal(t, torch.arange(4.0))
    out = torch.zeros(4)
    with deprecated_gather_scatter():
        dist.all_gather_into_tensor(out, t, group=g)
    assert torch.equal(out, t)
    gathered = [torch.zeros(4)]
    dist.all_gather(gathered, t, group=g)
    assert torch.equal(gathered[0], t)
    out = torch.zeros(4)
    with deprecated_gather_scatter():
        dist.reduce_scatter_tensor(out, t, group=g)
    assert torch.equal(out, t)
    with pytest.raises(RuntimeError, match="no peer"):
        g.send([t], 0, 0)
    g.unregister()


def test_gloo_binds_the_nodes_address_unless_the_operator_named_interfaces(
        shared_store: dist.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon passes its node's address (``UNDERSTUDY_NODE_ADDRESS``: the first of
    ``addresses``); a group's gloo device binds it, not what the host name resolves to (on a
    stock Debian host 127.0.1.1, which no other node can reach). 127.0.0.2 is a loopback
    address that nothing else here binds."""

    def gloo_addresses() -> set[str]:  # where this process listens: what peers connect to
        return {c.laddr.ip for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN}

    def connect(version: int) -> tuple[dict[str, float], set[str]]:
        """Both members' sums of a pair group's all-reduce, and the addresses the group
        listens on (read while it is up)."""
        sets = {m: make_set(shared_store, m) for m in ("a", "b")}
        before = gloo_addresses()

        def build(member: str) -> float:
            gs = sets[member]
            gs.prepare("pair", version, ["a", "b"])
            gs.switch(["pair"])
            t = torch.ones(1)
            dist.all_reduce(t, group=gs.current("pair"))
            return float(t.item())

        try:
            return run_ranks({m: functools.partial(build, m) for m in sets}), \
                gloo_addresses() - before
        finally:
            for gs in sets.values():
                gs.close()

    monkeypatch.setenv(env.NODE_ADDRESS, "127.0.0.2")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert connect(1) == ({"a": 2.0, "b": 2.0}, {"127.0.0.2"})
    # The operator's interfaces win: gloo's own choice on "lo" is 127.0.0.1.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert connect(2) == ({"a": 2.0, "b": 2.0}, {"127.0.0.1"})


def test_wait_ready_returns_once_the_last_named_version_is_built(
        shared_store: dist.Store) -> None:
    """A waiter blocks on the builds themselves (a recovery's critical path waits on it): it
    is not ready while a member has not joined the rendezvous, and is the moment it has."""
    sets = {m: make_set(shared_store, m) for m in ("a", "b")}
    b_may_join = threading.Event()

    def a() -> tuple[bool, bool, bool]:
        gs = sets["a"]
        gs.prepare("pair", 1, ["a", "b"])
        before = gs.wait_ready(["pair"], 0.3)  # b has not joined: times out
        b_may_join.set()
        after = gs.wait_ready(["pair"], 10.0)
        ready = gs.ready(["pair"])
        gs.switch(["pair"])
        dist.all_reduce(torch.ones(1), group=gs.current("pair"))
        gs.close()
        return before, after, ready

    def b() -> None:
        gs = sets["b"]
        assert b_may_join.wait(10)
        gs.prepare("pair", 1, ["a", "b"])
        assert gs.wait_ready(["pair"], 10.0)
        gs.switch(["pair"])
        dist.all_reduce(torch.ones(1), group=gs.current("pair"))
        gs.close()

    res = run_ranks({"a": a, "b": b})
    assert res["a"] == (False, True, True)
