"""The plain job on the benchmarks' understudy cluster, and what an interruption of it costs.

The cluster (:func:`bring_up`): an embedded etcd; ``node-a``, started first so that it holds the
controller, and ``node-b``, two slots each; standby nodes ``node-s1`` and ``node-s2``. The job
(:func:`submit`): the plain-PyTorch example TP=2 x DP=2 with two standbys, warmed in the sandbox
unless told otherwise. The interruptions, each on a fresh cluster, with their figures from the
job's saved timings, the daemons' logs (the workers' lines included) and the events:

- :func:`worker_crash` and :func:`node_loss` (or a silent node), measured by
  :func:`analyse_recovery` (``recovery.py``, ``downtime.py``);
- a planned drain, measured by :func:`analyse_drain` (``migration.py``, ``downtime.py``).

``goodput.py``, ``soak.py`` and ``false_positives.py`` run the same cluster and job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from harness import (
    PROCESS_ENV,
    TRAIN,
    BenchmarkError,
    RecordTail,
    etcd_store,
    example_options,
    local_cluster,
    snapshot,
    wait,
    wait_done,
    wait_log,
    wall,
    worker_pid,
)

from understudy.common.errors import RecordError
from understudy.common.keys import Keys
from understudy.common.records import MigrationPhase, RankExit
from understudy.testing.localcluster import LocalCluster

JOB = "mig"
WORLD, TP = 4, 2
ACTIVE, STANDBYS = ("node-a", "node-b"), ("node-s1", "node-s2")
VICTIM = 1  # the rank whose worker is killed (on node-a; its TP partner is rank 0)
LOST_NODE = "node-b"  # the node lost in a node loss (ranks 2 and 3)
#: The runtime logs "N steps committed on rank R" every this many steps: a failure's step is a
#: multiple of it, unless the job keeps a step log (``RecoveryConfig.step_log``), which says each.
LOG_EVERY = 50
#: A recovery's phases, each from the previous milestone (see :func:`analyse_recovery`).
PHASES = ("detection", "planning", "settle", "rebuild_transfer", "first_step")
#: A drain of node-b: ranks 0 and 1 stay, 2 and 3 move to the standbys.
SURVIVORS, LEAVERS = (0, 1), (2, 3)
#: Steps around the switch step whose excess over a normal step is also summed: the steps
#: next to it pay a little too (the vote that agreed the switch, the first steps on new groups).
AROUND = range(-3, 4)

FIRST_STEP = re.compile(r"First step after recovery (?P<id>\S+): step (?P<step>\d+) committed on "
                        r"rank (?P<rank>\d+)\.")
SETTLED = re.compile(r"Recovery (?P<id>\S+): settled on step (?P<step>\d+);")
RECOVERED = re.compile(r"Recovered from the loss of rank\(s\) \[(?P<ranks>[\d, ]*)\] at step "
                       r"(?P<step>\d+)")
GAVE = re.compile(r"Gave rank (?P<rank>\d+)'s joiner the state of step (?P<step>\d+): send "
                  r"(?P<bytes>\d+) B .*? in (?P<ms>[\d.]+) ms")
CHOSEN = re.compile(r"Standby chosen to take over rank (?P<rank>\d+)\.")
#: The joiner's side of a state transfer, in a recovery and in a drain.
TOOK_OVER = re.compile(r"Took over rank (?P<rank>\d+): receive (?P<bytes>\d+) B .*? in "
                       r"(?P<ms>[\d.]+) ms")
ABORTED = re.compile(r"Step (?P<step>\d+) aborted:")
KILLED = re.compile(r"Worker (?P<child>\S+) \(pid (?P<pid>\d+)\) was killed by SIGKILL")
HANDED_OFF = re.compile(
    r"Handed the state of rank (?P<rank>\d+) off at step (?P<step>\d+): send (?P<bytes>\d+) B "
    r"of tensors in (?P<entries>\d+) entries in (?P<ms>[\d.]+) ms .*?(?P<chunks>\d+) chunks of "
    r"(?P<chunk_bytes>\d+) B .*manifest (?P<manifest>\d+) B")
#: A leaver whose state was sent ahead (worker.migration.SendAhead): the state's figures, then
#: the steps' apply inputs forwarded before the switch.
SENT_AHEAD = re.compile(
    r"Rank (?P<rank>\d+): the state of step (?P<step>\d+) sent ahead: send (?P<bytes>\d+) B "
    r"of tensors in (?P<entries>\d+) entries in (?P<ms>[\d.]+) ms .*?(?P<chunks>\d+) chunks of "
    r"(?P<chunk_bytes>\d+) B .*?manifest (?P<manifest>\d+) B"
    r"(?:.*?; then (?P<steps>\d+) step\(s\)' apply inputs, (?P<step_bytes>\d+) B in "
    r"(?P<step_ms>[\d.]+) ms)?")
SWITCHED = re.compile(r"Switched to the next versions of .* at step (?P<step>\d+)\.")
#: The resident set either end of a transfer logs with its figures (worker.transfer).
RSS = re.compile(r"RSS (?P<start>\d+) B at the start, peak RSS (?P<peak>\d+) B")


def rss_mib(message: str) -> dict[str, float] | None:
    """The RSS at a transfer's start and the process's peak RSS, in MiB, from its log line."""
    m = RSS.search(message)
    return None if m is None else {"start": int(m["start"]) / 2**20,
                                   "peak": int(m["peak"]) / 2**20}


@dataclass(frozen=True)
class RecoveryConfig:
    """The recovery benchmark's configuration; the other benchmarks run its scenarios with
    one repeat."""

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
    #: the job's state per rank in bytes (``train.py --state-size``); None: the example's
    #: default size (about 27 KB per rank at TP 2)
    state_bytes: int | None = None
    #: how a drain's leaver hands its state off (``train.py --hand-off``): ``ahead`` (its
    #: state while training goes on, then each step's gradients) or ``whole`` (at the switch)
    hand_off: str = "ahead"
    #: the job shards its Adam state over DP with a redundant copy of each shard on the next
    #: DP rank (``train.py --shard-optimizer``)
    shard_optimizer: bool = False
    #: seconds from the commit of step ``crash_at`` to the event: lands it mid-step
    event_delay: float = 0.0
    #: the job's compute stops at its next autograd operation once it recovers (``train.py
    #: --interruptible``, its default; False: ``--no-interruptible``, at its next collective,
    #: as every run before git 5da3803)
    interruptible: bool = True


# -- the cluster and the job -------------------------------------------------------------------


def steps_timeout(steps: int) -> float:
    """How long a run may take to commit ``steps`` steps: 300 s, or 15 s a step where that is
    more (at 1 GiB per rank a step of the four ranks takes 8-12 s on two cores)."""
    return max(300.0, 15.0 * steps)


def finish_timeout(steps: int) -> float:
    """How long a run of ``steps`` steps may take to end once interrupted: 600 s, or its steps'
    :func:`steps_timeout` where that is more (at 1 GiB per rank torchrun's 110 steps, restart
    and redone steps included, ran past a fixed 600 s)."""
    return max(600.0, steps_timeout(steps))


def bring_up(cluster: LocalCluster, standbys: tuple[str, ...] = STANDBYS) -> None:
    """The daemons on the cluster's etcd (started): node-a and node-b, two slots each, and the
    standby nodes ``standbys``; node-a first, so that it holds the controller (node-b is the
    node lost, and losing the controller would add an election to the detection)."""
    cluster.add("node-a", "active", extra=["--slots", "2"])
    cluster.wait_state("node-a", "active", timeout=60)
    cluster.wait_for("node-a to hold the controller", lambda s: s.controller == "node-a",
                     timeout=60)
    cluster.add("node-b", "active", extra=["--slots", "2"])
    for n in standbys:
        cluster.add(n, "standby")
    cluster.wait_state("node-b", "active", timeout=60)
    for n in standbys:
        cluster.wait_state(n, "standby", timeout=60)


def add_standbys(cluster: LocalCluster, count: int, joined: list[str]) -> list[str]:
    """``count`` fresh standby nodes, as a cloud's autoscaler adds them: new daemons with new
    names (``node-s3``, ``node-s4``..., after :data:`STANDBYS` and the ones ``joined`` before),
    added to ``joined``; returns their names."""
    names = [f"node-s{len(STANDBYS) + len(joined) + 1 + i}" for i in range(count)]
    for name in names:
        cluster.add(name, "standby")
    joined += names
    return names


def submit(cluster: LocalCluster, cfg: RecoveryConfig, out: Path) -> None:
    """The job, ``--save`` to ``out``; returns once both standby workers are warm.

    Raises:
        BenchmarkError: ``understudy run`` failed, or the standbys did not warm up.
    """
    extra = dict(PROCESS_ENV)
    if cfg.sandbox:
        extra["UNDERSTUDY_RECORDINGS"] = str(out.parent / "recordings")
    env = [f"--env={k}={v}" for k, v in extra.items()]
    step_log = ["--step-log", str(out.parent / "steps")] if cfg.step_log else []
    if cfg.state_bytes is not None:
        step_log += ["--state-size", str(cfg.state_bytes)]
    step_log += ["--hand-off", cfg.hand_off]
    if cfg.shard_optimizer:
        step_log.append("--shard-optimizer")
    step_log.append("--interruptible" if cfg.interruptible else "--no-interruptible")
    # The ranks record their first iterations for the standbys' sandbox, then hold until the
    # standbys are warm: on a loaded machine their warm-up (imports, the replay) once took
    # longer than the job's steps, which ended before the event came.
    warm = out.parent / "standbys-warm"
    step_log += ["--hold-until", str(warm)]
    run = cluster.cli("run", "--job", JOB, "--tp", str(TP), "--dp", str(WORLD // TP),
                      "--standby", "2", *env, "--", sys.executable, str(TRAIN),
                      "--steps", str(cfg.steps), "--step-sleep", str(cfg.step_sleep),
                      "--save", str(out), *step_log, *example_options(cfg.smoke))
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
    warm.touch()


def rank_nodes(cluster: LocalCluster) -> tuple[int, tuple[str, ...]]:
    """The job's epoch and the node of each rank."""
    job = cluster.status().job(JOB)
    if job is None or job.assignment is None:
        raise BenchmarkError("the job has no assignment")
    return job.assignment.epoch, tuple(job.assignment.ranks)


