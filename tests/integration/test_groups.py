"""Versioned groups across real processes, bootstrapped through a real daemon on a real etcd.

Workers are spawned (not forked) with ``UNDERSTUDY_SOCKET`` in their environment, as the daemon's
supervisor starts them, and write their results as JSON for the test to compare.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist

from understudy.common import env
from understudy.common.daemon_client import DaemonClient
from understudy.groups import abortable
from understudy.groups.errors import (
    CollectiveAborted,
    GroupBuildError,
    GroupStoreError,
    NoCurrentVersionError,
    RetiredVersionError,
    StoreCancelled,
)
from understudy.groups.groupset import GroupSet
from understudy.groups.store import DaemonStore

if TYPE_CHECKING:
    from understudy.testing.embedded_etcd import EmbeddedEtcd

# Spawned workers import this module: the daemon side (etcd client, grpc, the local cluster) is
# imported inside the tests that need it, so that each worker starts on torch alone.

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


@pytest.fixture
def socket_path(etcd: EmbeddedEtcd, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real daemon's worker socket, exported to the workers this test spawns."""
    from understudy.testing.localcluster import LocalCluster

    cluster = LocalCluster(etcd_endpoint=etcd.endpoint, base_dir=tmp_path / "cluster")
    try:
        d = cluster.add("node-a", "active")
        cluster.wait_state("node-a", "active")
        path = str(d.run_dir / "understudyd.sock")
        monkeypatch.setenv(env.CHILD_SOCKET, path)
        yield path
    finally:
        cluster.stop_all(timeout=5, drain=False)
        for name, daemon in cluster.daemons.items():
            assert "Traceback" not in daemon.log_text(), f"{name} logged a traceback"


def spawn(target: Callable[..., None], members: list[str], out: Path) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    procs = {m: ctx.Process(target=target, args=(m, str(out)), name=f"worker {m}")
             for m in members}
    for p in procs.values():
        p.start()
    return procs


def join(procs: dict[str, Any], timeout: float, out: Path) -> None:
    deadline = time.monotonic() + timeout
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [m for m, p in procs.items() if p.is_alive()]
    for m in alive:
        procs[m].kill()
        procs[m].join(5)
    wrote = sorted(p.stem for p in out.glob("*.json"))
    assert not alive, f"workers {alive} did not finish in {timeout}s; results from {wrote}"
    codes = {m: p.exitcode for m, p in procs.items()}
    assert all(c == 0 for c in codes.values()), f"worker exit codes: {codes}"


def results(out: Path, members: list[str]) -> dict[str, Any]:
    return {m: json.loads((out / f"{m}.json").read_text()) for m in members}


def write(out: str, member: str, result: dict[str, Any]) -> None:
    tmp = Path(out) / f".{member}.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(Path(out) / f"{member}.json")


# -- the bootstrap store ------------------------------------------------------------------

