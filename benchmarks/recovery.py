"""Recovery benchmark: end-to-end recovery from unexpected failures, and warm vs cold start.

One command, real processes. N times, each scenario on a fresh local cluster (an embedded etcd,
``node-a`` and ``node-b`` with two slots each, standby nodes ``node-s1`` and ``node-s2``; node-a
is started first so that it holds the controller): the plain-PyTorch example
(``examples/plain_torch/train.py``) runs TP=2 x DP=2 with two standbys under ``understudy run``,
once both standby workers are up (imports done, waiting to be chosen) and, unless
``--no-sandbox``, warm: the job is given a recording directory, ranks 0 and 1 record their first
iterations, and each standby builds the job for one rank on replay groups and runs shadow
iterations (node-s2 warms as rank 1, which the controller then gives it).

1. **Worker crash.** Once rank 1 has committed ``--crash-at`` steps (its runtime says so in the
   log every 50), its worker is killed with SIGKILL. End to end: the kill -> the last
   "First step after recovery" log line over all ranks (every rank has committed a step on the
   new groups). Split, each phase from the previous milestone: detection (-> the ``time`` of the
   rank's exit record in etcd, written by its daemon), planning (-> the controller's
   ``migration-planned`` event, emitted once the plan is in etcd), settle (-> the last
   survivor's "settled on step" line: the survivors saw the plan, aborted their step and agreed
   on the last committed step), rebuild+transfer (-> the last survivor's "Recovered from the
   loss" line: new group versions up, the joiner prepared and given the state), first step
   (-> the last "First step after recovery" line). Also: the donor's state transfer (its
   "Gave rank 1's joiner the state" line), the step the survivors were at when they aborted,
   the step the job settled on.
2. **Node loss.** Once every rank has committed ``--crash-at`` steps, ``node-b``'s daemon and its
   two workers are killed with SIGKILL at once (no clean leave, no exit record): the loss is
   detected by the node's lease expiring. The same split, with detection = the kill -> the
   controller's ``node-failed`` event.
3. **Warm standby vs cold start of the same rank.** Warm: the joiner of scenario 1, from its
   "Standby chosen to take over rank 1" line to its "First step after recovery" line (which
   includes waiting for the survivors), and to its "Took over rank 1" line. Cold: after the
   job of scenario 1 finished (and its cluster is stopped), the same job starts fresh as four
   standalone processes loading the run's final state (``--load``; ``--steps`` one more than the
   saved step, so exactly one step runs); per process, Popen -> its state saved after that step
   (the file's mtime), split into its imports (``python -X importtime``, in the same process:
   the interpreter's, torch, the example's, and ``torch._dynamo``, which the job's first
   optimizer imports lazily while it builds), the step itself (the process's saved timings),
   and the rest (interpreter start, the groups' rendezvous, the build, loading the state).
   Ratio: cold / warm.

Prints a summary and writes JSON with the machine, the command, the configuration and every
sample. Every process it starts is stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/recovery.py [--repeats N] [--steps S] [--smoke] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from control_plane import machine, rounded, summarize  # the sibling benchmarks' helpers
from migration import log_records, train_processes, wait, wall

from understudy.common import config as config_mod
from understudy.common.errors import RecordError, StoreError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.records import MigrationPhase, RankExit
from understudy.common.store import EtcdStore
from understudy.testing.embedded_etcd import EmbeddedEtcd, EtcdStartError
from understudy.testing.localcluster import DaemonProcess, LocalCluster

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "plain_torch" / "train.py"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "recovery.json"
# Smoke results are throwaway: *.tmp under benchmarks/results is git-ignored.
SMOKE_OUT = REPO / "benchmarks" / "results" / "recovery.smoke.tmp"
JOB = "mig"
WORLD, TP = 4, 2
ACTIVE, STANDBYS = ("node-a", "node-b"), ("node-s1", "node-s2")
VICTIM = 1  # the rank whose worker is killed (on node-a; its TP partner is rank 0)
LOST_NODE = "node-b"  # the node lost in scenario 2 (ranks 2 and 3)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: The runtime logs "N steps committed on rank R" every this many steps.
LOG_EVERY = 50
KEEPALIVE_INTERVAL = config_mod.LeaseConfig().keepalive_interval

FIRST_STEP = re.compile(r"First step after recovery (?P<id>\S+): step (?P<step>\d+) committed on "
                        r"rank (?P<rank>\d+)\.")
SETTLED = re.compile(r"Recovery (?P<id>\S+): settled on step (?P<step>\d+);")
RECOVERED = re.compile(r"Recovered from the loss of rank\(s\) \[(?P<ranks>[\d, ]*)\] at step "
                       r"(?P<step>\d+)")
GAVE = re.compile(r"Gave rank (?P<rank>\d+)'s joiner the state of step (?P<step>\d+): send "
                  r"(?P<bytes>\d+) B .*? in (?P<ms>[\d.]+) ms")
CHOSEN = re.compile(r"Standby chosen to take over rank (?P<rank>\d+)\.")
TOOK_OVER = re.compile(r"Took over rank (?P<rank>\d+): receive (?P<bytes>\d+) B .*? in "
                       r"(?P<ms>[\d.]+) ms")
ABORTED = re.compile(r"Step (?P<step>\d+) aborted:")
KILLED = re.compile(r"Worker (?P<child>\S+) \(pid (?P<pid>\d+)\) was killed by SIGKILL")
#: A line of ``python -X importtime``: microseconds, two spaces of indent per nesting level.
IMPORT_TIME = re.compile(r"^import time:\s+(?P<self>\d+) \|\s+(?P<cumulative>\d+) \| "
                         r"(?P<indent> *)(?P<module>\S+)\s*$")
#: Imported lazily by the job's first optimizer, while it builds.
LAZY = "torch._dynamo"


class BenchmarkError(UnderstudyError):
    """The benchmark could not measure what it set out to (no recovery, a failed job...)."""


@dataclass(frozen=True)
class BenchConfig:
    repeats: int
    steps: int
    step_sleep: float
    crash_at: int
    ttl: int
    smoke: bool
    #: standbys warm up in the sandbox (the job gets a recording directory)
    sandbox: bool = True
    #: the job logs a line per committed step under ``<out>/../steps`` (benchmarks/downtime.py)
    step_log: bool = False


# -- the cluster -------------------------------------------------------------------------------


def new_cluster(cfg: BenchConfig, base: Path) -> tuple[EmbeddedEtcd, LocalCluster]:
    """An etcd and a cluster, neither started yet (:func:`bring_up` does)."""
    etcd = EmbeddedEtcd(data_dir=base / "etcd")
    cluster = LocalCluster(etcd_endpoint="", base_dir=base / "nodes", lease_ttl=cfg.ttl)
    return etcd, cluster


def bring_up(etcd: EmbeddedEtcd, cluster: LocalCluster) -> None:
    """etcd and four daemons; node-a first, so that it holds the controller (node-b is lost in
    scenario 2, and losing the controller would add an election to the detection)."""
    etcd.start()
    cluster.etcd_endpoint = etcd.endpoint
    cluster.add("node-a", "active", extra=["--slots", "2"])
    cluster.wait_state("node-a", "active", timeout=60)
    cluster.wait_for("node-a to hold the controller", lambda s: s.controller == "node-a",
                     timeout=60)
    cluster.add("node-b", "active", extra=["--slots", "2"])
    for n in STANDBYS:
        cluster.add(n, "standby")
    cluster.wait_state("node-b", "active", timeout=60)
    for n in STANDBYS:
        cluster.wait_state(n, "standby", timeout=60)


def submit(cluster: LocalCluster, cfg: BenchConfig, out: Path) -> None:
    extra = dict(ONE_THREAD)
    if cfg.sandbox:
        extra["UNDERSTUDY_RECORDINGS"] = str(out.parent / "recordings")
    env = [f"--env={k}={v}" for k, v in extra.items()]
    step_log = ["--step-log", str(out.parent / "steps")] if cfg.step_log else []
    run = cluster.cli("run", "--job", JOB, "--tp", str(TP), "--dp", str(WORLD // TP),
                      "--standby", "2", *env, "--", sys.executable, str(TRAIN),
                      "--steps", str(cfg.steps), "--step-sleep", str(cfg.step_sleep),
                      "--save", str(out), *step_log)
    if run.returncode != 0:
        raise BenchmarkError(f"understudy run failed: {run.stderr.strip()}")
    # Both standby workers have imported the job (torch included) and wait: they are warm.
    wait("both standby workers to come up", lambda: all(
        "waiting to be chosen" in cluster.daemons[n].log_text() for n in STANDBYS), timeout=240,
        interval=0.2)
    if cfg.sandbox:  # ... and built the job on the recording, shadow iterations run
        wait("both standby workers to warm up in their sandbox", lambda: all(
            "Standby is warm (" in cluster.daemons[n].log_text() for n in STANDBYS),
            timeout=240, interval=0.2)


def wait_log(d: DaemonProcess, text: str, timeout: float) -> float:
    return wait(f"{d.name} to log {text!r}", lambda: text in d.log_text(), timeout,
                interval=0.02)


def worker_pid(d: DaemonProcess, child: str) -> int:
    """The pid of the newest worker ``child`` (``mig.r1``) of daemon ``d``, from its log."""
    pids = [rec["pid"] for rec in log_records(d.log_text())
            if rec.get("child") == child and "started with pid" in str(rec.get("event", ""))]
    if not pids:
        raise BenchmarkError(f"{child} never started on {d.name}")
    return int(pids[-1])


def rank_nodes(cluster: LocalCluster) -> tuple[int, tuple[str, ...]]:
    """The job's epoch and the node of each rank."""
    job = cluster.status().job(JOB)
    if job is None or job.assignment is None:
        raise BenchmarkError("the job has no assignment")
    return job.assignment.epoch, tuple(job.assignment.ranks)


