"""Goodput benchmark: a long run through a volatile trace, under understudy and torchrun + DCP.

One command, real processes, both systems one after the other in the same invocation. A seeded
schedule (``volatile.schedule``) lays interruptions over a window of ``--duration`` seconds, one
every ``--mean-interval`` seconds on average (gaps uniform in [0.5, 1.5] x the mean), each a
planned drain (with notice) or a crash (kill -9 of a rank's worker, no notice). The same
schedule, at the same offsets from the start of the window, is applied to:

- **understudy**: a local cluster set up as ``benchmarks/recovery.py`` does (embedded etcd;
  ``node-a``, the controller, and ``node-b`` with two slots each; two standby nodes warmed in
  the sandbox) running the plain-PyTorch job TP=2 x DP=2 with ``--standby 2``. Drain:
  ``understudy drain NODE`` of the node holding the most ranks (never the controller's). Crash:
  kill -9 of the rank's worker. Each event uses standbys up, and the cluster must have them
  again for the next one: **the benchmark provides the capacity**, as a cloud's autoscaler or
  the cluster's scheduler would. Once an event is served (the migration or recovery done, every
  rank training again), a node left holding no rank (the drained node; one whose only rank
  crashed and moved) leaves (its daemon stops), and one fresh standby node (a new daemon) joins
  for every standby the event used; the event counts as served when the job's pool holds its two
  standbys again and both are warm, as at the start.
- **torchrun**: two elastic agents of two workers each (``benchmarks/baseline/``), DCP every
  ``--ckpt-every`` steps, the drain handler. Drain: SIGTERM to the newest agent that does not
  host the rendezvous store, and a replacement agent once it has left. Crash: kill -9 of the
  rank's worker; its agent restarts the group in place. Served: every rank trains again in a
  process started after the event.

An event fires at its offset, or, if the previous one is not served yet, as soon as it is
(interruptions here do not overlap); the delay is recorded. From the per-step lines
(``steplog``, ``volatile.goodput``): goodput = useful steps x normal step / window, useful steps the
distinct steps whose last completion falls inside the window; per event, its downtime, steps
redone and time lost. Prints a summary, writes JSON (machine, load, command, configuration, the
schedule, every event) and a timeline PNG. Every process it starts is stopped on exit, Ctrl-C and
SIGTERM included.

    .venv/bin/python benchmarks/goodput.py [--seed S] [--duration S] [--mean-interval S] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
import interruptions
import psutil
import steplog
import volatile
from baseline.elastic import ElasticRun, TorchrunConfig, TorchrunError, torchrun_setup
from harness import PROCESS_ENV, BenchmarkError, RecordTail, Table, ratio, summarize, wait
from interruptions import JOB, TP, WORLD
from steplog import compare_losses, losses

from understudy.common.errors import UnderstudyError

SYSTEMS = ("understudy", "torchrun")
STANDBY_POOL = 2
#: The window starts once every rank has committed this step (first touches are paid).
WARM_STEP = steplog.WARMUP_STEPS
#: torchrun restarts a group at most this often in one run (every crash is a restart).
MAX_RESTARTS = 1000
#: Seconds for one event to be served before the run is declared broken.
SERVE_TIMEOUT = 300.0
#: The smoke mode's fixed schedule: one event of each kind, the crash early in its window. The
#: drain fires late when the crash is not served yet: under understudy once the crash's fresh
#: standby is warm (3.6 s after the crash here at load 2 and at load 7, 15 s at load 11, 22 s at
#: load 21), under torchrun once its group has restarted (7-20 s). The run goes on until it is
#: served.
SMOKE_SCHEDULE = (volatile.Event(0, 1.0, "crash", 1), volatile.Event(1, 5.0, "drain"))
#: The smoke mode's window. The smoke run checks that every kind of event is served and
#: measured, so no event of its schedule is left out: when one fires late (the crash served
#: after more than 16 s, as under a CI machine's load) the window stretches to end
#: ``SMOKE_AFTER_LAST`` seconds after it fired, and the run records by how much.
SMOKE_DURATION = 17.0
SMOKE_AFTER_LAST = 2.0


@dataclass(frozen=True)
class BenchConfig:
    repeats: int
    systems: tuple[str, ...]
    seed: int
    duration: float
    mean_interval: float
    drain_fraction: float
    step_sleep: float
    ckpt_every: int
    ckpt_mode: str
    ttl: int
    keepalive_interval_s: int
    keepalive_attempts: int
    smoke: bool

    @property
    def steps(self) -> int:
        """More than the job can reach before the run stops it."""
        return int((self.duration + 900) / max(self.step_sleep, 0.01))


class Progress:
    """The newest committed step of each rank, and by which process, from the step lines
    (read incrementally: polling must not load the machine it measures)."""

    def __init__(self, tail: RecordTail) -> None:
        self.tail = tail
        #: rank -> (time, step, pid) of its newest step line
        self.newest: dict[int, tuple[float, int, int]] = {}
        #: pid -> wall time the process started (torchrun's workers say so)
        self.started: dict[int, float] = {}

    def poll(self) -> None:
        for r in self.tail.poll():
            if r.get("kind", "step") == "step":
                if r["t"] >= self.newest.get(r["rank"], (0.0, 0, 0))[0]:
                    self.newest[r["rank"]] = (r["t"], r["step"], r["pid"])
            elif r.get("kind") == "start":
                self.started[r["pid"]] = r["at"]

    def all_past(self, step: int) -> bool:
        self.poll()
        return len(self.newest) == WORLD and all(s >= step for _, s, _ in self.newest.values())

    def all_after(self, t: float, pids_ok: Callable[[int], bool] = lambda _: True) -> bool:
        """Every rank has committed a step after ``t``, in a process ``pids_ok`` accepts."""
        self.poll()
        return len(self.newest) == WORLD and all(
            at > t and pids_ok(pid) for at, _, pid in self.newest.values())

    def pid_of(self, rank: int) -> int:
        self.poll()
        if rank not in self.newest or not psutil.pid_exists(self.newest[rank][2]):
            raise BenchmarkError(f"no live process holds rank {rank}")
        return self.newest[rank][2]


# -- understudy --------------------------------------------------------------------------------


class UnderstudyTrace:
    """The job under understudy on a local cluster; events and the capacity they use."""

    def __init__(self, cfg: BenchConfig, base: Path) -> None:
        self.rcfg = interruptions.RecoveryConfig(
            repeats=1, steps=cfg.steps, step_sleep=cfg.step_sleep,
            crash_at=interruptions.LOG_EVERY, ttl=cfg.ttl, smoke=cfg.smoke, sandbox=True,
            step_log=True)
        self.base = base
        self.etcd, self.cluster = harness.new_cluster(base, cfg.ttl)
        self.progress = Progress(RecordTail(base / "steps"))
        self.joined: list[str] = []
        self.left: list[str] = []

    def start(self) -> None:
        harness.start_etcd(self.etcd, self.cluster)
        interruptions.bring_up(self.cluster)
        interruptions.submit(self.cluster, self.rcfg, self.base / "out")  # the standbys are warm
        wait(f"every rank to commit step {WARM_STEP}", lambda: self.progress.all_past(WARM_STEP),
             timeout=300, interval=0.2)

    def _job(self) -> Any:
        job = self.cluster.status().job(JOB)
        if job is None or job.assignment is None:
            raise BenchmarkError("the job has no assignment")
        return job

    def fire(self, ev: volatile.Event) -> dict[str, Any]:
        job = self._job()
        ranks = job.assignment.ranks
        if ev.kind == "crash":
            pid = self.progress.pid_of(ev.rank)
            t = time.time()
            os.kill(pid, signal.SIGKILL)
            return {"fired_at": t, "target": f"rank {ev.rank} (pid {pid}) on {ranks[ev.rank]}",
                    "node": ranks[ev.rank], "lost_ranks": [ev.rank]}
        controller = self.cluster.status().controller
        held = {n: ranks.count(n) for n in set(ranks) if n != controller}
        node = min(held, key=lambda n: (-held[n], n))
        t = time.time()
        res = self.cluster.cli("drain", node, "--deadline", "300")
        if res.returncode != 0:
            raise BenchmarkError(f"understudy drain {node} failed: {res.stdout}{res.stderr}")
        return {"fired_at": t, "target": node, "node": node,
                "lost_ranks": [r for r, n in enumerate(ranks) if n == node]}

    def serve(self, ev: volatile.Event, fired: dict[str, Any]) -> dict[str, Any]:
        t_fire = fired["fired_at"]
        seen: dict[str, Any] = {}

        def migrated() -> bool:
            job = self.cluster.status().job(JOB)
            m = job.migration if job is not None else None
            if job is None or job.state != "running" or m is None or m.created_at < t_fire - 1:
                return False
            seen["m"] = m
            return str(m.phase) == "done" and not (job.status and job.status.paused)

        wait(f"the job to migrate or recover after event {ev.index}", migrated, SERVE_TIMEOUT,
             interval=0.5)
        m = seen["m"]
        done_at = m.timings.get("done", time.time())
        wait("every rank to train again", lambda: self.progress.all_after(done_at), 120,
             interval=0.1)
        full_at = time.time()
        self._restore_capacity(fired["node"])
        return {"served_at": full_at, "capacity_back_at": time.time(), "migration": m.id,
                "migration_kind": m.kind, "joiners": list(m.joiners),
                "migration_done_at": done_at}

    def _restore_capacity(self, hit: str) -> None:
        """Nodes holding no rank leave; fresh standbys join until the pool is full and warm."""
        status = self.cluster.status()
        job = status.job(JOB)
        assert job is not None and job.assignment is not None
        a = job.assignment
        for name, d in list(self.cluster.daemons.items()):
            if not d.alive() or name == status.controller or name in a.ranks \
                    or name in a.standbys:
                continue
            if name == hit:  # the drained node finishes its drain first
                self.cluster.wait_for(f"{name} to be drained or idle", lambda s, n=name: (
                    (x := s.node(n)) is not None and x.state in ("drained", "active",
                                                                 "standby")), timeout=120)
            harness.retire(d)
            self.left.append(name)
        missing = STANDBY_POOL - sum(1 for n in a.standbys if self.cluster.daemons[n].alive())
        new = interruptions.add_standbys(self.cluster, missing, self.joined)

        def full() -> bool:
            j = self.cluster.status().job(JOB)
            pool = j.assignment.standbys if j is not None and j.assignment else ()
            return len(pool) == STANDBY_POOL and all(
                "Standby is warm (" in self.cluster.daemons[n].log_text() for n in pool)

        wait(f"the standby pool to be full and warm again ({', '.join(new) or 'no new node'})",
             full, SERVE_TIMEOUT, interval=0.5)

    def stop(self) -> dict[str, Any]:
        tracebacks = sum(harness.tracebacks(self.cluster).values())
        harness.stop_cluster(self.etcd, self.cluster)
        return {"daemon_log_tracebacks": tracebacks, "standbys_joined": self.joined,
                "nodes_left": self.left}

    def records(self) -> list[dict[str, Any]]:
        self.progress.poll()
        return self.progress.tail.records


# -- torchrun ----------------------------------------------------------------------------------


class TorchrunTrace:
    """The job under torchrun elastic agents; drains replace the drained agent."""

    def __init__(self, cfg: BenchConfig, base: Path) -> None:
        tcfg = TorchrunConfig(steps=cfg.steps, step_sleep=cfg.step_sleep,
                              ckpt_every=cfg.ckpt_every, ckpt_mode=cfg.ckpt_mode,
                              drain_notice=True, max_restarts=MAX_RESTARTS,
                              keepalive_interval_s=cfg.keepalive_interval_s,
                              keepalive_attempts=cfg.keepalive_attempts)
        self.run = ElasticRun(tcfg, base)
        self.progress: Progress | None = None

    def start(self) -> None:
        self.run.start()
        assert self.run.tail is not None
        self.progress = Progress(self.run.tail)
        wait(f"every rank to commit step {WARM_STEP}", lambda: self.progress is not None
             and self.progress.all_past(WARM_STEP), timeout=300, interval=0.2)

    def fire(self, ev: volatile.Event) -> dict[str, Any]:
        assert self.progress is not None
        if ev.kind == "crash":
            pid = self.progress.pid_of(ev.rank)
            t = time.time()
            os.kill(pid, signal.SIGKILL)
            return {"fired_at": t, "target": f"rank {ev.rank} (pid {pid})",
                    "lost_ranks": [ev.rank]}
        victim = [a for a in self.run.agents if a.index != 0 and a.proc.poll() is None][-1]
        lost = self.run.ranks_of(victim)
        try:
            t, left, spare = self.run.drain(victim)
        except TorchrunError as exc:
            raise BenchmarkError(f"torchrun drain: {exc}") from exc
        return {"fired_at": t, "target": f"agent {victim.index}", "lost_ranks": lost,
                "drained_agent_left_s": left - t, "replacement_agent": spare.index}

    def serve(self, ev: volatile.Event, fired: dict[str, Any]) -> dict[str, Any]:
        assert self.progress is not None
        progress, t_fire = self.progress, fired["fired_at"]

        def restarted(pid: int) -> bool:
            return progress.started.get(pid, 0.0) > t_fire

        wait(f"every rank to train again after event {ev.index}",
             lambda: progress.all_after(t_fire, restarted), SERVE_TIMEOUT, interval=0.1)
        return {"served_at": time.time()}

    def stop(self) -> dict[str, Any]:
        self.run.stop()
        return {"agents_started": len(self.run.agents)}

    def records(self) -> list[dict[str, Any]]:
        assert self.progress is not None
        self.progress.poll()
        return self.progress.tail.records


# -- the run -----------------------------------------------------------------------------------


class LoadSampler:
    """The 1-minute load average every few seconds, on a thread of its own (named, stopped by
    ``stop``, joined with a bound)."""

    def __init__(self, interval: float = 5.0) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)
        self._cpu0 = psutil.cpu_times()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), os.getloadavg()[0]))
            self._stop.wait(self._interval)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=self._interval + 1)
        cpu1 = psutil.cpu_times()
        busy0 = sum(self._cpu0) - self._cpu0.idle - getattr(self._cpu0, "iowait", 0.0)
        busy1 = sum(cpu1) - cpu1.idle - getattr(cpu1, "iowait", 0.0)
        total = sum(cpu1) - sum(self._cpu0)
        loads = [x for _, x in self.samples] or [os.getloadavg()[0]]
        return {"loadavg_1m": summarize(loads),
                "machine_cpu_busy_percent": 100 * (busy1 - busy0) / total if total > 0 else None}


def run_system(system: str, events: list[volatile.Event], cfg: BenchConfig,
               base: Path) -> dict[str, Any]:
    sut: UnderstudyTrace | TorchrunTrace = (UnderstudyTrace(cfg, base) if system == "understudy"
                                            else TorchrunTrace(cfg, base))
    load = LoadSampler().start()
    fired: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        sut.start()
        start = time.time()
        end = start + cfg.duration
        for ev in events:
            target = start + ev.at
            if time.time() >= end and not cfg.smoke:  # served so late that the window is
                break                                     # over: no more events
            time.sleep(max(0.0, target - time.time()))
            rec: dict[str, Any] = {**ev.as_json(), "scheduled_at": target}
            rec.update(sut.fire(ev))
            rec["late_s"] = rec["fired_at"] - target
            fired.append(rec)
            if cfg.smoke:
                end = max(end, rec["fired_at"] + SMOKE_AFTER_LAST)
            rec.update(sut.serve(ev, rec))
            late = f" ({rec['late_s']:.1f}s late)" if rec["late_s"] > 0.5 else ""
            print(f"  {system} event {ev.index + 1}/{len(events)} ({ev.kind} "
                  f"{rec['target']}) at {rec['fired_at'] - start:.1f}s{late}: served after "
                  f"{rec['served_at'] - rec['fired_at']:.1f}s; load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
        time.sleep(max(0.0, end - time.time()) + 1.0)  # the window, and a step past it
        records = list(sut.records())  # a copy: the tail's list grows as it is polled
        later = records
        # An event served near the window's end (torchrun's restart under load) is measured
        # once the job is past the step it was at when the event came: the run goes on until
        # then, SERVE_TIMEOUT at most. The goodput is the window's alone.
        deadline = time.monotonic() + SERVE_TIMEOUT
        while not _past_every_event(later, fired) and time.monotonic() < deadline:
            time.sleep(0.5)
            later = list(sut.records())
    finally:
        extra = sut.stop()
        machine_load = load.stop()
    done = steplog.completions(records, WORLD)
    figures = volatile.goodput(done, start, end, fired)
    by_index = {e["index"]: e for e in figures.pop("events")}
    if later is not records:
        for e in volatile.goodput(steplog.completions(later, WORLD), start, end,
                                  fired)["events"]:
            if "error" in by_index[e["index"]] and "error" not in e:
                by_index[e["index"]] = {**e, "measured_after_the_window": True}
    for rec in fired:
        rec.update({k: v for k, v in by_index[rec["index"]].items() if k not in rec})
        for k in ("scheduled_at", "fired_at", "served_at", "capacity_back_at",
                  "migration_done_at"):
            if rec.get(k) is not None:
                rec[f"{k.removesuffix('_at')}_s"] = rec.pop(k) - start
    timeline = [[round(c.t - start, 3), c.step] for c in done]
    figures["step_split"] = volatile.step_split(
        [(c.t - start, c.step) for c in done], 0.0, end - start,
        busy=[(e["served_s"], e["capacity_back_s"]) for e in fired if "capacity_back_s" in e],
        down=[(e["fired_s"], e["served_s"]) for e in fired if "served_s" in e])
    figures["window_stretched_s"] = end - start - cfg.duration
    return {"system": system, **figures, "events_scheduled": len(events), "events": fired,
            "losses": losses(records), "wall_s": time.monotonic() - t0, "load": machine_load,
            **extra, "timeline": timeline}


def _past_every_event(records: Any, fired: list[dict[str, Any]]) -> bool:
    """Whether the job completed, after each fired event, a step past the last one it had
    completed before it."""
    done = sorted(steplog.completions(records, WORLD), key=lambda c: c.t)
    for rec in fired:
        before = [c for c in done if c.t < rec["fired_at"]]
        if before and not any(c.step > before[-1].step for c in done[len(before):]):
            return False
    return True


def make_schedule(cfg: BenchConfig) -> list[volatile.Event]:
    if cfg.smoke:
        return list(SMOKE_SCHEDULE)
    return volatile.schedule(cfg.seed, cfg.duration, cfg.mean_interval, cfg.drain_fraction, WORLD)


def run_repeat(i: int, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    events = make_schedule(cfg)
    rep: dict[str, Any] = {"repeat": i}
    for system in cfg.systems:
        r = rep[system] = run_system(system, events, cfg, base / system)
        print(f"  repeat {i + 1}/{cfg.repeats} {system}: goodput {100 * r['goodput']:.1f} %, "
              f"{r['useful_steps']} useful steps, {r['steps_redone']} redone, downtime "
              f"{r['total_downtime_s']:.1f}s over {r['events_served']}/{len(events)} events"
              + (f" in a window stretched by {r['window_stretched_s']:.1f}s"
                 if r["window_stretched_s"] > 0 else "")
              + f"; {r['wall_s']:.0f}s, load {r['load']['loadavg_1m']['median']:.1f}",
              file=sys.stderr, flush=True)
    if set(SYSTEMS) <= set(cfg.systems):
        u, t = (rep[s].pop("losses") for s in SYSTEMS)
        rep["losses_understudy_vs_torchrun"] = compare_losses(u, t)
    else:
        for s in cfg.systems:
            rep[s].pop("losses")
    return rep


def collect(repeats: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Medians and spreads: over the repeats for the run's figures, over every event of every
    repeat for the per-event ones (by kind)."""
    out: dict[str, Any] = {}
    for system in cfg.systems:
        rs = [r[system] for r in repeats]
        evs = [e for r in rs for e in r["events"]]
        per_kind = {}
        for kind in volatile.KINDS:
            mine = [e for e in evs if e["kind"] == kind and "downtime_s" in e]
            if mine:
                per_kind[kind] = {k: summarize([e[k] for e in mine]) for k in (
                    "downtime_s", "steps_redone", "time_lost_s")}
                per_kind[kind]["served_after_s"] = summarize(
                    [e["served_s"] - e["fired_s"] for e in mine])
        out[system] = {
            **{k: summarize([r[k] for r in rs]) for k in (
                "goodput", "useful_steps", "steps_redone", "total_downtime_s",
                "total_time_lost_s", "other_loss_s", "normal_step_s", "events_served")},
            "events_fired": summarize([r["events_fired"] for r in rs]),
            "late_s": summarize([e["late_s"] for e in evs]) if evs else None,
            "events_late": sum(1 for e in evs if e["late_s"] > 0.5),
            "per_kind": per_kind,
            "loadavg_1m": summarize([x for r in rs for x in (r["load"]["loadavg_1m"]["min"],
                                                             r["load"]["loadavg_1m"]["max"])]),
        }
    if set(SYSTEMS) <= set(cfg.systems):
        u, t = out["understudy"], out["torchrun"]
        out["ratio"] = {
            "goodput_understudy_over_torchrun": ratio(u["goodput"]["median"],
                                                      t["goodput"]["median"]),
            "useful_steps_understudy_over_torchrun": ratio(u["useful_steps"]["median"],
                                                           t["useful_steps"]["median"]),
            "downtime_torchrun_over_understudy": ratio(t["total_downtime_s"]["median"],
                                                       u["total_downtime_s"]["median"]),
        }
        out["losses_identical"] = all(
            r["losses_understudy_vs_torchrun"]["identical"]
            == r["losses_understudy_vs_torchrun"]["compared"] for r in repeats)
    return out