def read_exit(cluster: LocalCluster, epoch: int, rank: int) -> dict[str, Any] | None:
    """The rank's exit record in etcd, as its daemon wrote it; None if there is none."""
    async def read() -> dict[str, Any] | None:
        store = etcd_store(cluster.etcd_endpoint, cluster.prefix)
        try:
            kv = await store.get(Keys(cluster.prefix).rank_exit(JOB, epoch, rank))
            return None if kv is None else asdict(RankExit.decode(kv.value))
        finally:
            await store.close()
    try:
        return asyncio.run(read())
    except RecordError as exc:
        raise BenchmarkError(f"rank {rank}'s exit record is unreadable: {exc}") from exc


def train_processes(cluster: LocalCluster, nodes: tuple[str, ...]) -> list[psutil.Process]:
    """The job's processes under these nodes' daemons."""
    out = []
    for node in nodes:
        for p in psutil.Process(cluster.daemons[node].pid).children(recursive=True):
            if str(TRAIN) in " ".join(p.cmdline()):
                out.append(p)
    return out


def wait_committed(cluster: LocalCluster, rank: int, steps: int,
                   step_log: RecordTail | None = None) -> None:
    """Wait until ``rank`` committed ``steps`` steps, as its lines in ``step_log`` say (any
    step), or else as any daemon's log says (a multiple of :data:`LOG_EVERY`): the rank may
    have moved since the job started (a machine short of memory once saw the kernel's OOM killer
    take one, and the job recover it onto a standby)."""
    if step_log is not None:
        def committed() -> bool:
            step_log.poll()
            return step_log.newest.get(rank, (0.0, -1))[1] >= steps - 1
    else:
        line = f"{steps} steps committed on rank {rank}"

        def committed() -> bool:
            return any(line in d.log_text() for d in cluster.daemons.values())
    wait(f"rank {rank} to commit {steps} steps", committed, steps_timeout(steps), interval=0.02)


