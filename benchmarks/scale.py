"""Control plane at scale: N simulated nodes and the real controller on one real etcd.

For each N (``--nodes 256,1024,4096``), from scratch: an embedded etcd; one real
``understudyd`` (a standby node with nothing placed on it) that wins the election and is the
controller; N simulated nodes (``scale_sim.py``: the daemon's own NodeAgent, a real lease each,
keep-alives every ``--keepalive-interval``); jobs of ``--job-nodes`` active nodes (one rank
each, DP only) with ``--job-standbys`` standbys each, submitted one by one as ``understudy run``
writes them and placed by the controller; the other nodes are spare standbys. Then:

1. Steady state for ``--steady-seconds``: etcd requests/s by method (etcd's own
   ``grpc_server_handled_total``, and ``grpc_server_msg_received_total`` for messages on
   long-lived streams: keep-alives and watches), the controller's CPU and RSS (psutil), etcd's,
   and this process's own (the simulator shares the machine).
2. The controller's own code, timed here on the same etcd contents: a full re-list
   (``Controller._relist``, which the controller runs every 10 s) and one planning round
   (``plan`` on ``Controller._view``), which it runs on every change and every second.
3. ``--repeats`` failovers: a node holding ranks stops its keep-alives (a crash: its lease
   expires a TTL later); a separate observer process watches etcd and timestamps the node record
   disappearing, the registry entry turning ``failed`` and the job's recovery plan (its
   ``migration`` record) appearing. The simulator then plays the workers' part (bound, switched)
   so the controller commits the recovery and refills the standby pool, and the crashed node
   rejoins. etcd requests/s and controller CPU over the failover windows.

With ``--controller-code-only``, no fleet: the N nodes' records (registry entry, and node
record on a lease) and the jobs' (spec, assignment, status) are written straight to etcd as the
fleet and the controller would have left them, and only step 2 runs. Seconds at any size, and
not bound by the simulator's CPU: for the controller's own cost as N grows.

    .venv/bin/python benchmarks/scale.py [--nodes 256,1024,4096] [--repeats R] [--smoke]
    .venv/bin/python benchmarks/scale.py --controller-code-only --nodes 1024,4096,16384
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import psutil
from harness import (
    MIB,
    BenchmarkError,
    Probe,
    by_label,
    cpu_seconds,
    delta,
    percentile,
    scrape,
    summarize,
)
from scale_sim import Fleet, NoWorkers

from understudy.common import config as config_mod
from understudy.common import logs
from understudy.common.errors import StoreError
from understudy.common.keys import Keys
from understudy.common.records import (
    Assignment,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    NodeRecord,
    RegistryEntry,
)
from understudy.common.states import NodeState
from understudy.common.store import EtcdStore, WatchEvent
from understudy.daemon.controller import Controller
from understudy.daemon.events import EventLog
from understudy.daemon.jobs import JobRunner
from understudy.daemon.metrics import Metrics
from understudy.daemon.node import NodeAgent
from understudy.daemon.planner import plan
from understudy.daemon.supervisor import ChildExit, Supervisor
from understudy.testing.embedded_etcd import EmbeddedEtcd, EtcdStartError

PREFIX = "/understudy"
CONTROLLER = "zz-controller"  # sorts last: never picked as a job's standby before the spares
#: one rank per node: the planner pairs each lost rank with its own standby node (a standby
#: node warms one rank per job), so an 8-rank node would need 8 standbys per job
SLOTS = 1
#: design target: node failure to committed plan, p99, at 4,096 nodes (failure = lease gone)
TARGET_P99_S = 0.5


# -- the observer: a separate process, so its timestamps do not wait on the simulator -------


async def observe(endpoint: str, prefix: str) -> None:
    """Print one JSON line per change under nodes/, registry/ and jobs/ (wall time first)."""
    store = harness.etcd_store(endpoint, prefix)
    keys = Keys(prefix)
    stop = asyncio.Event()
    rev = await store.current_revision()

    async def watch(p: str) -> None:
        async for ev in store.watch_prefix(p, rev + 1, stop):
            t = time.time()
            if not isinstance(ev, WatchEvent):
                print(json.dumps({"t": t, "resync": p}), flush=True)
                continue
            line: dict[str, Any] = {"t": t, "kind": ev.kind, "key": ev.kv.key,
                                    "rev": ev.kv.mod_revision}
            if ev.kind == "put" and p == keys.registry:
                line["state"] = json.loads(ev.kv.value).get("state")
            elif ev.kind == "put" and p == keys.jobs:
                if ev.kv.key.endswith("/migration"):
                    m = Migration.decode(ev.kv.value)
                    line.update(phase=str(m.phase), id=m.id, leavers=list(m.leavers),
                                joiners=list(m.joiners), ranks=list(m.ranks),
                                created_at=m.created_at)
                elif ev.kv.key.endswith("/assignment"):
                    a = Assignment.decode(ev.kv.value)
                    line.update(epoch=a.epoch, standbys=list(a.standbys), ranks=list(a.ranks))
            print(json.dumps(line), flush=True)

    print(json.dumps({"t": time.time(), "ready": rev}), flush=True)
    await asyncio.gather(*(watch(p) for p in (keys.nodes, keys.registry, keys.jobs)))


class Observer:
    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.events: list[dict[str, Any]] = []
        self._new = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, endpoint: str) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--observe", endpoint,
            stdout=asyncio.subprocess.PIPE, limit=16 * MIB, start_new_session=True)
        self._reader = asyncio.create_task(self._read(), name="observer-read")
        await self.wait(lambda e: "ready" in e, 30, "the observer to start")

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.events.append(json.loads(line))
            self._new.set()

    async def wait(self, pred: Any, timeout: float, what: str, since: int = 0
                   ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        i = since
        while True:
            while i < len(self.events):
                if pred(self.events[i]):
                    return self.events[i]
                i += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchmarkError(f"timed out after {timeout:.0f}s waiting for {what}")
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), left)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


# -- measuring --------------------------------------------------------------------------------


class Meters:
    """Counters read at the start and end of a window: etcd's RPCs and stream messages, the
    CPU of the controller, etcd and this process, the machine's busy time."""

    def __init__(self, etcd: EmbeddedEtcd, controller_pid: int, fleet: Fleet) -> None:
        assert etcd.proc is not None
        self.etcd = etcd
        self.procs = {"controller": psutil.Process(controller_pid),
                      "etcd": psutil.Process(etcd.proc.pid), "simulator": psutil.Process()}
        self.senders = [psutil.Process(pid) for pid in fleet.keepalives.pids]
        self.fleet = fleet

    def read(self) -> dict[str, Any]:
        m = scrape(self.etcd.metrics_url)
        return {
            "t": time.monotonic(),
            "handled": by_label(m, "grpc_server_handled_total", "grpc_method"),
            "received": by_label(m, "grpc_server_msg_received_total", "grpc_method"),
            "sent": by_label(m, "grpc_server_msg_sent_total", "grpc_method"),
            "cpu": {**{k: cpu_seconds(p) for k, p in self.procs.items()},
                    "keepalive_senders": sum(cpu_seconds(p) for p in self.senders)},
            "machine": psutil.cpu_times(),
            "keepalives": self.fleet.keepalives.sent,
        }

    def window(self, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        dt = b["t"] - a["t"]
        handled = delta(b["handled"], a["handled"])
        received = delta(b["received"], a["received"])
        ma, mb = a["machine"], b["machine"]
        busy = (sum(mb) - mb.idle - mb.iowait) - (sum(ma) - ma.idle - ma.iowait)
        total = sum(mb) - sum(ma)
        return {
            "seconds": dt,
            "etcd_rpcs_per_s": sum(handled.values()) / dt,
            "etcd_rpcs_per_s_by_method": {k: v / dt for k, v in
                                          sorted(handled.items(), key=lambda kv: -kv[1])},
            "etcd_messages_per_s": sum(received.values()) / dt,
            "etcd_messages_per_s_by_method": {k: v / dt for k, v in
                                              sorted(received.items(), key=lambda kv: -kv[1])},
            "etcd_messages_sent_per_s": sum(delta(b["sent"], a["sent"]).values()) / dt,
            "cpu_percent_of_one_core": {k: 100.0 * (b["cpu"][k] - a["cpu"][k]) / dt
                                        for k in b["cpu"]},
            "machine_busy_percent": 100.0 * busy / total if total else 0.0,
            "keepalives_sent_per_s": (b["keepalives"] - a["keepalives"]) / dt,
        }

    def rss_mib(self) -> dict[str, float]:
        return {k: p.memory_info().rss / MIB for k, p in self.procs.items()}

    async def phase(self, a: dict[str, Any]) -> dict[str, Any]:
        """The window since ``a`` with the simulator's own health in it: its event loop's
        lag and its keep-alive senders' (``KeepAlives.stats``)."""
        b = await asyncio.to_thread(self.read)
        w = self.window(a, b)
        w["simulator_loop_lag_max_s"] = self.fleet.loop_lag.take()
        w["keepalive_senders"] = self.fleet.keepalives.window(a["t"], b["t"])
        w["loadavg_1m_after"] = os.getloadavg()[0]
        return w


async def time_controller_code(endpoint: str, reps: int) -> dict[str, Any]:
    """The controller's re-list and planning round on the cluster's etcd contents, in a
    process of its own (``--time-controller``): not slowed by the simulator's event loop, and
    never stalling its keep-alives."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), "--time-controller", endpoint,
        "--code-reps", str(reps), stdout=asyncio.subprocess.PIPE, limit=16 * MIB)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise BenchmarkError(f"timing the controller's code failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(out)
    return result


async def _time_controller_code(endpoint: str, reps: int) -> dict[str, Any]:
    cfg = config_mod.load(overrides={"node": "probe", "etcd.endpoints": endpoint,
                                     "etcd.prefix": PREFIX}, environ={})
    store = EtcdStore(cfg.etcd)
    metrics, stop = Metrics(), asyncio.Event()
    events = EventLog(store, Keys(PREFIX), "probe", metrics)
    agent = NodeAgent(cfg, store, metrics, events, NoWorkers(), stop)
    ctl = Controller(agent, store, metrics, events, stop)
    relist, view_s, plan_s, actions = [], [], [], []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            await ctl._relist()
            t1 = time.perf_counter()
            view = ctl._view()
            t2 = time.perf_counter()
            acts = plan(view, time.time())
            t3 = time.perf_counter()
            relist.append(t1 - t0)
            view_s.append(t2 - t1)
            plan_s.append(t3 - t2)
            actions.append(len(acts))
        # A node's job runner makes its view of the jobs from its listing at each reconcile
        # (every change under jobs/, and every 5 s): every record decoded, as before git
        # 3346f06, against only those that changed since the last view (here: none).
        async def on_exit(child: ChildExit) -> None:
            pass

        with tempfile.TemporaryDirectory() as run_dir:
            runner = JobRunner(agent, store, Supervisor(Path(run_dir), on_exit), stop)
            kvs, _ = await store.get_prefix(ctl.keys.jobs)
            every, changed = [], []
            for _ in range(reps):
                runner._decoded = type(runner._decoded)()  # forgets every record
                t0 = time.perf_counter()
                runner._decode_jobs(kvs)
                t1 = time.perf_counter()
                runner._decode_jobs(kvs)
                t2 = time.perf_counter()
                every.append(t1 - t0)
                changed.append(t2 - t1)
        sizes = {}
        for name, p in (("nodes", ctl.keys.nodes), ("registry", ctl.keys.registry),
                        ("jobs", ctl.keys.jobs), ("events", ctl.keys.events)):
            kvs, _ = await store.get_prefix(p)
            sizes[name] = {"keys": len(kvs), "bytes": sum(len(kv.value) for kv in kvs)}
    finally:
        await store.close()
    return {"relist_s": summarize(relist), "view_s": summarize(view_s),
            "plan_s": summarize(plan_s), "actions_per_round": actions, "prefix_sizes": sizes,
            "job_runner_view_s": {"every_record_decoded": summarize(every),
                                  "changed_records_decoded": summarize(changed)}}


async def code_only_size(n: int, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """``--controller-code-only``: N nodes' and the jobs' records written straight to a fresh
    etcd, the controller's code timed on them."""
    lay = layout(n, args.job_nodes, args.job_standbys, args.max_jobs)
    etcd = EmbeddedEtcd(data_dir=base / "etcd")
    etcd.start()
    try:
        cfg = config_mod.load(overrides={"node": "writer", "etcd.endpoints": etcd.endpoint,
                                         "etcd.prefix": PREFIX}, environ={})
        store, k, now = EtcdStore(cfg.etcd), Keys(PREFIX), time.time()
        try:
            lease = await store.grant(3600)
            ops: list[tuple[Any, ...]] = []
            for i in range(n):
                name, active = f"sim-{i:05d}", i < lay["active"]
                state = NodeState.ACTIVE if active else NodeState.STANDBY
                rec = NodeRecord(name=name, incarnation=f"{i:012x}", lease=lease, state=state,
                                 role="active" if active else "standby", slots=SLOTS,
                                 addresses=(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}",),
                                 version="0.1.0", started_at=now, registered_at=now,
                                 state_since=now, probe=f"10.0.0.1:{7000 + i % 1000}")
                entry = RegistryEntry(name=name, incarnation=rec.incarnation, state=state,
                                      updated_at=now)
                ops += [("put", k.node(name), rec.encode(), lease),
                        ("put", k.registry_entry(name), entry.encode(), None)]
            for j in range(lay["jobs"]):
                job, first = f"job-{j:03d}", j * args.job_nodes
                spare = lay["active"] + j * args.job_standbys
                spec = JobSpec(name=job, argv=("python", "train.py"), cwd="/", tp=1,
                               dp=args.job_nodes, standby=args.job_standbys, created_at=now)
                a = Assignment(job=job, epoch=1, reason="initial placement", updated_at=now,
                               ranks=tuple(f"sim-{first + r:05d}" for r in range(spec.dp)),
                               standbys=tuple(f"sim-{spare + s:05d}"
                                              for s in range(spec.standby)))
                status = JobStatus(job=job, state=JobState.RUNNING, reason="placed",
                                   updated_at=now)
                ops += [("put", k.job_spec(job), spec.encode(), None),
                        ("put", k.job_assignment(job), a.encode(), None),
                        ("put", k.job_status(job), status.encode(), None)]
            for i in range(0, len(ops), 100):  # etcd's --max-txn-ops: 128
                await store.txn(compare=[], success=ops[i:i + 100])
        finally:
            await store.close()
        code = await time_controller_code(etcd.endpoint, args.code_reps)
    finally:
        etcd.stop()
    print(f"[{n} nodes] controller code: relist {code['relist_s']['median'] * 1e3:.1f} ms, "
          f"view {code['view_s']['median'] * 1e3:.2f} ms, plan "
          f"{code['plan_s']['median'] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    return {"nodes": n, "layout": {**lay, "job_nodes": args.job_nodes,
                                   "job_standbys": args.job_standbys, "slots": SLOTS},
            "controller_code": code, "failovers": [], "broke": None}