def print_summary(result: dict[str, Any]) -> None:
    cfg, m, s = result["config"], result["machine"], result["summary"]
    kinds = [e["kind"] for e in result["schedule"]]
    print(f"\ngoodput: TP2 x DP2 plain job, {cfg['repeats']} repeat(s), window "
          f"{cfg['duration']:.0f} s, {len(kinds)} events ({kinds.count('drain')} drains, "
          f"{kinds.count('crash')} crashes; seed {cfg['seed']}, mean interval "
          f"{cfg['mean_interval']:.0f} s); torchrun "
          f"checkpoints every {cfg['ckpt_every']} steps ({cfg['ckpt_mode']} DCP); on "
          f"{m['cpus_usable']} CPUs, torch {m['torch']}")

    table = Table(44, count_always=True)
    row = table.row
    table.header()
    for system in cfg["systems"]:
        x = s[system]
        row(f"{system}: goodput", x["goodput"], "%", 100)
        row("  useful steps", x["useful_steps"], "steps")
        row("  normal step", x["normal_step_s"], "ms", 1e3)
        row("  steps redone", x["steps_redone"], "steps")
        row("  total downtime", x["total_downtime_s"], "s")
        row("  total time lost (downtime + redone)", x["total_time_lost_s"], "s")
        row("  other loss (slower steps)", x["other_loss_s"], "s")
        for part, label in (("while_busy", "fresh standbys warming"), ("elsewhere", "elsewhere")):
            v = [r[system]["step_split"][part] for r in result["repeats"]]
            if all(v):
                row(f"  mean step, {label}", summarize([p["mean_s"] for p in v]), "ms", 1e3)
        row("  events served", x["events_served"], "events")
        for kind, k in x["per_kind"].items():
            row(f"  {kind}: downtime per event", k["downtime_s"], "s")
            row(f"  {kind}: steps redone per event", k["steps_redone"], "steps")
            row(f"  {kind}: event -> served", k["served_after_s"], "s")
        row("  event fired late by", x["late_s"], "s")
        row("  1-minute load average", x["loadavg_1m"], "")
    if "ratio" in s:
        r = s["ratio"]
        fmt = (lambda v: "n/a" if v is None else f"{v:.2f}x")  # noqa: E731
        print(f"  understudy / torchrun goodput {fmt(r['goodput_understudy_over_torchrun'])}, "
              f"useful steps {fmt(r['useful_steps_understudy_over_torchrun'])}; torchrun / "
              f"understudy downtime {fmt(r['downtime_torchrun_over_understudy'])}; same losses "
              f"in both: {s['losses_identical']}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Steps completed over the window for each system (the first repeat), the events marked
    at the moment each system got them (marker and colour by kind), each event's span from
    fired to served shaded on its system's strip."""
    plt = harness.pyplot()
    cfg, rep = result["config"], result["repeats"][0]
    systems = cfg["systems"]
    colors = {"understudy": "#2a7ab0", "torchrun": "#d0702a"}
    kind_style = {"drain": ("v", "#2e8b57"), "crash": ("X", "#c0392b")}
    window = max(rep[system]["window_s"] for system in systems)
    fig, axes = plt.subplots(1 + len(systems), 1, figsize=(13, 6.5), sharex=True,
                             gridspec_kw={"height_ratios": [4] + [0.6] * len(systems)})
    ax = axes[0]
    for system in systems:
        r = rep[system]
        pts = [p for p in r["timeline"] if -5 <= p[0] <= window + 1]
        base = next((p[1] for p in pts if p[0] >= 0), 0)
        ax.plot([p[0] for p in pts], [p[1] - base for p in pts], lw=1.2, color=colors[system],
                label=f"{system}: goodput {100 * r['goodput']:.1f} %, {r['useful_steps']} "
                      f"useful steps, {r['steps_redone']} redone, downtime "
                      f"{r['total_downtime_s']:.1f} s")
        for e in r["events"]:
            marker, c = kind_style[e["kind"]]
            ax.axvline(e["fired_s"], color=c, lw=0.6, alpha=0.5, ls=":")
    ax.set_ylabel("steps completed since the window opened")
    ax.set_xlim(-2, window + 2)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"Goodput over a volatile trace: {len(result['schedule'])} events in "
                 f"{window:.0f} s (seed {cfg['seed']})", fontsize=10)
    for bx, system in zip(axes[1:], systems, strict=True):
        for e in rep[system]["events"]:
            marker, c = kind_style[e["kind"]]
            if e.get("served_s") is not None:
                bx.axvspan(e["fired_s"], e["served_s"], color=c, alpha=0.25)
            bx.plot([e["fired_s"]], [0.5], marker=marker, color=c, ms=8, ls="none")
        bx.set_yticks([])
        bx.set_ylabel(system, rotation=0, ha="right", va="center", fontsize=8)
        bx.set_ylim(0, 1)
    handles = [plt.Line2D([], [], marker=m, color=c, ls="none", label=k)
               for k, (m, c) in kind_style.items()]
    axes[-1].legend(handles=handles, loc="lower right", fontsize=7, ncol=2)
    axes[-1].set_xlabel("seconds since the window opened (shaded: event fired -> served)")
    fig.suptitle(f"{result['machine']['cpus_usable']} CPUs, TP2 x DP2 plain job, torchrun "
                 f"checkpoints every {cfg['ckpt_every']} steps ({cfg['ckpt_mode']} DCP)",
                 fontsize=8)
    harness.save_chart(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("goodput", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per system, each through the same schedule (default 1)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default: both)")
    p.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    p.add_argument("--duration", type=float,
                   help=f"seconds of the measured window per system (default 600; smoke "
                        f"{SMOKE_DURATION:.0f})")
    p.add_argument("--mean-interval", type=float, default=45.0,
                   help="mean seconds between events, at most 60 (default 45)")
    p.add_argument("--drain-fraction", type=float, default=0.5,
                   help="share of the events that are planned drains (default 0.5)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the other "
                        "benchmarks)")
    p.add_argument("--ckpt-every", type=int, default=20,
                   help="torchrun's checkpoint cadence in steps (default 20)")
    harness.side_by_side_options(p)
    p.add_argument("--smoke", action="store_true",
                   help=f"a {SMOKE_DURATION:.0f} s window and two fixed events (a crash of rank 1 "
                        f"at {SMOKE_SCHEDULE[0].at:.0f} s, a drain at {SMOKE_SCHEDULE[1].at:.0f} "
                        "s; the window stretches to hold both when the crash is served late): "
                        "for the tests")
    p.outputs(keep="keep logs, step lines and checkpoints here", chart="timeline")
    args = p.parse(argv, {"duration": (600.0, SMOKE_DURATION)})
    args.systems = tuple(x.strip() for x in args.systems.split(",") if x.strip())
    if not args.systems or set(args.systems) - set(SYSTEMS):
        p.error(f"--systems must name some of {', '.join(SYSTEMS)}, got {args.systems}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if not 0 < args.mean_interval <= 60:
        p.error(f"--mean-interval must be within (0, 60] seconds, got {args.mean_interval}")
    if args.duration < (2 * SMOKE_SCHEDULE[-1].at if args.smoke else 2 * args.mean_interval):
        p.error(f"--duration must hold a few events, got {args.duration}")
    if not 0 <= args.drain_fraction <= 1:
        p.error(f"--drain-fraction must be within [0, 1], got {args.drain_fraction}")
    harness.check_side_by_side(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(repeats=args.repeats, systems=args.systems, seed=args.seed,
                      duration=args.duration, mean_interval=args.mean_interval,
                      drain_fraction=args.drain_fraction, step_sleep=args.step_sleep,
                      ckpt_every=args.ckpt_every, ckpt_mode=args.ckpt_mode, ttl=args.ttl,
                      keepalive_interval_s=args.keepalive[0],
                      keepalive_attempts=args.keepalive[1], smoke=args.smoke)
    os.environ.update(PROCESS_ENV)  # every process it starts inherits it
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-goodput-")
    schedule = make_schedule(cfg)
    print(f"goodput: {len(schedule)} events over {cfg.duration:.0f} s per system: "
          + ", ".join(f"{e.kind}@{e.at:.0f}s" for e in schedule), file=sys.stderr, flush=True)
    repeats = scratch.repeats("goodput benchmark", cfg.repeats,
                              lambda i, d: run_repeat(i, cfg, d),
                              (OSError, UnderstudyError, ValueError, TorchrunError,
                               psutil.Error))
    if isinstance(repeats, int):
        return repeats
    result = {
        **harness.header("goodput", scratch.started, torch=True),
        "config": {**asdict(cfg), "steps": cfg.steps, "tp": TP,
                   "dp": WORLD // TP, "understudy_standby": STANDBY_POOL,
                   "job": "examples/plain_torch/train.py", "threads_per_process": 1,
                   "warm_step": WARM_STEP,
                   "torchrun": torchrun_setup(MAX_RESTARTS),
                   "goodput": "useful steps (distinct steps whose last completion is in the "
                              "window) x normal step (median gap in the window) / window",
                   "downtime": "per event: the longest gap between completions from the event "
                               "to served - normal step"},
        "schedule": [e.as_json() for e in schedule],
        "summary": collect(repeats, cfg),
        "chart": str(args.png),
        "repeats": repeats,
    }
    harness.report(result, args.out, print_summary, plot, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