def test_daemon_store_meets_the_store_contract_and_cancels_waits(socket_path: str) -> None:
    from tests.unit.test_groups import check_store_contract

    store = DaemonStore("job1/tp-0/v1", epoch=1, timeout=0.3)
    check_store_contract(store, 0.3)
    cancel = threading.Event()
    waiting = DaemonStore("job1/tp-0/v2", timeout=30, cancel=cancel)
    threading.Timer(0.2, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(StoreCancelled):
        waiting.get("never")
    assert time.monotonic() - t0 < 1.0
    for s in (store, waiting):
        s.close()
    with pytest.raises(GroupStoreError, match="closed"):
        store.get("a")
    with pytest.raises(GroupStoreError, match="namespace"):
        DaemonStore("../escape")


def test_gloo_bootstraps_through_the_daemon_and_a_stale_epoch_is_refused(
        etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """The daemon's local server, run in this process with an epoch check that fences every
    epoch below 5 (which epochs are stale is the daemon's decision, not the store's)."""
    from understudy.common import config
    from understudy.common.keys import Keys
    from understudy.common.store import EtcdStore
    from understudy.daemon.localsock import LocalServer

    path = tmp_path / "kv.sock"
    ready, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        cfg = config.load(overrides={"etcd.endpoints": etcd.endpoint}, environ={},
                          require_node=False)
        store = EtcdStore(cfg.etcd)
        server = LocalServer(path, store, Keys("/understudy"), "node-a",
                             epoch_check=lambda ns, e: "fenced by epoch 5" if e < 5 else None)
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await server.close()
        await store.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="local-server")
    thread.start()
    try:
        assert ready.wait(10)
        with pytest.raises(GroupStoreError, match="epoch 4 refused: fenced by epoch 5"):
            DaemonStore("job1/dp-0/v2", epoch=4, path=str(path))
        sets = [GroupSet("job1", m, epoch=5, socket_path=str(path), timeout=10)
                for m in ("a", "b")]
        sums: dict[str, float] = {}

        def rank(gs: GroupSet) -> None:
            g = gs.create("dp-0", ["a", "b"])
            t = torch.full((1,), float(g.rank() + 1))
            dist.all_reduce(t, group=g)
            sums[gs.member] = float(t.item())

        threads = [threading.Thread(target=rank, args=(gs,)) for gs in sets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert sums == {"a": 3.0, "b": 3.0}
        stale = GroupSet("job1", "c", epoch=3, socket_path=str(path), timeout=5)
        stale.prepare("dp-1", 1, ["c"])
        with pytest.raises(GroupBuildError, match="refused") as info:
            stale.switch(["dp-1"])
        assert isinstance(info.value.__cause__, GroupStoreError)
        for gs in [*sets, stale]:
            gs.close()
    finally:
        stop.set()
        thread.join(10)


# -- the live replacement of one member, TP=2 x DP=2 ----------------------------------------

GRID = {
    "world": ["w0", "w1", "w2", "w3"],
    "tp-0": ["w0", "w1"], "tp-1": ["w2", "w3"],
    "dp-0": ["w0", "w2"], "dp-1": ["w1", "w3"],
}
ROLE = {"w0": 0, "w1": 1, "w2": 2, "w3": 3, "s0": 3}
PREPARE_AT, SWITCH_AT, STEPS = 1, 6, 9


def _step(gs: GroupSet, role: int, step: int, acc: torch.Tensor) -> float:
    """A training step's communication pattern on float data: TP and DP all-reduces, then a
    job-wide all-reduce of the loss; ``acc`` is the state that moves with the role."""
    x = torch.randn(32, generator=torch.Generator().manual_seed(1000 * step + role)) + acc
    dist.all_reduce(x, group=gs.current(f"tp-{role // 2}"))
    dist.all_reduce(x, group=gs.current(f"dp-{role % 2}"))
    x /= 4
    loss = (x * x).sum().reshape(1)
    dist.all_reduce(loss, group=gs.current("world"))
    acc += 0.1 * x
    return float(loss.item())


def _uninterrupted(member: str) -> dict[str, Any]:
    gs = GroupSet("ref", member, timeout=15)
    for name, members in GRID.items():
        if member in members:
            gs.create(name, members)
    acc = torch.zeros(32)
    losses = [_step(gs, ROLE[member], s, acc) for s in range(STEPS)]
    gs.close()
    return {"losses": losses, "acc": acc.numpy().tobytes().hex()}


def _migrating(member: str) -> dict[str, Any]:
    gs = GroupSet("mig", member, timeout=15)
    control = DaemonClient("mig/control", timeout=30)
    role, acc, losses = ROLE[member], torch.zeros(32), []
    out: dict[str, Any] = {}
    if member == "s0":  # the joiner: binds once phase 1 is under way, takes w3's slot
        control.get("go", timeout=30)
        gs.prepare("xfer", 1, ["w3", "s0"])
        names = [n for n, ms in GRID.items() if "w3" in ms]
        for name in names:
            gs.prepare(name, 2, ["s0" if m == "w3" else m for m in GRID[name]])
        gs.switch(["xfer"])
        work = dist.irecv(acc, group=gs.current("xfer"), group_src=0)
        assert work is not None
        work.wait()
        gs.switch(names)
        losses = [_step(gs, role, s, acc) for s in range(SWITCH_AT, STEPS)]
    else:
        mine = [n for n, ms in GRID.items() if member in ms]
        for name in mine:
            gs.create(name, GRID[name])
        before = {n: gs.current(n).version for n in mine}
        rebuilt: list[str] = []
        in_phase1 = 0
        for s in range(SWITCH_AT if member == "w3" else STEPS):
            if s == PREPARE_AT:
                if member == "w3":
                    gs.prepare("xfer", 1, ["w3", "s0"])
                else:
                    rebuilt = gs.prepare_replacement("w3", "s0")
            if s == SWITCH_AT:
                out["v1_ops_at_switch"] = {n: before[n].ops for n in rebuilt}
                gs.switch(rebuilt)
            if PREPARE_AT <= s < SWITCH_AT and rebuilt and not gs.ready(rebuilt):
                in_phase1 += 1
            losses.append(_step(gs, role, s, acc))
            if member == "w0" and s == PREPARE_AT + 1:
                control.set("go", b"1")
        if member == "w3":  # the leaver hands its state over and exits
            gs.switch(["xfer"])
            dist.send(acc, group=gs.current("xfer"), group_dst=1)
        else:
            try:
                before["world"].call("allreduce", [torch.ones(1)])
                out["old_world_usable"] = True
            except RetiredVersionError:
                out["old_world_usable"] = False
            out.update(
                rebuilt=sorted(rebuilt), untouched=gs.stats.untouched, steps_in_phase1=in_phase1,
                v1_ops_after={n: before[n].ops for n in rebuilt},
                untouched_kept=all(gs.current(n).version is before[n] for n in mine
                                   if n not in rebuilt),
                versions={n: gs.version(n) for n in mine})
    gs.close()
    control.close()
    return {**out, "losses": losses, "acc": acc.numpy().tobytes().hex()}


def _grid_worker(member: str, out: str) -> None:
    result = {"ref": _uninterrupted(member)} if member != "s0" else {}
    result["mig"] = _migrating(member)
    write(out, member, result)


def test_live_replacement_matches_an_uninterrupted_run_and_leaves_v1_unreachable(
        socket_path: str, tmp_path: Path) -> None:
    members = ["w0", "w1", "w2", "w3", "s0"]
    join(spawn(_grid_worker, members, tmp_path), timeout=50, out=tmp_path)
    r = results(tmp_path, members)
    ref = {m: r[m]["ref"] for m in ("w0", "w1", "w2", "w3")}
    mig = {m: r[m]["mig"] for m in members}
    # Bitwise: every loss and the final state of every role, w3's role carried on by s0.
    for m in ("w0", "w1", "w2"):
        assert mig[m]["losses"] == ref[m]["losses"] and mig[m]["acc"] == ref[m]["acc"]
    assert mig["w3"]["losses"] + mig["s0"]["losses"] == ref["w3"]["losses"]
    assert mig["s0"]["acc"] == ref["w3"]["acc"]
    expect_rebuilt = {"w0": ["world"], "w1": ["dp-1", "world"], "w2": ["tp-1", "world"]}
    for m, rebuilt in expect_rebuilt.items():
        got = mig[m]
        assert got["rebuilt"] == rebuilt and got["untouched"] == 3 - len(rebuilt)
        assert got["untouched_kept"], "a group without the leaver was rebuilt"
        assert got["versions"] == {n: 2 if n in rebuilt else 1 for n in got["versions"]}
        assert got["steps_in_phase1"] >= 1, "training did not go on during phase 1"
        assert got["v1_ops_after"] == got["v1_ops_at_switch"], "a collective reached v1"
        assert got["old_world_usable"] is False


# -- an abortable collective on a frozen peer -------------------------------------------------

def _abort_worker(member: str, out: str) -> None:
    # The backend timeout is 20 s: a release within a second is the abort's doing, not gloo's.
    gs = GroupSet("abrt", member, timeout=20)
    control = DaemonClient("abrt/control", timeout=30)
    result: dict[str, Any] = {}
    if member == "j":
        gs.prepare("dp", 2, ["a", "b", "j"])
    else:
        g = gs.create("dp", ["a", "b", "c"])
        dist.all_reduce(torch.ones(1), group=g)
        control.set(f"ready-{member}", b"1")
        if member == "c":
            time.sleep(60)  # frozen by the test, then killed
            return
        control.get("frozen", timeout=30)
        work = dist.all_reduce(torch.ones(4), group=g, async_op=True)
        gone = threading.Event()

        def watch() -> None:  # the daemon's word that the peer is gone
            with DaemonClient("abrt/control", timeout=30) as c:
                c.get("abort", timeout=30)
            gone.set()

        threading.Thread(target=watch, name="abort-watch", daemon=True).start()
        result["issued"] = time.monotonic()
        try:
            abortable.wait(work, abort=gone.is_set, slice_s=0.05)
        except CollectiveAborted:
            result["released"] = time.monotonic()
        gs.fence(["dp"])
        try:
            dist.all_reduce(torch.ones(1), group=g)
        except NoCurrentVersionError:
            result["fenced"] = True
        t0 = time.monotonic()
        gs.prepare("dp", 2, ["a", "b", "j"])
    gs.switch(["dp"], timeout=15)
    g = gs.current("dp")
    t = torch.full((1,), float(g.rank() + 1))
    dist.all_reduce(t, group=g)
    result["sum"] = float(t.item())
    if member != "j":
        result["switch_s"] = time.monotonic() - t0
    write(out, member, result)
    gs.close(timeout=0.5)  # the stuck v1 is released in the background; do not wait for it
    control.close()


def test_a_collective_stuck_on_a_frozen_peer_is_aborted_and_the_next_version_works(
        socket_path: str, tmp_path: Path) -> None:
    procs = spawn(_abort_worker, ["a", "b", "c", "j"], tmp_path)
    try:
        with DaemonClient("abrt/control", timeout=30) as control:
            for m in ("a", "b", "c"):
                control.get(f"ready-{m}", timeout=30)
            os.kill(procs["c"].pid, signal.SIGSTOP)
            control.set("frozen", b"1")
            time.sleep(0.5)  # the survivors issue their all-reduce and stay blocked
            aborted_at = time.monotonic()
            control.set("abort", b"1")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(
                    (tmp_path / f"{m}.json").exists() for m in ("a", "b", "j")):
                time.sleep(0.05)
    finally:
        procs["c"].kill()
    join({m: p for m, p in procs.items() if m != "c"}, timeout=20, out=tmp_path)
    procs["c"].join(5)
    r = results(tmp_path, ["a", "b", "j"])
    for m in ("a", "b"):
        assert aborted_at - r[m]["issued"] >= 0.3, "the all-reduce was not blocked"
        assert 0 <= r[m]["released"] - aborted_at < 1.0, "not released within 1 s of the word"
        assert r[m]["fenced"]
        assert r[m]["switch_s"] < 5.0, "the switch waited on the stuck communicator"
    assert {m: r[m]["sum"] for m in r} == {"a": 6.0, "b": 6.0, "j": 6.0}