def finish(cluster: LocalCluster) -> dict[str, Any]:
    """Wait for the job to end; returns its recovery record (the job's last migration).

    Raises:
        BenchmarkError: the job failed, or there was no recovery.
    """
    cluster.wait_for("the job to finish", lambda s: (j := s.job(JOB)) is not None
                     and j.state in ("done", "failed"), timeout=900)
    job = cluster.status().job(JOB)
    if job is None or job.state != "done":
        raise BenchmarkError(f"the job did not finish: {job.status if job else 'gone'}")
    m = job.migration
    if m is None or m.kind != "recovery":
        raise BenchmarkError(f"the job's last migration is no recovery: {m}")
    return {"id": m.id, "phase": str(m.phase), "ranks": list(m.ranks),
            "joiners": list(m.joiners), "donors": list(m.donors), "reason": m.reason,
            "created_at": m.created_at,
            # Wall times of the phases entered (the record may hold other measurements too).
            "timings": {k: v for k, v in m.timings.items()
                        if k in set(MigrationPhase) and isinstance(v, int | float)}}


def read_exit(cluster: LocalCluster, epoch: int, rank: int) -> dict[str, Any] | None:
    """The rank's exit record in etcd, as its daemon wrote it; None if there is none."""
    async def read() -> dict[str, Any] | None:
        cfg = config_mod.load(overrides={"etcd.endpoints": cluster.etcd_endpoint,
                                         "etcd.prefix": cluster.prefix},
                              environ={}, require_node=False)
        store = EtcdStore(cfg.etcd)
        try:
            kv = await store.get(Keys(cluster.prefix).rank_exit(JOB, epoch, rank))
            return None if kv is None else asdict(RankExit.decode(kv.value))
        finally:
            await store.close()
    try:
        return asyncio.run(read())
    except RecordError as exc:
        raise BenchmarkError(f"rank {rank}'s exit record is unreadable: {exc}") from exc