def step_log_of(cfg: RecoveryConfig, out: Path) -> RecordTail | None:
    """The job's step lines (``submit`` gives ``--step-log`` beside ``out``), if it keeps them."""
    return RecordTail(out.parent / "steps") if cfg.step_log else None


# -- a recovery ------------------------------------------------------------------------------


def finish(cluster: LocalCluster) -> dict[str, Any]:
    """Wait for the job to end; returns its recovery record (the job's last migration).

    Raises:
        BenchmarkError: the job failed, or there was no recovery.
    """
    job = wait_done(cluster, JOB, timeout=900)
    m = job.migration
    if m is None or m.kind != "recovery":
        raise BenchmarkError(f"the job's last migration is no recovery ({m}); it ended "
                             f"{job.status.reason if job.status else 'done'!r}. A job that "
                             "reached its last step before the failure needs more --steps "
                             "past --crash-at on a machine this loaded")
    if m.phase != MigrationPhase.DONE:
        # Called off: the job then ended some other way (a loss as it finished ends it done).
        raise BenchmarkError(f"recovery {m.id} of ranks {list(m.ranks)} was {m.phase} "
                             f"({m.outcome or 'no reason recorded'}); the job ended "
                             f"{job.status.state if job.status else 'done'}: "
                             f"{job.status.reason if job.status else ''!r}")
    return {"id": m.id, "phase": str(m.phase), "ranks": list(m.ranks),
            "joiners": list(m.joiners), "donors": list(m.donors), "reason": m.reason,
            "created_at": m.created_at,
            # Wall times of the phases entered (the record may hold other measurements too).
            "timings": {k: v for k, v in m.timings.items()
                        if k in set(MigrationPhase) and isinstance(v, int | float)}}