# -- one cluster size -------------------------------------------------------------------------


def layout(n: int, job_nodes: int, job_standbys: int, max_jobs: int) -> dict[str, Any]:
    """Jobs of ``job_nodes`` active nodes (+ standbys) fill ~85 % of the nodes; the rest are
    spare standbys that refill a job's pool after each recovery."""
    jobs = max(1, min(max_jobs, int(n * 0.85) // (job_nodes + job_standbys)))
    active = jobs * job_nodes
    standby = n - active
    if standby < jobs * job_standbys + 2:
        raise BenchmarkError(f"{n} nodes cannot hold {jobs} jobs of {job_nodes}+{job_standbys}")
    return {"jobs": jobs, "active": active, "standby": standby}


async def run_size(n: int, args: argparse.Namespace, base: Path, rng: random.Random
                   ) -> dict[str, Any]:
    lay = layout(n, args.job_nodes, args.job_standbys, args.max_jobs)
    log = lambda msg: print(f"[{n} nodes] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    with harness.local_cluster(base, args.ttl, nodes="daemons") as (etcd, cluster):
        observer = Observer()
        fleet: Fleet | None = None
        probe: Probe | None = None
        try:
            probe = Probe(etcd.endpoint, PREFIX)
            daemon = cluster.add(CONTROLLER, "standby")
            t0 = time.monotonic()
            while await _safe(probe.controller()) != CONTROLLER:
                if time.monotonic() - t0 > 30 or not daemon.alive():
                    raise BenchmarkError("the real daemon did not become the controller")
                await asyncio.sleep(0.05)
            await observer.start(etcd.endpoint)
            fleet = Fleet(etcd.endpoint, PREFIX, args.ttl, args.keepalive_interval,
                          channels=args.channels, keepalive_streams=args.keepalive_streams,
                          keepalive_procs=args.keepalive_procs,
                          daemon_traffic=args.daemon_traffic, seed=args.seed)
            await fleet.start()
            meters = Meters(etcd, daemon.pid, fleet)
            names = [(f"sim-{i:05d}", "active" if i < lay["active"] else "standby",
                      SLOTS if i < lay["active"] else 1) for i in range(n)]
            m0 = await asyncio.to_thread(meters.read)
            fleet.loop_lag.take()
            await fleet.add(names, concurrency=args.join_concurrency)
            join = await meters.phase(m0)
            join["register_s"] = {**summarize(fleet.register_s),
                                  "p99": percentile(fleet.register_s, 99)}
            join_s = join["seconds"]
            log(f"{n} simulated nodes joined in {join_s:.1f}s (registration p99 "
                f"{join['register_s']['p99']:.2f}s, max {join['register_s']['max']:.2f}s); "
                f"{health(join)}; placing {lay['jobs']} jobs")
            m0 = await asyncio.to_thread(meters.read)
            try:
                jobs = await submit_jobs(probe.store, observer, lay["jobs"], args)
            except BenchmarkError as exc:
                # Placement is part of what may break at a size: record it, go on to the next.
                place = await meters.phase(m0)
                log(f"broke while placing jobs: {exc}; {health(place)}")
                return {"nodes": n, "layout": lay, "join_s": join_s, "failovers": [],
                        "broke": f"while placing jobs: {exc}",
                        "phases": {"join": join, "place_jobs": place},
                        "expired_keepalive_acks": fleet.expired_acks,
                        "keepalive_sender_late_s": fleet.keepalives.late_s,
                        "unexpected_failed_nodes": sorted(
                            {e["key"].rsplit("/", 1)[-1] for e in observer.events
                             if e.get("state") == "failed"}),
                        "controller_fenced": daemon.log_text().count("Node fenced itself")}
            place = await meters.phase(m0)
            place_s = place["seconds"]
            log(f"{lay['jobs']} jobs placed in {place_s:.1f}s; {health(place)}; settling "
                f"{args.settle_seconds:.0f}s")
            m0 = await asyncio.to_thread(meters.read)
            await asyncio.sleep(args.settle_seconds)
            settle = await meters.phase(m0)
            out: dict[str, Any] = {
                "nodes": n, "layout": {**lay, "job_nodes": args.job_nodes,
                                       "job_standbys": args.job_standbys, "slots": SLOTS},
                "join_s": join_s, "place_jobs_s": place_s, "failovers": [], "broke": None,
                "phases": {"join": join, "place_jobs": place, "settle": settle}}
            try:
                await measure(out, n, meters, fleet, observer, probe.store, jobs, etcd, args, rng,
                              log)
            except (BenchmarkError, StoreError) as exc:
                # A size the machine cannot hold is a result: say where and how it broke (a request
                # of this process's own that times out is a way of breaking too: its event loop
                # serves the simulated nodes).
                out["broke"] = str(exc)
                log(f"broke: {exc}")
            victims = {keys_registry(f["victim"]) for f in out["failovers"]}
            out["unexpected_failed_nodes"] = sorted(
                {e["key"].rsplit("/", 1)[-1] for e in observer.events
                 if e.get("state") == "failed" and e["key"] not in victims})
            out["controller_fenced"] = daemon.log_text().count("Node fenced itself")
            out["controller_log_tracebacks"] = daemon.log_text().count("Traceback")
            out["expired_keepalive_acks"] = fleet.expired_acks
            out["keepalive_sender_late_s"] = fleet.keepalives.late_s
            if out["failovers"]:
                out["failover_summary"] = summarize_failovers(out["failovers"])
            return out
        finally:
            await observer.close()
            if fleet is not None:
                await fleet.close()
            if probe is not None:
                await probe.close()


def health(w: dict[str, Any]) -> str:
    """One line on the simulator's health in a window (``Meters.phase``)."""
    ka = w["keepalive_senders"]
    cpu = w["cpu_percent_of_one_core"]
    return (f"keep-alive gap max {ka.get('send_gap_s', 0):.2f}s, oldest ack "
            f"{ka.get('oldest_ack_s', 0):.2f}s, reply max {ka.get('reply_s', 0):.2f}s, sender "
            f"loop lag {ka.get('loop_lag_s', 0) * 1e3:.0f} ms, simulator loop lag "
            f"{w['simulator_loop_lag_max_s'] * 1e3:.0f} ms; CPU% ctl {cpu['controller']:.0f} "
            f"etcd {cpu['etcd']:.0f} sim {cpu['simulator']:.0f} senders "
            f"{cpu['keepalive_senders']:.0f}, machine {w['machine_busy_percent']:.0f}% busy")


def keys_registry(node: str) -> str:
    return Keys(PREFIX).registry_entry(node)


async def measure(out: dict[str, Any], n: int, meters: Meters, fleet: Fleet,
                  observer: Observer, store: EtcdStore, jobs: list[str], etcd: EmbeddedEtcd,
                  args: argparse.Namespace, rng: random.Random, log: Any) -> None:
    if fleet.expired_acks or fleet.keepalives.late_s > args.ttl:
        raise BenchmarkError(f"simulated nodes lost their leases before the measurements "
                             f"(keep-alive sender {fleet.keepalives.late_s:.1f}s late)")
    a = await asyncio.to_thread(meters.read)
    await asyncio.sleep(args.steady_seconds)
    steady = await meters.phase(a)
    steady["rss_mib"] = meters.rss_mib()
    steady["keepalive_sender_late_s"] = fleet.keepalives.late_s
    steady["loadavg_1m_after"] = os.getloadavg()[0]
    out["steady"] = steady
    log(f"steady: {steady['etcd_rpcs_per_s']:.0f} RPC/s, "
        f"{steady['etcd_messages_per_s']:.0f} msgs/s; controller "
        f"{steady['cpu_percent_of_one_core']['controller']:.1f}% CPU, "
        f"{steady['rss_mib']['controller']:.0f} MiB; etcd "
        f"{steady['cpu_percent_of_one_core']['etcd']:.0f}%, simulator "
        f"{steady['cpu_percent_of_one_core']['simulator']:.0f}%, machine "
        f"{steady['machine_busy_percent']:.0f}% busy; {health(steady)}")
    code = await time_controller_code(etcd.endpoint, args.code_reps)
    out["controller_code"] = code
    view = code["job_runner_view_s"]
    log(f"controller code: relist {code['relist_s']['median'] * 1e3:.0f} ms, plan "
        f"{code['plan_s']['median'] * 1e3:.1f} ms; a job runner's view of "
        f"{code['prefix_sizes']['jobs']['keys']} keys under jobs/: "
        f"{view['every_record_decoded']['median'] * 1e3:.2f} ms decoding every record, "
        f"{view['changed_records_decoded']['median'] * 1e3:.2f} ms decoding what changed")
    for i in range(args.repeats):
        f = await failover(i, fleet, observer, store, jobs, meters, args, rng)
        out["failovers"].append(f)
        log(f"failover {i + 1}/{args.repeats}: lease gone -> plan "
            f"{f['lease_gone_to_plan_s'] * 1e3:.0f} ms, stop -> plan "
            f"{f['stop_to_plan_s']:.2f}s")
    out["rss_mib_end"] = meters.rss_mib()


async def _safe(coro: Any) -> Any:
    try:
        return await coro
    except StoreError:
        return None


async def submit_jobs(store: EtcdStore, observer: Observer, count: int,
                      args: argparse.Namespace) -> list[str]:
    """Write each job's spec as ``understudy run`` does and wait until the controller placed
    it (one at a time: the planner places every pending job of a round against the same free
    slots)."""
    keys = Keys(PREFIX)
    names = []
    for j in range(count):
        name = f"job-{j:03d}"
        spec = JobSpec(name=name, argv=("true",), cwd="/", tp=1, dp=args.job_nodes * SLOTS,
                       standby=args.job_standbys, created_at=time.time(), created_by="scale")
        since = len(observer.events)
        await store.txn(compare=[("create", keys.job_spec(name), 0)],
                        success=[("put", keys.job_spec(name), spec.encode(), None)])
        key = keys.job_assignment(name)
        await observer.wait(lambda e, k=key: e.get("key") == k, 60,  # type: ignore[misc]
                            f"job {name} to be placed", since)
        names.append(name)
    return names


async def failover(i: int, fleet: Fleet, observer: Observer, store: EtcdStore,
                   jobs: list[str], meters: Meters, args: argparse.Namespace,
                   rng: random.Random) -> dict[str, Any]:
    keys = Keys(PREFIX)
    job = jobs[i % len(jobs)]
    kv = await store.get(keys.job_assignment(job))
    assert kv is not None
    a = Assignment.decode(kv.value)
    holders = sorted({n for n in a.ranks if n in fleet.nodes and fleet.nodes[n].alive})
    victim = rng.choice(holders)
    ranks = a.ranks_on(victim)
    # Land the crash at a random point of the keep-alive cycle.
    await asyncio.sleep(rng.uniform(0, args.keepalive_interval))
    m0 = await asyncio.to_thread(meters.read)
    since = len(observer.events)
    t_stop_wall = time.time()
    t_stop, last_ack = await fleet.crash(victim)
    ack_age = t_stop - last_ack if last_ack is not None else None
    timeout = args.ttl + 30
    gone = await observer.wait(lambda e: e.get("key") == keys.node(victim)
                               and e.get("kind") == "delete", timeout,
                               f"{victim}'s lease to expire", since)
    failed = await observer.wait(lambda e: e.get("key") == keys.registry_entry(victim)
                                 and e.get("state") == "failed", timeout,
                                 f"{victim} to be marked failed", since)
    planned = await observer.wait(lambda e: e.get("key") == keys.job_migration(job)
                                  and e.get("phase") == "planned"
                                  and victim in e.get("leavers", []), timeout,
                                  f"the recovery plan of {job}", since)
    m1 = await asyncio.to_thread(meters.read)
    # The workers' part: joiners bound, then took over; the controller commits the recovery.
    prog = keys.kv(f"{job}/migration/{planned['id']}")
    for r in planned["ranks"]:
        await store.put(prog + f"bound/{r}", b"ok")
    await observer.wait(lambda e: e.get("key") == keys.job_migration(job)
                        and e.get("id") == planned["id"] and e.get("phase") == "preparing",
                        timeout, "the recovery to be preparing", since)
    for r in planned["ranks"]:
        await store.put(prog + f"switched/{r}", b"ok")
    done = await observer.wait(lambda e: e.get("key") == keys.job_migration(job)
                               and e.get("id") == planned["id"] and e.get("phase") == "done",
                               timeout, "the recovery to be committed", since)
    for joiner in set(planned["joiners"]):
        await fleet.set_state(joiner, NodeState.ACTIVE, f"holds a rank of job {job}")
    refilled = await observer.wait(
        lambda e: e.get("key") == keys.job_assignment(job) and victim not in e.get("ranks", [])
        and len(e.get("standbys", [])) >= args.job_standbys, timeout,
        f"{job}'s standby pool to be refilled", since)
    await fleet.restart(victim)
    # A former standby that took a rank rejoins in its configured role, like a restarted daemon.
    role = fleet.nodes[victim].agent.cfg.role
    await observer.wait(lambda e: e.get("key") == keys.registry_entry(victim)
                        and e.get("state") == role, timeout, f"{victim} to rejoin", since)
    m2 = await asyncio.to_thread(meters.read)
    return {
        "repeat": i, "job": job, "victim": victim, "ranks": ranks,
        "joiners": planned["joiners"],
        "last_keepalive_age_at_stop_s": ack_age,
        "stop_to_lease_gone_s": gone["t"] - t_stop_wall,
        "lease_gone_to_failed_s": failed["t"] - gone["t"],
        "lease_gone_to_plan_s": planned["t"] - gone["t"],
        "stop_to_plan_s": planned["t"] - t_stop_wall,
        "plan_to_refilled_s": refilled["t"] - planned["t"],
        "plan_to_done_s": done["t"] - planned["t"],
        "window_stop_to_plan": meters.window(m0, m1),
        "window_plan_to_rejoined": meters.window(m1, m2),
        "keepalive_senders": fleet.keepalives.window(m0["t"], m2["t"]),
    }


def summarize_failovers(fs: list[dict[str, Any]]) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float]:
        vals = [f[key] for f in fs]
        return {**summarize(vals), "p50": percentile(vals, 50), "p99": percentile(vals, 99)}

    def win(key: str, fig: str) -> dict[str, float]:
        return summarize([f[key][fig] for f in fs])

    return {
        "lease_gone_to_plan_s": stat("lease_gone_to_plan_s"),
        "lease_gone_to_failed_s": stat("lease_gone_to_failed_s"),
        "stop_to_plan_s": stat("stop_to_plan_s"),
        "stop_to_lease_gone_s": stat("stop_to_lease_gone_s"),
        "plan_to_done_s": stat("plan_to_done_s"),
        "etcd_rpcs_per_s_stop_to_plan": win("window_stop_to_plan", "etcd_rpcs_per_s"),
        "etcd_messages_per_s_stop_to_plan": win("window_stop_to_plan", "etcd_messages_per_s"),
        "etcd_rpcs_per_s_plan_to_rejoined": win("window_plan_to_rejoined", "etcd_rpcs_per_s"),
        "controller_cpu_percent_stop_to_plan": summarize(
            [f["window_stop_to_plan"]["cpu_percent_of_one_core"]["controller"] for f in fs]),
        "controller_cpu_percent_plan_to_rejoined": summarize(
            [f["window_plan_to_rejoined"]["cpu_percent_of_one_core"]["controller"]
             for f in fs]),
        "target_p99_s": TARGET_P99_S,
    }


# -- the report -------------------------------------------------------------------------------


def print_summary(result: dict[str, Any]) -> None:
    cfg = result["config"]
    if cfg["controller_code_only"]:
        print(f"\ncontroller code on N nodes' records written to etcd (no fleet), median of "
              f"{cfg['code_reps']}; {result['machine']['cpus_usable']} CPUs")
        print(f"\n  {'nodes':>6}{'jobs':>6}{'relist ms':>11}{'view ms':>9}{'plan ms':>9}"
              f"{'job runner view ms':>20}")
        for s in result["sizes"]:
            code = s["controller_code"]
            view = code["job_runner_view_s"]["changed_records_decoded"]
            print(f"  {s['nodes']:>6}{s['layout']['jobs']:>6}"
                  f"{code['relist_s']['median'] * 1e3:>11.1f}"
                  f"{code['view_s']['median'] * 1e3:>9.2f}{code['plan_s']['median'] * 1e3:>9.2f}"
                  f"{view['median'] * 1e3:>20.2f}")
        return
    print(f"\ncontrol plane at scale: lease TTL {cfg['ttl']}s, keep-alive every "
          f"{cfg['keepalive_interval']}s, {cfg['repeats']} failovers per size, daemon traffic "
          f"{'simulated' if cfg['daemon_traffic'] else 'off (keep-alives only)'}; "
          f"{result['machine']['cpus_usable']} CPUs")
    print(f"\n  {'nodes':>6}{'jobs':>6}{'RPC/s':>9}{'msg/s':>9}{'ctl CPU%':>9}{'ctl MiB':>9}"
          f"{'etcd CPU%':>10}{'sim CPU%':>9}{'relist ms':>10}{'plan ms':>9}"
          f"{'gone->plan p50':>16}{'p99':>8}{'max':>8}{'stop->plan p50':>16}")
    full = [s for s in result["sizes"] if "failover_summary" in s and "controller_code" in s]
    for s in full:
        st, fo, code = s["steady"], s["failover_summary"], s["controller_code"]
        cpu = st["cpu_percent_of_one_core"]
        print(f"  {s['nodes']:>6}{s['layout']['jobs']:>6}{st['etcd_rpcs_per_s']:>9.0f}"
              f"{st['etcd_messages_per_s']:>9.0f}{cpu['controller']:>9.1f}"
              f"{st['rss_mib']['controller']:>9.1f}{cpu['etcd']:>10.1f}{cpu['simulator']:>9.1f}"
              f"{code['relist_s']['median'] * 1e3:>10.1f}{code['plan_s']['median'] * 1e3:>9.2f}"
              f"{fo['lease_gone_to_plan_s']['p50'] * 1e3:>13.0f} ms"
              f"{fo['lease_gone_to_plan_s']['p99'] * 1e3:>5.0f} ms"
              f"{fo['lease_gone_to_plan_s']['max'] * 1e3:>5.0f} ms"
              f"{fo['stop_to_plan_s']['p50']:>15.2f}s")
    print("\n  failover windows (median over repeats): etcd RPC/s stop->plan, plan->rejoined; "
          "controller CPU% in them")
    for s in full:
        fo = s["failover_summary"]
        print(f"  {s['nodes']:>6}{fo['etcd_rpcs_per_s_stop_to_plan']['median']:>9.0f}"
              f"{fo['etcd_rpcs_per_s_plan_to_rejoined']['median']:>9.0f}"
              f"{fo['controller_cpu_percent_stop_to_plan']['median']:>9.1f}"
              f"{fo['controller_cpu_percent_plan_to_rejoined']['median']:>9.1f}")
    for s in result["sizes"]:
        if s.get("broke"):
            print(f"\n  {s['nodes']} nodes BROKE after {len(s['failovers'])} failovers: "
                  f"{s['broke']}")
        if s.get("unexpected_failed_nodes"):
            print(f"  {s['nodes']} nodes: {len(s['unexpected_failed_nodes'])} nodes marked "
                  f"failed that were not crashed; controller fenced itself "
                  f"{s['controller_fenced']} times")
    print(f"\n  machine load average (1 min): before {result['loadavg_before'][0]:.2f}, after "
          f"{result['loadavg_after'][0]:.2f}")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = harness.pyplot()
    sizes = [s for s in result["sizes"] if "failover_summary" in s and "controller_code" in s]
    if not sizes:
        return
    ns = [s["nodes"] for s in sizes]
    fig, ax = plt.subplots(2, 2, figsize=(10, 7.5))
    fo = [s["failover_summary"]["lease_gone_to_plan_s"] for s in sizes]
    a = ax[0][0]
    a.plot(ns, [f["p50"] * 1e3 for f in fo], "o-", label="p50")
    a.plot(ns, [f["p99"] * 1e3 for f in fo], "s-", label="p99")
    for s in sizes:
        a.scatter([s["nodes"]] * len(s["failovers"]),
                  [f["lease_gone_to_plan_s"] * 1e3 for f in s["failovers"]], s=8, c="grey",
                  alpha=0.5)
    a.axhline(TARGET_P99_S * 1e3, ls="--", c="red", label="target p99")
    a.set(title="lease gone -> recovery plan in etcd", ylabel="ms")
    a.legend()
    a = ax[0][1]
    st = [s["steady"] for s in sizes]
    a.plot(ns, [x["etcd_rpcs_per_s"] for x in st], "o-", label="RPCs handled/s (steady)")
    a.plot(ns, [x["etcd_messages_per_s"] for x in st], "s-", label="messages received/s (steady)")
    a.plot(ns, [s["failover_summary"]["etcd_rpcs_per_s_plan_to_rejoined"]["median"]
                for s in sizes], "^-", label="RPCs/s, plan -> rejoined")
    a.set(title="etcd load", ylabel="per second")
    a.legend(fontsize=8)
    a = ax[1][0]
    for who in ("controller", "etcd", "simulator"):
        a.plot(ns, [x["cpu_percent_of_one_core"][who] for x in st], "o-", label=who)
    a.set(title="CPU in the steady window", ylabel="% of one core")
    a.legend(fontsize=8)
    a = ax[1][1]
    a.plot(ns, [s["controller_code"]["relist_s"]["median"] * 1e3 for s in sizes], "o-",
           label="full re-list (every 10 s)")
    a.plot(ns, [s["controller_code"]["plan_s"]["median"] * 1e3 for s in sizes], "s-",
           label="planning round (every change, every 1 s)")
    a2 = a.twinx()
    a2.plot(ns, [x["rss_mib"]["controller"] for x in st], "^:", c="grey",
            label="controller RSS (MiB)")
    a2.set_ylabel("MiB")
    a.set(title="controller code, timed on the same etcd", ylabel="ms")
    a.legend(fontsize=8, loc="upper left")
    a2.legend(fontsize=8, loc="lower right")
    for row in ax:
        for a in row:
            a.set_xscale("log", base=2)
            a.set_xlabel("simulated nodes")
            a.grid(alpha=0.3)
    fig.suptitle(f"understudy control plane at scale (TTL {result['config']['ttl']} s, "
                 f"{result['machine']['cpus_usable']} CPUs shared)")
    harness.save_chart(fig, path, dpi=100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("scale", __doc__.splitlines()[0])
    p.add_argument("--nodes", help="comma-separated cluster sizes (default 256,1024,4096; "
                   "smoke 24)")
    p.add_argument("--repeats", type=int, help="failovers per size (default 20; smoke 2)")
    p.add_argument("--ttl", type=int, default=3, help="lease TTL in seconds (default 3)")
    p.add_argument("--keepalive-interval", type=float,
                   help="seconds between a simulated node's keep-alives (default TTL/3, the "
                   "longest the daemon's configuration allows; the daemon's default is 0.5)")
    p.add_argument("--steady-seconds", type=float, help="steady window (default 30; smoke 2)")
    p.add_argument("--settle-seconds", type=float,
                   help="wait after the jobs are placed (default 15; smoke 1)")
    p.add_argument("--job-nodes", type=int, help="active nodes (ranks) per job "
                   "(default 32; smoke 4)")
    p.add_argument("--job-standbys", type=int, default=2, help="standbys per job (default 2)")
    p.add_argument("--max-jobs", type=int, default=1000, help="at most this many jobs")
    p.add_argument("--daemon-traffic", action="store_true",
                   help="simulated nodes also send a daemon's periodic reads, campaigns and "
                        "watches (scale_sim.py)")
    p.add_argument("--channels", type=int, default=16,
                   help="etcd connections of the simulator (default 16: a request that times "
                        "out resets its connection and cuts off the others on it)")
    p.add_argument("--join-concurrency", type=int, default=16,
                   help="simulated nodes registering at once (default 16)")
    p.add_argument("--keepalive-streams", type=int, default=64,
                   help="LeaseKeepAlive streams of each keep-alive sender (default 64: a "
                        "stream stalls while etcd revokes one of its leases; scale_sim.py)")
    p.add_argument("--keepalive-procs", type=int, default=2,
                   help="keep-alive sender processes (default 2; 0: on the simulator's own "
                        "event loop, as the first 4,096-node run did)")
    p.add_argument("--code-reps", type=int, default=5,
                   help="timed runs of the controller's re-list and planning round")
    p.add_argument("--controller-code-only", action="store_true",
                   help="no simulated fleet: write the nodes' and jobs' records straight to "
                        "etcd and time the controller's code on them (seconds at any size)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: for the tests")
    p.outputs(keep="keep etcd data and daemon logs here", chart="chart")
    p.add_argument("--observe", metavar="ENDPOINT", help=argparse.SUPPRESS)
    p.add_argument("--time-controller", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = p.parse(argv, {"nodes": ("256,1024,4096", "24"), "repeats": (20, 2),
                          "steady_seconds": (30.0, 2.0), "settle_seconds": (15.0, 1.0),
                          "job_nodes": (32, 4)})
    args.nodes = [int(x) for x in str(args.nodes).split(",")]
    if args.keepalive_interval is None:
        args.keepalive_interval = args.ttl / 3
    if args.repeats < 1 or min(args.nodes) < 8:
        p.error("--repeats must be >= 1 and every size >= 8 nodes")
    if args.ttl < 3:
        p.error("--ttl must be at least 3 (the daemon's etcd timeout must be <= TTL/3)")
    if not 0 < args.keepalive_interval <= args.ttl / 3:
        p.error(f"--keepalive-interval must be in (0, TTL/3 = {args.ttl / 3:.2f}]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.observe:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(observe(args.observe, PREFIX))
        return 0
    if args.time_controller:
        logs.configure("warning", "console")
        print(json.dumps(asyncio.run(_time_controller_code(args.time_controller,
                                                           args.code_reps))))
        return 0
    # The simulated nodes' agents log like daemons: only their warnings are of interest here.
    logs.configure("warning", "console")
    scratch = harness.Scratch(args.keep_dir, "understudy-scale-")
    load_before = os.getloadavg()
    rng = random.Random(args.seed)
    size = code_only_size if args.controller_code_only else \
        lambda n, args, base: run_size(n, args, base, rng)
    sizes = scratch.run("scale benchmark",
                        (BenchmarkError, EtcdStartError, StoreError, OSError, psutil.Error),
                        lambda: [asyncio.run(size(n, args, scratch.base / f"n{n}"))
                                 for n in args.nodes])
    if isinstance(sizes, int):
        return sizes
    result = {
        **harness.header("scale", scratch.started),
        "config": {"nodes": args.nodes, "repeats": args.repeats, "ttl": args.ttl,
                   "keepalive_interval": args.keepalive_interval,
                   "steady_seconds": args.steady_seconds,
                   "settle_seconds": args.settle_seconds, "job_nodes": args.job_nodes,
                   "job_standbys": args.job_standbys, "daemon_traffic": args.daemon_traffic,
                   "channels": args.channels, "keepalive_streams": args.keepalive_streams,
                   "keepalive_procs": args.keepalive_procs,
                   "join_concurrency": args.join_concurrency,
                   "controller_code_only": args.controller_code_only,
                   "code_reps": args.code_reps, "seed": args.seed, "smoke": args.smoke},
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        "chart": str(args.png),
        "sizes": sizes,
    }
    print_summary(result)
    if args.controller_code_only:
        result["chart"] = None  # no failovers, no fleet: the table above is all there is
    else:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.png)
    harness.write_results(result, args.out)
    print(f"\nresults written to {args.out}" + (f", chart {args.png}" if result["chart"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