def snapshot(cluster: LocalCluster) -> dict[str, Any]:
    events = [json.loads(line) for line in
              cluster.cli("events", "--json", "--limit", "0").stdout.splitlines()]
    logs = {n: log_records(d.log_text()) for n, d in cluster.daemons.items()}
    tracebacks = sum(d.log_text().count("Traceback") for d in cluster.daemons.values())
    return {"events": events, "logs": logs, "tracebacks": tracebacks}


def stop_cluster(etcd: EmbeddedEtcd, cluster: LocalCluster) -> None:
    """Stop the daemons, any worker they left behind (workers run in sessions of their own, out
    of reach of the daemon's process group), then etcd."""
    workers: list[psutil.Process] = []
    for d in cluster.daemons.values():
        if d.alive():
            with contextlib.suppress(psutil.Error):
                workers += psutil.Process(d.pid).children(recursive=True)
    cluster.stop_all(timeout=5)
    for p in workers:
        with contextlib.suppress(psutil.Error):
            if p.is_running():
                p.kill()
    psutil.wait_procs(workers, timeout=10)
    etcd.stop()


# -- what the processes left behind --------------------------------------------------------


def analyse(kill_at: float, detected_at: float, lost: tuple[int, ...], recovery: dict[str, Any],
            events: list[dict[str, Any]],
            logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One recovery's figures from its record, the events and the daemon logs (workers' lines
    included).

    "Planned" is the time of the ``migration-planned`` event, which the controller emits once
    the plan is in etcd (the workers can see it from then on). The planner decided a few
    milliseconds earlier (the record's ``timings["planned"]``, kept as ``planner_decided``): for
    a lost node in the same pass that declared the node failed, before the ``node-failed``
    event, so measured from that event the decision would come before the detection.

    Raises:
        BenchmarkError: a milestone is missing from the logs.
    """
    rid = recovery["id"]
    if sorted(recovery["ranks"]) != sorted(lost):
        raise BenchmarkError(f"recovery {rid} replaced ranks {recovery['ranks']}, not {lost}")
    survivors = tuple(r for r in range(WORLD) if r not in lost)
    settled: dict[int, tuple[float, int]] = {}
    recovered: dict[int, float] = {}
    first: dict[int, tuple[float, int]] = {}
    aborted: dict[int, int] = {}
    gave: dict[int, dict[str, Any]] = {}
    chosen: dict[int, tuple[float, str]] = {}
    took: dict[int, tuple[float, float]] = {}
    for node, records in logs.items():
        for rec in records:
            msg = str(rec.get("event", ""))
            try:
                at = wall(rec)
            except (KeyError, ValueError):
                continue
            if at < kill_at:
                continue
            rank = rec.get("rank")
            if (m := SETTLED.search(msg)) and m["id"] == rid and rank is not None:
                settled.setdefault(int(rank), (at, int(m["step"])))
            elif (m := RECOVERED.search(msg)) and rank is not None:
                recovered.setdefault(int(rank), at)
            elif (m := FIRST_STEP.search(msg)) and m["id"] == rid:
                first.setdefault(int(m["rank"]), (at, int(m["step"])))
            elif (m := ABORTED.search(msg)) and rank is not None:
                aborted.setdefault(int(rank), int(m["step"]))
            elif (m := GAVE.search(msg)) and rank is not None:
                gave[int(m["rank"])] = {"donor": int(rank), "step": int(m["step"]),
                                        "payload_bytes": int(m["bytes"]),
                                        "send_s": float(m["ms"]) / 1e3}
            elif (m := CHOSEN.search(msg)) and rec.get("migration", rid) == rid:
                chosen.setdefault(int(m["rank"]), (at, node))
            elif m := TOOK_OVER.search(msg):
                took.setdefault(int(m["rank"]), (at, float(m["ms"]) / 1e3))
    missing = [what for what, got, want in (
        ("'settled on step'", settled, survivors), ("'Recovered from the loss'", recovered,
                                                    survivors),
        ("'First step after recovery'", first, range(WORLD)),
        ("'Gave rank ... the state'", gave, lost), ("'Standby chosen'", chosen, lost),
        ("'Took over rank'", took, lost)) if set(got) != set(want)]
    if missing:
        raise BenchmarkError(f"recovery {rid}: log lines missing or for other ranks: "
                             f"{', '.join(missing)} (settled {sorted(settled)}, recovered "
                             f"{sorted(recovered)}, first step {sorted(first)}, gave "
                             f"{sorted(gave)}, chosen {sorted(chosen)}, took {sorted(took)})")
    decided_at = recovery["timings"].get("planned", recovery["created_at"])
    planned_at = next((e["time"] for e in events if e["kind"] == "migration-planned"
                       and e.get("details", {}).get("id") == rid), None)
    if planned_at is None:
        raise BenchmarkError(f"no migration-planned event for recovery {rid}")
    settled_at = max(t for t, _ in settled.values())
    recovered_at = max(recovered.values())
    first_at = max(t for t, _ in first.values())
    settled_steps = {s for _, s in settled.values()}
    for r in lost:
        gave[r]["joiner_receive_s"] = took[r][1]
    return {
        "recovery_id": rid,
        "lost_ranks": list(lost),
        "joiners": {str(r): chosen[r][1] for r in lost},
        "donors": {str(r): gave[r]["donor"] for r in lost},
        "end_to_end_s": first_at - kill_at,
        "phases_s": {
            "detection": detected_at - kill_at,
            "planning": planned_at - detected_at,
            "settle": settled_at - planned_at,
            "rebuild_transfer": recovered_at - settled_at,
            "first_step": first_at - recovered_at,
        },
        # Seconds after the kill; the recovery's own phase times (controller clock, wall).
        "milestones_s": {"detected": detected_at - kill_at,
                         "planner_decided": decided_at - kill_at,
                         "planned": planned_at - kill_at,
                         **{f"recovery_{k}": v - kill_at for k, v in
                            recovery["timings"].items()},
                         "settled": settled_at - kill_at, "recovered": recovered_at - kill_at,
                         "first_step": first_at - kill_at},
        "survivors": {str(r): {
            "aborted_at_step": aborted.get(r),
            "planned_to_settled_s": settled[r][0] - planned_at,
            "settled_to_recovered_s": recovered[r] - settled[r][0],
            "recovered_to_first_step_s": first[r][0] - recovered[r],
        } for r in survivors},
        "transfers": {str(r): gave[r] for r in lost},
        "joiner_timeline": {str(r): {
            "node": chosen[r][1],
            "planned_to_chosen_s": chosen[r][0] - planned_at,
            # Bound: the joiner built the job and told the daemon; with one joiner, the
            # recovery's "preparing" phase starts then.
            "chosen_to_preparing_s": recovery["timings"]["preparing"] - chosen[r][0]
            if "preparing" in recovery["timings"] else None,
            "chosen_to_took_over_s": took[r][0] - chosen[r][0],
            "chosen_to_first_step_s": first[r][0] - chosen[r][0],
        } for r in lost},
        # The survivors' committed steps when they aborted: the steps done before the failure.
        "steps_before_failure": max((aborted[r] for r in survivors if r in aborted),
                                    default=None),
        "settled_step": max(settled_steps),
        "settled_steps_agree": len(settled_steps) == 1,
        "first_step_after": min(s for _, s in first.values()),
    }


# -- the scenarios -------------------------------------------------------------------------


def worker_crash(cfg: BenchConfig, base: Path) -> dict[str, Any]:
    """Scenario 1 on a fresh cluster; the job's final state is left in ``base/out``."""
    etcd, cluster = new_cluster(cfg, base)
    out = base / "out"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        bring_up(etcd, cluster)
        submit(cluster, cfg, out)
        epoch, nodes = rank_nodes(cluster)
        d = cluster.daemons[nodes[VICTIM]]
        wait_log(d, f"{cfg.crash_at} steps committed on rank {VICTIM}", timeout=300)
        pid = worker_pid(d, f"{JOB}.r{VICTIM}")
        controller = cluster.status().controller
        kill_at = time.time()
        os.kill(pid, signal.SIGKILL)
        recovery = finish(cluster)
        exit_rec = read_exit(cluster, epoch, VICTIM)
        seen = snapshot(cluster)
    finally:
        stop_cluster(etcd, cluster)
    if exit_rec is None:
        raise BenchmarkError(f"rank {VICTIM}'s daemon wrote no exit record for epoch {epoch}")
    killed_line = next((wall(rec) for rec in seen["logs"][d.name]
                        if (m := KILLED.search(str(rec.get("event", "")))) and
                        int(m["pid"]) == pid), None)
    figures = analyse(kill_at, exit_rec["time"], (VICTIM,), recovery, seen["events"],
                      seen["logs"])
    return {"wall_s": time.monotonic() - t0, "controller": controller, "killed_pid": pid,
            "kill_at": kill_at,
            "exit_record": {k: exit_rec[k] for k in ("returncode", "failed", "description")},
            # The daemon's log line for the exit (logged just before it writes the record).
            "kill_to_exit_log_line_s": None if killed_line is None else killed_line - kill_at,
            "recovery": recovery, **figures,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"]}


def node_loss(cfg: BenchConfig, base: Path, silent: bool = False) -> dict[str, Any]:
    """Scenario 2 on a fresh cluster. ``silent``: the node's daemon and ranks are frozen
    (SIGSTOP) instead of killed: no process dies and no connection is closed, as when a
    machine loses power or its switch port, and they stay frozen to the end."""
    etcd, cluster = new_cluster(cfg, base)
    out = base / "out"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    frozen: list[int] = []
    try:
        bring_up(etcd, cluster)
        submit(cluster, cfg, out)
        _, nodes = rank_nodes(cluster)
        for r, n in enumerate(nodes):
            wait_log(cluster.daemons[n], f"{cfg.crash_at} steps committed on rank {r}",
                     timeout=300)
        lost = tuple(r for r, n in enumerate(nodes) if n == LOST_NODE)
        d = cluster.daemons[LOST_NODE]
        pids = {worker_pid(d, f"{JOB}.r{r}") for r in lost}
        pids |= {p.pid for p in train_processes(cluster, (LOST_NODE,))}
        controller = cluster.status().controller
        sig = signal.SIGSTOP if silent else signal.SIGKILL
        if silent:
            frozen = [d.pid, *pids]
        kill_at = time.time()
        os.kill(d.pid, sig)
        for pid in pids:  # each worker leads a process group of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
        if not silent:
            d.wait(timeout=10)
        recovery = finish(cluster)
        seen = snapshot(cluster)
    finally:
        for pid in frozen:  # past saving: stop_cluster would only ask them to stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop_cluster(etcd, cluster)
    failed = [e for e in seen["events"] if e["kind"] == "node-failed" and e["node"] == LOST_NODE
              and e["time"] >= kill_at]
    if not failed:
        raise BenchmarkError(f"no node-failed event for {LOST_NODE}; events: "
                             f"{sorted({e['kind'] for e in seen['events']})}")
    figures = analyse(kill_at, failed[0]["time"], lost, recovery, seen["events"], seen["logs"])
    return {"wall_s": time.monotonic() - t0, "controller": controller, "kill_at": kill_at,
            "killed_pids": sorted(pids), "node_failed_message": failed[0]["message"],
            "recovery": recovery, **figures,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"]}


def spawn_all(argvs: list[list[str]], base: Path, name: str) -> list[dict[str, Any]]:
    """Start the commands at once (stdout and stderr to files under ``base``); returns each one's
    Popen time, exit time (polled every 5 ms), exit code and stdout. Every process is killed
    should this be cut short."""
    env = {**os.environ, **ONE_THREAD}
    procs: list[tuple[float, subprocess.Popen[bytes]]] = []
    try:
        for i, argv in enumerate(argvs):
            with open(base / f"{name}{i}.out", "wb") as out, \
                    open(base / f"{name}{i}.err", "wb") as err:
                t = time.time()
                procs.append((t, subprocess.Popen(argv, cwd=REPO, env=env,
                                                  stdin=subprocess.DEVNULL, stdout=out,
                                                  stderr=err)))
        ended: dict[int, float] = {}
        deadline = time.monotonic() + 300
        while len(ended) < len(procs):
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{name} processes ran past 300 s (logs in {base})")
            for i, (_, p) in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.005)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [{"popen_at": t, "exit_at": ended[i], "returncode": p.returncode,
             "stdout": (base / f"{name}{i}.out").read_text(errors="replace"),
             "stderr_tail": (base / f"{name}{i}.err").read_text(errors="replace")[-2000:]}
            for i, (t, p) in enumerate(procs)]


def import_times(stderr: str) -> dict[str, float]:
    """Seconds per top-level import, its nested imports included, from the lines of
    ``-X importtime`` (the interpreter's own imports at start-up are among them)."""
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        m = IMPORT_TIME.match(line)
        if m and not m["indent"]:
            out[m["module"]] = int(m["cumulative"]) / 1e6
    return out


def cold_start(saved: Path, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    """The job started fresh as four standalone processes from the run's final state (one step).

    Raises:
        BenchmarkError: the saved state is missing, or a process failed.
    """
    base.mkdir(parents=True, exist_ok=True)
    try:
        steps = {json.loads((saved / f"rank{r}.json").read_text())["step"] for r in range(WORLD)}
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise BenchmarkError(f"the run's final state is missing or unreadable: {exc}") from exc
    if len(steps) != 1:
        raise BenchmarkError(f"the ranks saved different steps: {sorted(steps)}")
    step = steps.pop()
    out = base / "out"
    argvs = [[sys.executable, "-X", "importtime", str(TRAIN), "--rank", str(r),
              "--world-size", str(WORLD), "--tp", str(TP), "--store", str(base / "store"),
              "--steps", str(step + 1), "--step-sleep", str(cfg.step_sleep),
              "--load", str(saved), "--save", str(out)] for r in range(WORLD)]
    ranks: dict[str, Any] = {}
    for r, p in enumerate(spawn_all(argvs, base, "rank")):
        stderr = (base / f"rank{r}.err").read_text(errors="replace")
        if p["returncode"] != 0:
            told = "\n".join(x for x in stderr.splitlines() if not x.startswith("import time:"))
            raise BenchmarkError(f"cold rank {r} exited with {p['returncode']}: {told[-2000:]}")
        try:
            summary = json.loads((out / f"rank{r}.json").read_text())
            saved_at = (out / f"rank{r}.pt").stat().st_mtime
        except (OSError, json.JSONDecodeError) as exc:
            raise BenchmarkError(f"cold rank {r} saved nothing readable: {exc}") from exc
        timings = summary["timings"]
        if summary["step"] != step + 1 or [t["step"] for t in timings] != [step]:
            raise BenchmarkError(f"cold rank {r} ran steps {[t['step'] for t in timings]}, "
                                 f"not just step {step}")
        imports = import_times(stderr)
        if not imports:
            raise BenchmarkError(f"cold rank {r} wrote no -X importtime lines")
        first = timings[0]
        first_s = first["boundary"] + first["compute"] + first["vote"] + first["apply"]
        # The state is saved right after the step (a few kB): its mtime stands for the commit.
        to_first = saved_at - p["popen_at"]
        imports_s = sum(imports.values())
        ranks[str(r)] = {
            "spawn_to_first_step_s": to_first,
            "imports_s": imports_s,
            "lazy_dynamo_import_s": imports.get(LAZY, 0.0),
            "slowest_imports": dict(sorted(imports.items(), key=lambda kv: -kv[1])[:5]),
            "start_groups_build_load_s": to_first - imports_s - first_s,
            "first_step_s": first_s, "first_step_compute_s": first["compute"],
            "spawn_to_exit_s": p["exit_at"] - p["popen_at"],
        }

    def med(key: str) -> float:
        return statistics.median(x[key] for x in ranks.values())

    return {
        "saved_step": step,
        "spawn_to_first_step_s": med("spawn_to_first_step_s"),
        "slowest_spawn_to_first_step_s": max(x["spawn_to_first_step_s"] for x in ranks.values()),
        "imports_s": med("imports_s"),
        "lazy_dynamo_import_s": med("lazy_dynamo_import_s"),
        "start_groups_build_load_s": med("start_groups_build_load_s"),
        "first_step_s": med("first_step_s"),
        "spawn_to_exit_s": med("spawn_to_exit_s"),
        "ranks": ranks,
    }


def run_repeat(i: int, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    crash = worker_crash(cfg, base / "crash")
    cold = cold_start(base / "crash" / "out", cfg, base / "cold")
    warm = crash["joiner_timeline"][str(VICTIM)]
    lost = node_loss(cfg, base / "node")
    return {"repeat": i, "worker_crash": crash, "node_loss": lost, "cold_start": cold,
            "warm_vs_cold": {
                "warm_chosen_to_first_step_s": warm["chosen_to_first_step_s"],
                "warm_chosen_to_took_over_s": warm["chosen_to_took_over_s"],
                "warm_chosen_to_preparing_s": warm["chosen_to_preparing_s"],
                "cold_spawn_to_first_step_s": cold["spawn_to_first_step_s"],
                "cold_over_warm": cold["spawn_to_first_step_s"] / warm["chosen_to_first_step_s"],
                "cold_over_warm_took_over": cold["spawn_to_first_step_s"]
                / warm["chosen_to_took_over_s"],
            }}


# -- the run -----------------------------------------------------------------------------------

PHASES = ("detection", "planning", "settle", "rebuild_transfer", "first_step")


def summarize_some(values: list[float]) -> dict[str, float] | None:
    return summarize(values) if values else None


def collect(repeats: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    def scenario(key: str, what: str, detection: str) -> dict[str, Any]:
        s = [r[key] for r in repeats]
        transfers = [t for x in s for t in x["transfers"].values()]
        joiners = [j for x in s for j in x["joiner_timeline"].values()]
        return {
            "what": what, "detection": detection,
            "end_to_end_s": summarize([x["end_to_end_s"] for x in s]),
            **{f"{p}_s": summarize([x["phases_s"][p] for x in s]) for p in PHASES},
            "transfer_send_s": summarize([t["send_s"] for t in transfers]),
            "transfer_joiner_receive_s": summarize([t["joiner_receive_s"] for t in transfers]),
            "transfer_payload_bytes": transfers[0]["payload_bytes"],
            "joiner_chosen_to_first_step_s": summarize([j["chosen_to_first_step_s"]
                                                        for j in joiners]),
            "steps_before_failure": summarize_some([x["steps_before_failure"] for x in s
                                                    if x["steps_before_failure"] is not None]),
            "settled_step": summarize([x["settled_step"] for x in s]),
        }

    warm = [r["warm_vs_cold"] for r in repeats]
    cold = [r["cold_start"] for r in repeats]
    return {
        "worker_crash": scenario(
            "worker_crash", f"kill -9 of rank {VICTIM}'s worker -> the last 'First step after "
            "recovery' line over all ranks", "kill -> the time of the rank's exit record in etcd"),
        "node_loss": {**scenario(
            "node_loss", f"kill -9 of {LOST_NODE}'s daemon and workers at once -> the last "
            "'First step after recovery' line over all ranks",
            "kill -> the controller's node-failed event (lease expiry)"),
            "lease_ttl_s": cfg.ttl, "keepalive_interval_s": KEEPALIVE_INTERVAL},
        "warm_vs_cold": {
            "what": f"warm: rank {VICTIM}'s joiner in the crash scenario, 'Standby chosen' -> "
                    "its first step after recovery (waiting for the survivors included); cold: "
                    "4 standalone processes started at once from the final state, Popen -> "
                    "state saved after their first step (median of the 4)",
            "warm_chosen_to_first_step_s": summarize([w["warm_chosen_to_first_step_s"]
                                                      for w in warm]),
            "warm_chosen_to_took_over_s": summarize([w["warm_chosen_to_took_over_s"]
                                                     for w in warm]),
            "warm_chosen_to_preparing_s": summarize_some([
                w["warm_chosen_to_preparing_s"] for w in warm
                if w["warm_chosen_to_preparing_s"] is not None]),
            "cold_spawn_to_first_step_s": summarize([c["spawn_to_first_step_s"] for c in cold]),
            "cold_imports_s": summarize([c["imports_s"] for c in cold]),
            "cold_lazy_dynamo_import_s": summarize([c["lazy_dynamo_import_s"] for c in cold]),
            "cold_start_groups_build_load_s": summarize([c["start_groups_build_load_s"]
                                                         for c in cold]),
            "cold_first_step_s": summarize([c["first_step_s"] for c in cold]),
            "cold_spawn_to_exit_s": summarize([c["spawn_to_exit_s"] for c in cold]),
            "cold_over_warm": summarize([w["cold_over_warm"] for w in warm]),
            "cold_over_warm_took_over": summarize([w["cold_over_warm_took_over"] for w in warm]),
        },
    }


def print_summary(result: dict[str, Any]) -> None:
    cfg, m, s = result["config"], result["machine"], result["summary"]
    print(f"\nrecovery: TP2 x DP2 + 2 standbys, {cfg['repeats']} repeats of each scenario, "
          f"{cfg['steps']} steps, failure after {cfg['crash_at']}, lease TTL {cfg['ttl']} s; "
          f"on {m['cpus_usable']} CPUs, Python {m['python']}, etcd {m['etcd_version']}")
    print(f"worker crash: kill -9 of rank {VICTIM}'s worker; node loss: kill -9 of {LOST_NODE}'s "
          f"daemon and workers at once; each to the last rank's first step after recovery")

    def row(label: str, v: dict[str, float] | None, unit: str, scale: float = 1.0) -> None:
        if v is None:
            print(f"  {label:<44}{'(never recorded)':>20}")
            return
        print(f"  {label:<44}" + "".join(f"{v[k] * scale:>10.3f}" for k in
                                          ("median", "min", "max", "spread")) + f"  {unit}"
              + (f" (n={v['n']})" if v["n"] != cfg["repeats"] else ""))

    print(f"\n  {'':<44}{'median':>10}{'min':>10}{'max':>10}{'spread':>10}")
    for key, title, detect in (("worker_crash", f"worker crash (rank {VICTIM})",
                                "detection (-> exit record)"),
                               ("node_loss", f"node loss ({LOST_NODE})",
                                "detection (-> node-failed, lease)")):
        x = s[key]
        row(f"{title}: end to end", x["end_to_end_s"], "s")
        row(f"  {detect}", x["detection_s"], "s")
        row("  planning (-> recovery planned)", x["planning_s"], "s")
        row("  settle (-> survivors settled)", x["settle_s"], "s")
        row("  rebuild+transfer (-> recovered)", x["rebuild_transfer_s"], "s")
        row("  first step (-> all ranks' first step)", x["first_step_s"], "s")
        row("  state transfer, donor's send", x["transfer_send_s"], "ms", 1e3)
        row("  joiner: chosen -> first step", x["joiner_chosen_to_first_step_s"], "s")
        row("  steps committed before the failure", x["steps_before_failure"], "steps")
        row("  step the job settled on", x["settled_step"], "steps")
    w = s["warm_vs_cold"]
    row(f"warm: joiner chosen -> first step (rank {VICTIM})", w["warm_chosen_to_first_step_s"],
        "s")
    row("  joiner chosen -> bound (job built)", w["warm_chosen_to_preparing_s"], "s")
    row("  joiner chosen -> took over rank", w["warm_chosen_to_took_over_s"], "s")
    row("cold: Popen -> first step committed", w["cold_spawn_to_first_step_s"], "s")
    row("  imports (all, -X importtime)", w["cold_imports_s"], "s")
    row("    of which torch._dynamo (lazy, in build)", w["cold_lazy_dynamo_import_s"], "s")
    row("  start + groups + build + load (the rest)", w["cold_start_groups_build_load_s"], "s")
    row("  first step", w["cold_first_step_s"], "s")
    row("  Popen -> exit (save, teardown included)", w["cold_spawn_to_exit_s"], "s")
    row("cold / warm (chosen -> first step)", w["cold_over_warm"], "x")
    row("cold / warm (chosen -> took over)", w["cold_over_warm_took_over"], "x")
    loads = [x for r in result["repeats"] for k in ("worker_crash", "node_loss")
             for x in r[k]["loadavg_1m_before_after"]]
    print(f"  1-minute load average during the run: {min(loads):.1f} to {max(loads):.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="repeats of each scenario, each on a fresh "
                   "cluster (default 5; smoke 1)")
    p.add_argument("--steps", type=int, help="steps of the job (default 300; smoke 120)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the e2e tests)")
    p.add_argument("--crash-at", type=int, default=LOG_EVERY,
                   help=f"fail once this many steps are committed, a multiple of {LOG_EVERY} "
                        f"(default {LOG_EVERY})")
    p.add_argument("--ttl", type=int, default=config_mod.LeaseConfig().ttl,
                   help=f"the daemons' lease TTL in seconds (default "
                        f"{config_mod.LeaseConfig().ttl}, the daemon's default)")
    p.add_argument("--smoke", action="store_true", help="a few minutes: for the tests")
    p.add_argument("--no-sandbox", action="store_true",
                   help="standbys only import the job (no recording directory): the model is "
                        "built once chosen")
    p.add_argument("--out", type=Path, help=f"JSON results (default {DEFAULT_OUT.relative_to(REPO)}"
                   f"; smoke {SMOKE_OUT.relative_to(REPO)})")
    p.add_argument("--keep-dir", type=Path, help="keep daemon logs, etcd data and states here")
    args = p.parse_args(argv)

    def pick(value: Any, full: Any, smoke: Any) -> Any:
        return value if value is not None else (smoke if args.smoke else full)

    args.repeats = pick(args.repeats, 5, 1)
    args.steps = pick(args.steps, 300, 120)
    args.out = pick(args.out, DEFAULT_OUT, SMOKE_OUT)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.crash_at < LOG_EVERY or args.crash_at % LOG_EVERY:
        p.error(f"--crash-at must be a positive multiple of {LOG_EVERY} (the runtime logs its "
                f"progress every {LOG_EVERY} steps), got {args.crash_at}")
    if args.steps < args.crash_at + 20:
        p.error(f"--steps must be at least --crash-at + 20 for the failure to land mid-run, "
                f"got {args.steps}")
    if args.step_sleep < 0:
        p.error("--step-sleep must be >= 0")
    if args.ttl < 3:
        p.error(f"--ttl must be at least 3: the daemon's etcd timeout (1 s) must be at most "
                f"TTL/3, got {args.ttl}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(repeats=args.repeats, steps=args.steps, step_sleep=args.step_sleep,
                      crash_at=args.crash_at, ttl=args.ttl, smoke=args.smoke,
                      sandbox=not args.no_sandbox)
    os.environ.update(ONE_THREAD)  # the daemons, their workers and the cold ranks inherit it
    # SIGTERM takes the Ctrl-C path, so the finally blocks below stop every process.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    base = args.keep_dir or Path(tempfile.mkdtemp(prefix="understudy-bench-rec-"))
    base.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    repeats: list[dict[str, Any]] = []
    try:
        for i in range(cfg.repeats):
            rep = run_repeat(i, cfg, base / f"repeat{i}")
            repeats.append(rep)
            c, n, w = rep["worker_crash"], rep["node_loss"], rep["warm_vs_cold"]
            print(f"  repeat {i + 1}/{cfg.repeats}: crash recovered in {c['end_to_end_s']:.2f}s "
                  f"(settled on step {c['settled_step']}), node loss in "
                  f"{n['end_to_end_s']:.2f}s; warm {w['warm_chosen_to_first_step_s']:.2f}s vs "
                  f"cold {w['cold_spawn_to_first_step_s']:.2f}s; "
                  f"{c['wall_s'] + n['wall_s']:.0f}s, load "
                  f"{n['loadavg_1m_before_after'][1]:.1f}", file=sys.stderr, flush=True)
    except (BenchmarkError, EtcdStartError, StoreError, OSError, UnderstudyError,
            psutil.Error) as exc:
        print(f"recovery benchmark failed: {exc} (logs in {base})", file=sys.stderr)
        args.keep_dir = args.keep_dir or base
        return 1
    except KeyboardInterrupt:
        print("recovery benchmark interrupted; its processes are stopped", file=sys.stderr)
        return 130
    finally:
        # A second Ctrl-C must not cut the clean-up short (each scenario stops its cluster).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if args.keep_dir is None:
            shutil.rmtree(base, ignore_errors=True)

    result = {
        "benchmark": "recovery",
        "started_at": started,
        "command": shlex.join(sys.orig_argv),
        "machine": machine(),
        "config": {**asdict(cfg), "tp": TP, "dp": WORLD // TP, "standby": 2,
                   "job": "examples/plain_torch/train.py", "threads_per_process": 1,
                   "victim_rank": VICTIM, "lost_node": LOST_NODE,
                   "keepalive_interval_s": KEEPALIVE_INTERVAL},
        "summary": collect(repeats, cfg),
        "repeats": repeats,
    }
    print_summary(result)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")  # git-ignored should the run die mid-write
    tmp.write_text(json.dumps(rounded(result), indent=1) + "\n")
    tmp.replace(out)
    print(f"\nresults written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