def analyse_recovery(kill_at: float, detected_at: float, lost: tuple[int, ...],
                     recovery: dict[str, Any], events: list[dict[str, Any]],
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
    took: dict[int, tuple[float, float, dict[str, float] | None]] = {}
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
                                        "send_s": float(m["ms"]) / 1e3,
                                        "donor_rss_mib": rss_mib(msg)}
            elif (m := CHOSEN.search(msg)) and rec.get("migration", rid) == rid:
                chosen.setdefault(int(m["rank"]), (at, node))
            elif m := TOOK_OVER.search(msg):
                took.setdefault(int(m["rank"]), (at, float(m["ms"]) / 1e3, rss_mib(msg)))
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
        gave[r]["joiner_rss_mib"] = took[r][2]
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


def worker_crash(cfg: RecoveryConfig, base: Path) -> dict[str, Any]:
    """kill -9 of rank :data:`VICTIM`'s worker once it has committed ``cfg.crash_at`` steps, on
    a fresh cluster; the job's final state is left in ``base/out``.

    Raises:
        BenchmarkError: the job did not recover and finish, or left no evidence of it.
    """
    out = base / "out"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    with local_cluster(base, cfg.ttl) as (_, cluster):
        bring_up(cluster)
        submit(cluster, cfg, out)
        epoch, nodes = rank_nodes(cluster)
        d = cluster.daemons[nodes[VICTIM]]
        # Everything the kill needs is found first: between the step's line and the kill the
        # job runs on (a loaded machine's harness once let it finish first).
        wait_log(d, f"Started rank {VICTIM} of job {JOB}", timeout=steps_timeout(0))
        pid = worker_pid(d, f"{JOB}.r{VICTIM}")
        controller = cluster.status().controller
        wait_committed(cluster, VICTIM, cfg.crash_at, step_log_of(cfg, out))
        if rank_nodes(cluster)[0] != epoch:  # it moved: its worker now
            epoch, nodes = rank_nodes(cluster)
            d = cluster.daemons[nodes[VICTIM]]
            pid = worker_pid(d, f"{JOB}.r{VICTIM}")
        time.sleep(cfg.event_delay)
        kill_at = time.time()
        os.kill(pid, signal.SIGKILL)
        recovery = finish(cluster)
        exit_rec = read_exit(cluster, epoch, VICTIM)
        seen = snapshot(cluster)
    if exit_rec is None:
        raise BenchmarkError(f"rank {VICTIM}'s daemon wrote no exit record for epoch {epoch}")
    killed_line = next((wall(rec) for rec in seen["logs"][d.name]
                        if (m := KILLED.search(str(rec.get("event", "")))) and
                        int(m["pid"]) == pid), None)
    figures = analyse_recovery(kill_at, exit_rec["time"], (VICTIM,), recovery,
                               seen["events"], seen["logs"])
    return {"wall_s": time.monotonic() - t0, "controller": controller, "killed_pid": pid,
            "kill_at": kill_at,
            "exit_record": {k: exit_rec[k] for k in ("returncode", "failed", "description")},
            # The daemon's log line for the exit (logged just before it writes the record).
            "kill_to_exit_log_line_s": None if killed_line is None else killed_line - kill_at,
            "recovery": recovery, **figures,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"]}


def node_loss(cfg: RecoveryConfig, base: Path, silent: bool = False) -> dict[str, Any]:
    """kill -9 of :data:`LOST_NODE`'s daemon and workers at once, once every rank has
    committed ``cfg.crash_at`` steps, on a fresh cluster. ``silent``: they are frozen (SIGSTOP)
    instead: no process dies and no connection is closed, as when a machine loses power or its
    switch port, and they stay frozen to the end.

    Raises:
        BenchmarkError: the job did not recover and finish, or left no evidence of it.
    """
    out = base / "out"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    frozen: list[int] = []
    with local_cluster(base, cfg.ttl) as (_, cluster):
        try:
            bring_up(cluster)
            submit(cluster, cfg, out)
            epoch, nodes = rank_nodes(cluster)
            d = cluster.daemons[LOST_NODE]

            def victims() -> tuple[tuple[int, ...], set[int]]:
                """The ranks on the lost node, and its workers' pids."""
                lost = tuple(r for r, n in enumerate(nodes) if n == LOST_NODE)
                for r in lost:
                    wait_log(d, f"Started rank {r} of job {JOB}", timeout=steps_timeout(0))
                pids = {worker_pid(d, f"{JOB}.r{r}") for r in lost}
                return lost, pids | {p.pid for p in train_processes(cluster, (LOST_NODE,))}

            # Everything the kill needs is found first (as in worker_crash).
            lost, pids = victims()
            controller = cluster.status().controller
            steps = step_log_of(cfg, out)
            for r in range(WORLD):
                wait_committed(cluster, r, cfg.crash_at, steps)
            if rank_nodes(cluster)[0] != epoch:  # the job moved meanwhile: look again
                epoch, nodes = rank_nodes(cluster)
                lost, pids = victims()
                if not lost:
                    raise BenchmarkError(f"{LOST_NODE} holds no rank of the job any more "
                                         f"(epoch {epoch}: {nodes})")
            sig = signal.SIGSTOP if silent else signal.SIGKILL
            if silent:
                frozen = [d.pid, *pids]
            time.sleep(cfg.event_delay)
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
            for pid in frozen:  # past saving: stopping the cluster would only ask them to stop
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    failed = [e for e in seen["events"] if e["kind"] == "node-failed" and e["node"] == LOST_NODE
              and e["time"] >= kill_at]
    if not failed:
        raise BenchmarkError(f"no node-failed event for {LOST_NODE}; events: "
                             f"{sorted({e['kind'] for e in seen['events']})}")
    figures = analyse_recovery(kill_at, failed[0]["time"], lost, recovery, seen["events"],
                               seen["logs"])
    return {"wall_s": time.monotonic() - t0, "controller": controller, "kill_at": kill_at,
            "killed_pids": sorted(pids), "node_failed_message": failed[0]["message"],
            "recovery": recovery, **figures,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"]}


# -- a drain ---------------------------------------------------------------------------------


def step_totals(timings: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds per step, every attempt of the step included."""
    out: dict[int, float] = {}
    for t in timings:
        total = t["boundary"] + t["compute"] + t["vote"] + t["apply"]
        out[t["step"]] = out.get(t["step"], 0.0) + total
    return out


def analyse_drain(out_dir: Path, events: list[dict[str, Any]],
                  logs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """A drain of node-b's figures from the job's saved timings (``--save out_dir``), the
    events and the daemon logs: the survivors' switch step against their normal one (the
    downtime), phase 1 and the steps that ran during it, the state transfers.

    Raises:
        BenchmarkError: the migration did not switch, or a record is missing.
    """
    try:
        saved = {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)}
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchmarkError(f"the job's saved timings are missing or unreadable: {exc}") from exc
    firsts = {r: saved[r]["timings"][0]["step"] for r in LEAVERS}
    switch = firsts[LEAVERS[0]]
    if switch == 0 or len(set(firsts.values())) != 1:
        # What became of the migration (called off, or still preparing as the job ended) is
        # the events' to say: a CI run keeps no logs.
        story = [f"{e['kind']}: {e['message']}" for e in events
                 if e["kind"].startswith(("migration-", "job-", "node-failed"))]
        raise BenchmarkError(f"the joiners' first steps {firsts} do not show one switch step "
                             f"mid-run: the job finished before the migration switched "
                             f"(raise --steps if it was still under way); the events: "
                             f"{'; '.join(story) or 'none of a migration'}")
    kinds = {e["kind"]: e for e in events}
    done = kinds.get("migration-done")
    if done is None:
        raise BenchmarkError(f"no migration-done event; events: {sorted(kinds)}")
    phase = done["details"]["timings"]

    survivors: dict[str, Any] = {}
    for r in SURVIVORS:
        totals = step_totals(saved[r]["timings"])
        at_switch = [t for t in saved[r]["timings"] if t["step"] == switch]
        # Step 0 pays for first-touch costs; it is no normal step.
        others = [v for s, v in totals.items() if s not in (0, switch)]
        normal = statistics.median(others)
        survivors[str(r)] = {
            "normal_step_s": normal,
            "switch_step_s": totals[switch],
            "switch_boundary_s": sum(t["boundary"] for t in at_switch),
            "switch_compute_s": sum(t["compute"] for t in at_switch),
            "downtime_s": totals[switch] - normal,
            "excess_around_switch_s": sum(totals[switch + k] - normal for k in AROUND
                                          if switch + k in totals),
            "slowest_other_step_s": max(others),
            "slowest_other_step": max((s for s in totals if s not in (0, switch)),
                                      key=totals.__getitem__),
            "redone": saved[r]["redone"],
        }
    joiners = {}
    for r in LEAVERS:
        totals = step_totals(saved[r]["timings"])
        first = saved[r]["timings"][0]
        joiners[str(r)] = {
            "first_step_s": totals[switch], "first_step_compute_s": first["compute"],
            "normal_step_s": statistics.median([v for s, v in totals.items() if s != switch]),
        }

    transfers: dict[str, Any] = {}
    ahead: dict[str, Any] = {}
    for rec in logs["node-b"]:
        m = SENT_AHEAD.search(str(rec.get("event", "")))
        if m:
            ahead[m["rank"]] = m
    for rec in logs["node-b"]:
        m = HANDED_OFF.search(str(rec.get("event", "")))
        if m and m["rank"] in ahead:
            # The state crossed before the switch: its figures are the state's, and what
            # crossed at the switch (RNGs, counters) is kept apart.
            a, seconds = ahead[m["rank"]], float(ahead[m["rank"]]["ms"]) / 1e3
            transfers[m["rank"]] = {
                "step": int(a["step"]), "payload_bytes": int(a["bytes"]),
                "entries": int(a["entries"]), "seconds": seconds,
                "mb_per_s": int(a["bytes"]) / seconds / 1e6 if seconds > 0 else 0.0,
                "chunks": int(a["chunks"]), "chunk_bytes": int(a["chunk_bytes"]),
                "manifest_bytes": int(a["manifest"]), "logged_at": wall(rec),
                "leaver_rss_mib": rss_mib(str(rec.get("event", ""))),
                "sent_ahead": True, "steps_forwarded": int(a["steps"] or 0),
                "steps_bytes": int(a["step_bytes"] or 0),
                "steps_seconds": float(a["step_ms"] or 0) / 1e3,
                "at_switch_bytes": int(m["bytes"]), "at_switch_seconds": float(m["ms"]) / 1e3,
                "switch_step": int(m["step"])}
        elif m:
            seconds = float(m["ms"]) / 1e3
            transfers[m["rank"]] = {
                "step": int(m["step"]), "payload_bytes": int(m["bytes"]),
                "entries": int(m["entries"]), "seconds": seconds,
                "mb_per_s": int(m["bytes"]) / seconds / 1e6 if seconds > 0 else 0.0,
                "chunks": int(m["chunks"]), "chunk_bytes": int(m["chunk_bytes"]),
                "manifest_bytes": int(m["manifest"]), "logged_at": wall(rec),
                "leaver_rss_mib": rss_mib(str(rec.get("event", "")))}
    for node in STANDBYS:
        for rec in logs[node]:
            m = TOOK_OVER.search(str(rec.get("event", "")))
            if m and m["rank"] in transfers:
                transfers[m["rank"]]["joiner_receive_s"] = float(m["ms"]) / 1e3
                transfers[m["rank"]]["joiner_rss_mib"] = rss_mib(str(rec.get("event", "")))
    if set(transfers) != {str(r) for r in LEAVERS}:
        raise BenchmarkError(f"hand-off log lines found for ranks {sorted(transfers)} only")

    # When did rank 0 switch, and which of its steps ran while phase 1 did? Walk its step
    # durations back from the log time of the switch (the end of the switch step's boundary).
    switched_at = next((wall(rec) for rec in logs["node-a"] if rec.get("rank") == 0
                        and SWITCHED.search(str(rec.get("event", "")))), None)
    if switched_at is None or "ready" not in phase:
        raise BenchmarkError("rank 0 never logged its switch, or the migration was never "
                             f"ready: {phase}")
    # No untimed work lies between two steps of the loop; before step 0 lies the job's build.
    totals0 = step_totals(saved[0]["timings"])
    end = switched_at - survivors["0"]["switch_boundary_s"]  # the end of step switch-1
    planned_at = kinds["migration-planned"]["time"]
    ready_at = kinds.get("migration-ready", {}).get("time", planned_at + phase["ready"])
    during, before = [], 0
    for s in range(switch - 1, -1, -1):
        if planned_at < end <= ready_at:
            during.append(totals0[s])
        before += end <= planned_at
        end -= totals0[s]
    chosen = [wall(rec) for node in STANDBYS for rec in logs[node]
              if str(rec.get("event", "")).startswith("Standby chosen to take over rank")]
    hand_off_end = max(t["logged_at"] for t in transfers.values())
    return {
        "switch_step": switch,
        "downtime_s": max(s["downtime_s"] for s in survivors.values()),
        "excess_around_switch_s": max(s["excess_around_switch_s"] for s in survivors.values()),
        "survivors": survivors,
        "joiners": joiners,
        "phases_s": phase,
        "phase1_s": phase["ready"] - phase["planned"],
        "phase1_steps": {"count": len(during),
                         "median_step_s": statistics.median(during) if during else None},
        # 0 means the drain came before the job's first step (it was still building).
        "steps_before_planned": before,
        "training_started_before_planned_s": planned_at - end,
        # The joiners' side of planned -> preparing: noticing the plan, then building the job.
        "planned_to_chosen_s": max(chosen) - planned_at if len(chosen) == 2 else None,
        "transfers": transfers,
        # The survivors wait for word of the transfer through the daemons and etcd.
        "hand_off_to_switch_s": switched_at - hand_off_end,
    }
