"""Downtime benchmark: what one interruption costs under understudy, torchrun + DCP and torchft.

One command, real processes, every system in the same run (``--systems`` picks some). For each
event type and each repeat, the plain-PyTorch example's job (``examples/plain_torch/train.py``:
same model, seed, data, TP=2 x DP=2 on gloo) runs once under each system and is hit once, after
``--event-at`` steps:

- **understudy**: a fresh local cluster (embedded etcd; ``node-a`` and ``node-b``, two slots
  each; two standby nodes, warmed in the sandbox), as ``benchmarks/recovery.py`` sets it up
  (``benchmarks/interruptions.py``).
  Planned drain: ``understudy drain node-b`` (its two ranks move live to the standbys). Worker
  crash: kill -9 of rank 1's worker. Node loss: kill -9 of ``node-b``'s daemon and workers at
  once (the controller's probe finds its port closed and revokes its lease). Silent node:
  ``node-b``'s daemon and workers frozen with SIGSTOP and left so: nothing dies and no
  connection closes, as when a machine loses power or its switch port (the probes go
  unanswered). The crash and node-loss scenarios are ``interruptions.worker_crash`` and
  ``interruptions.node_loss``, as the recovery benchmark runs them.
- **restart-only**: torchrun's job script below (``baseline/torchrun_job.py``), unmodified,
  under ``understudy run --restart-only`` on the understudy system's cluster (its standby nodes
  wait empty): the same events, each restarting every rank from the newest checkpoint, node-b's
  ranks on the standbys where it is lost or drained (``restart_only.py``, ``docs/restart.md``).
  Its phases are read from the script's lines as torchrun's are; the ratio torchrun /
  restart-only is reported beside the others.
- **torchrun**: two elastic agents of two workers each on a c10d rendezvous
  (``benchmarks/baseline/``), the job checkpointing with ``torch.distributed.checkpoint`` every
  ``--ckpt-every`` steps, resuming from the newest checkpoint on restart, with a careful team's
  drain handler. Planned drain: SIGTERM to agent 1 (its ranks and the others save at an agreed
  step and stop; a replacement agent is started once agent 1 has left). Worker crash: kill -9 of
  rank 1's worker. Node loss: kill -9 of agent 1 and its workers, a replacement agent started at
  once. Silent node: agent 1 and its workers frozen (SIGSTOP), a replacement started at once.
- **torchft**: each DP replica (two TP ranks) is one torchft replica group under its own
  torchrun, with a ``Manager`` and a ``Lighthouse`` (``benchmarks/baseline/torchft_run.py``):
  gradients all-reduced across the groups through torchft, a lost group restarted and healed
  live from the other, no checkpoints. Worker crash: kill -9 of rank 1 (its group restarts).
  Node loss: kill -9 of the group of ranks 2 and 3, a replacement started at once (silent
  node: the group frozen instead). Planned
  drain: torchft has no planned-migration path; the group stops gracefully at an agreed step
  and a replacement is started once it has left.

A baseline that does not train again by itself within ``--silent-limit`` seconds of a silent
node has the frozen processes killed then, as an operator would power the machine off (their
connections close, which it does notice); its downtime still counts from the freeze, and the
result records when the kill came (``frozen_killed_after_s``).

Every rank logs a line per committed step; from those lines, the same way for every system
(``benchmarks/steplog.py``): **downtime** = (first step completed after the interruption) -
(last step completed before it) - (one normal step), **steps redone**, **time to full
strength** (until the job completes the step after the last one it had completed before the
interruption) and **time lost** (that minus a normal step). Per-phase split: understudy's from
its logs and events (``interruptions.analyse_recovery``; for the drain ``analyse_drain``: the
switch step's boundary, phase 1 in the background); torchrun's from its workers' lines (restart and
rendezvous, imports, process-group init, build + checkpoint load, first step); torchft's from
its workers' lines (stop, restart, imports, init, quorum + heal, first step). The ratios
torchrun / understudy and torchft / understudy of the medians are reported per event type. The
losses every system logged for the same step are compared: the same job trains the same model.

Prints a summary, writes JSON (machine, command, configuration, every sample) and a PNG. Every
process it starts is stopped on exit, Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/downtime.py [--repeats N] [--events E,...] [--systems S,...]
                                            [--smoke] [--out F]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import harness
import interruptions
import psutil
import restart_only
import steplog
from baseline.elastic import (
    BaselineRun,
    ElasticRun,
    TorchrunConfig,
    TorchrunError,
    torchrun_setup,
)
from baseline.torchft_run import TorchftConfig, TorchftRun
from harness import PROCESS_ENV, BenchmarkError, Table, ratio, read_records, summarize
from interruptions import LOG_EVERY, LOST_NODE, TP, VICTIM, WORLD
from steplog import compare_losses, losses

from understudy.common.errors import UnderstudyError
from understudy.common.sizes import size_arg

EVENTS = ("planned-drain", "worker-crash", "node-loss", "silent-node")
#: The earliest --event-at: the steps before it give the normal step, its first ones left out.
MIN_EVENT_AT = steplog.WARMUP_STEPS + 5
#: Steps a run goes on past its event, at least: a drain switches after phase 1 (at 1 GiB per
#: rank some 20 s, a few steps); a failure's run may redo a torchrun checkpoint interval first.
RUN_ON_DRAIN, RUN_ON = 60, 20
SYSTEMS = ("understudy", "restart-only", "torchrun", "torchft")
#: The baselines whose downtime is divided by understudy's, per event type.
BASELINES = ("torchrun", "torchft")
#: torchrun restarts a group at most this often in one run (a run needs one or two).
MAX_RESTARTS = 10
TORCHRUN_PHASES = ("drain_save", "restart_rendezvous", "imports", "init", "build_load",
                   "first_step")
TORCHFT_PHASES = ("drain_stop", "restart", "imports", "init", "quorum_heal", "first_step")
UNDERSTUDY_PHASES = {
    "planned-drain": ("switch_boundary", "switch_step_rest"),
    "worker-crash": interruptions.PHASES,
    "node-loss": interruptions.PHASES,
    "silent-node": interruptions.PHASES,
}


@dataclass(frozen=True)
class BenchConfig:
    repeats: int
    events: tuple[str, ...]
    steps: int
    step_sleep: float
    #: the event comes once every rank has committed this many steps
    event_at: int
    ckpt_every: int
    ckpt_mode: str
    ttl: int
    keepalive_interval_s: int
    keepalive_attempts: int
    smoke: bool
    systems: tuple[str, ...] = SYSTEMS
    #: the torchft Lighthouse's heartbeat timeout (torchft's default: 5000 ms)
    torchft_heartbeat_ms: int = 5000
    #: silent node: a baseline that does not train again by itself within this many seconds
    #: has its frozen processes killed (see silent_wait)
    silent_limit: float = 60.0
    #: the job's state per rank in bytes (None: the example's own, about 27 KB)
    state_bytes: int | None = None
    #: understudy's drain: the leaver's state sent ahead, or whole at the switch
    hand_off: str = "ahead"
    #: seconds from the commit of step ``event_at`` to understudy's event (mid-step)
    event_delay: float = 0.0
    #: understudy's job stops its compute at an autograd operation once it recovers (the
    #: example's default; False: at its next collective, as every run before git 5da3803)
    interruptible: bool = True


# -- understudy --------------------------------------------------------------------------------


def understudy_drain(rcfg: interruptions.RecoveryConfig, base: Path) -> dict[str, Any]:
    """``understudy drain node-b`` once every rank has committed ``rcfg.crash_at`` steps, on a
    fresh cluster set up as the recovery benchmark's."""
    out = base / "out"
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    with harness.local_cluster(base, rcfg.ttl) as (_, cluster):
        interruptions.bring_up(cluster)
        interruptions.submit(cluster, rcfg, out)
        steps = interruptions.step_log_of(rcfg, out)
        for r in range(WORLD):
            interruptions.wait_committed(cluster, r, rcfg.crash_at, steps)
        time.sleep(rcfg.event_delay)
        drain_at = time.time()
        drain = cluster.cli("drain", LOST_NODE, "--deadline", "300", "--wait", timeout=360)
        if drain.returncode != 0:
            raise BenchmarkError(f"the drain failed: {drain.stdout}{drain.stderr}")
        harness.wait_done(cluster, interruptions.JOB,
                          timeout=interruptions.finish_timeout(rcfg.steps))
        seen = harness.snapshot(cluster)
    figures = interruptions.analyse_drain(out, seen["events"], seen["logs"])
    return {"wall_s": time.monotonic() - t0, "drain_at": drain_at, **figures,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "daemon_log_tracebacks": seen["tracebacks"]}


def run_understudy(event: str, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    rcfg = interruptions.RecoveryConfig(repeats=1, steps=cfg.steps, step_sleep=cfg.step_sleep,
                                        crash_at=cfg.event_at, ttl=cfg.ttl, smoke=cfg.smoke,
                                        sandbox=True, step_log=True,
                                        state_bytes=cfg.state_bytes, hand_off=cfg.hand_off,
                                        event_delay=cfg.event_delay,
                                        interruptible=cfg.interruptible)
    if event == "planned-drain":
        res = understudy_drain(rcfg, base)
        event_at = res["drain_at"]
        survivors = res["survivors"].values()
        phases = {"switch_boundary": max(s["switch_boundary_s"] for s in survivors),
                  "switch_step_rest": max(s["switch_step_s"] - s["switch_boundary_s"]
                                          for s in survivors)}
        details = {k: res[k] for k in ("switch_step", "downtime_s", "phases_s", "phase1_s",
                                       "phase1_steps", "transfers", "hand_off_to_switch_s")}
        details["runtime_downtime_s"] = details.pop("downtime_s")  # the migration benchmark's
        lost = list(interruptions.LEAVERS)
    else:
        res = interruptions.worker_crash(rcfg, base) if event == "worker-crash" else \
            interruptions.node_loss(rcfg, base, silent=event == "silent-node")
        event_at = res["kill_at"]
        phases = dict(res["phases_s"])
        details = {k: res[k] for k in ("end_to_end_s", "milestones_s", "transfers",
                                       "settled_step", "steps_before_failure", "joiners")}
        lost = res["lost_ranks"]
    records = read_records(base / "steps")
    # A victim killed between the job's commit of a step and its own line for it: its
    # replacement holds that step (steplog.taken_over).
    done = steplog.completions(records + steplog.taken_over(records), WORLD)
    normal = steplog.normal_step(done, event_at)
    # The drain's interruption is the switch: its step is the joiners' first.
    if event == "planned-drain":
        inside = next(c.t for c in done if c.step == res["switch_step"]) - 1e-6
    else:
        inside = steplog.failure_inside(records, event_at, lost)
    figures = steplog.interruption(done, event_at, normal, inside)
    return {"system": "understudy", "event": event, "event_at": event_at, "lost_ranks": lost,
            **figures, "phases_s": phases, "details": details, "losses": losses(records),
            "steps_completed": max(c.step for c in done) + 1, "wall_s": res["wall_s"],
            "loadavg_1m_before_after": res["loadavg_1m_before_after"],
            "daemon_log_tracebacks": res["daemon_log_tracebacks"]}


# -- torchrun ----------------------------------------------------------------------------------


def silent_wait(run: BaselineRun, step: int, limit: float,
                frozen_at: float) -> float | None:
    """After a baseline's node was frozen: wait up to ``limit`` s for every rank to train
    ``step`` on its own. None if it did; else the frozen processes are killed (an operator
    powering the silent machine off, which closes their connections) and the seconds from the
    freeze to that kill are returned: the downtime then counts from the freeze all the same."""
    try:
        run.wait_step(step, timeout=limit)
        return None
    except TorchrunError:
        run.kill_frozen()
        return time.time() - frozen_at


def interrupt(run: ElasticRun | TorchftRun, event: str, victim: Any,
              cfg: BenchConfig) -> tuple[list[int], float, float | None, float | None]:
    """``event`` to a baseline's run: a crash of rank :data:`VICTIM`'s worker, or a drain, a
    kill or a freeze of ``victim`` (its agent or replica group). Returns the ranks lost, the
    event's time, when a drained agent had left, and when a frozen one was killed (see
    :func:`silent_wait`)."""
    if event == "worker-crash":
        return [VICTIM], run.kill_worker(VICTIM), None, None
    lost = run.ranks_of(victim)
    if event == "planned-drain":
        event_at, left, _ = run.drain(victim)
        return lost, event_at, left, None
    event_at, _ = run.kill_node(victim, freeze=event == "silent-node")
    powered_off = (silent_wait(run, cfg.event_at, cfg.silent_limit, event_at)
                   if event == "silent-node" else None)
    return lost, event_at, None, powered_off


def restarted_processes(records: list[dict[str, Any]], event_at: float,
                        first_step_at: float) -> list[dict[str, Any]]:
    """Per rank, the start record of its newest process started after the event and before the
    first step: the one that trained on (a restart that failed again leaves older ones
    behind)."""
    newest: dict[int, dict[str, Any]] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        if r.get("kind") == "start" and event_at < r["at"] and r["t"] < first_step_at:
            newest[r["rank"]] = r
    return list(newest.values())


def reached_by_all(records: list[dict[str, Any]], new: list[dict[str, Any]], kind: str,
                   count: int) -> float | None:
    """When the last of the ``new`` processes wrote a ``kind`` record; None unless ``count``
    (> 0) of them did."""
    pids = {r["pid"] for r in new}
    ts = [r["t"] for r in records if r.get("kind") == kind and r["pid"] in pids]
    return max(ts) if count and len(ts) == count else None


def consecutive_phases(marks: list[tuple[str, float | None]],
                       event_at: float) -> dict[str, float | None]:
    """Milestones as phases: each one's time since the previous milestone reached (the event
    for the first); None for a milestone not reached."""
    out: dict[str, float | None] = {}
    prev = event_at
    for name, at in marks:
        if at is None:
            out[name] = None
            continue
        out[name] = at - prev
        prev = at
    return out


def torchrun_phases(records: list[dict[str, Any]], event_at: float, first_step_at: float,
                    drain_exit_at: float | None) -> dict[str, float | None]:
    """The restart's milestones, each the moment the last rank of the new workers reached it
    (the job waits for the slowest), as consecutive phases from the event."""
    new = restarted_processes(records, event_at, first_step_at)

    def last(kind: str) -> float | None:
        return reached_by_all(records, new, kind, WORLD)

    return consecutive_phases(
        [("drain_save", drain_exit_at),
         ("restart_rendezvous", max(r["at"] for r in new) if len(new) == WORLD else None),
         ("imports", last("start")), ("init", last("init")),
         ("build_load", last("restored")), ("first_step", first_step_at)], event_at)


def torchrun_config(cfg: BenchConfig) -> TorchrunConfig:
    """The job torchrun runs (and understudy's restart-only mode, the same script)."""
    return TorchrunConfig(steps=cfg.steps, step_sleep=cfg.step_sleep,
                          state_bytes=cfg.state_bytes, ckpt_every=cfg.ckpt_every,
                          ckpt_mode=cfg.ckpt_mode, drain_notice=True, max_restarts=MAX_RESTARTS,
                          keepalive_interval_s=cfg.keepalive_interval_s,
                          keepalive_attempts=cfg.keepalive_attempts)


def run_torchrun(event: str, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    run = ElasticRun(torchrun_config(cfg), base)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        run.start()
        victim = run.agents[1]
        run.wait_step(cfg.event_at - 1, timeout=interruptions.steps_timeout(cfg.event_at),
                      ranks=range(VICTIM, VICTIM + 1) if event == "worker-crash" else None)
        lost, event_at, drained_left, powered_off = interrupt(run, event, victim, cfg)
        codes = run.wait_finished(timeout=interruptions.finish_timeout(cfg.steps))
    except TorchrunError as exc:
        raise BenchmarkError(f"torchrun {event}: {exc}\n{run.agent_log_tail()}") from exc
    finally:
        run.stop()
    hit = {victim.index} if event != "worker-crash" else set()
    failed = {i: c for i, c in codes.items() if i not in hit and c != 0}
    if failed:
        raise BenchmarkError(f"torchrun {event}: agents failed {failed} (logs in {base})")
    return analyse_restart(
        "torchrun", event, cfg, run.records(), event_at, lost,
        {"agent_exit_codes": {str(k): v for k, v in codes.items()},
         "drained_agent_left_s": None if drained_left is None else drained_left - event_at},
        t0, load_before, powered_off)


def analyse_restart(system: str, event: str, cfg: BenchConfig, records: list[dict[str, Any]],
                    event_at: float, lost: list[int], details: dict[str, Any], t0: float,
                    load_before: float, powered_off: float | None = None) -> dict[str, Any]:
    """The figures of a run of ``baseline/torchrun_job.py`` that restarts every rank from its
    checkpoint (torchrun's agents, or understudy's ``--restart-only``), from its step lines."""
    done = steplog.completions(records, WORLD)
    if not done or max(c.step for c in done) != cfg.steps - 1:
        raise BenchmarkError(f"{system} {event}: the job did not reach step {cfg.steps - 1}")
    normal = steplog.normal_step(done, event_at)
    inside, drain_exit = steplog.failure_inside(records, event_at, lost), None
    if event == "planned-drain":
        exits = [r["t"] for r in records if r.get("kind") == "exit" and r["reason"] == "drain"]
        if len(exits) != WORLD:
            raise BenchmarkError(f"{system} drain: {len(exits)} ranks stopped for it, not all")
        inside = drain_exit = max(exits)
    figures = steplog.interruption(done, event_at, normal, inside)
    saves = [r for r in records if r.get("kind") == "saved"]
    restored = sorted({r["step"] for r in records if r.get("kind") == "restored"})
    return {"system": system, "event": event, "event_at": event_at, "lost_ranks": lost,
            "frozen_killed_after_s": powered_off,
            **figures,
            "phases_s": torchrun_phases(records, event_at, figures["at"]["first_step"],
                                        drain_exit),
            "details": {**details, "restored_from_steps": restored,
                        "checkpoint_save_s": summarize([r["save_s"] for r in saves])
                        if saves else None,
                        "checkpoints": len({r["step"] for r in saves})},
            "losses": losses(records), "steps_completed": max(c.step for c in done) + 1,
            "wall_s": time.monotonic() - t0,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]]}


def run_restart_only(event: str, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    """torchrun's job script, unmodified, under ``understudy run --restart-only``
    (``restart_only.py``): the same events, every rank restarted from its checkpoint."""
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    records, event_at, lost, details = restart_only.run(event, torchrun_config(cfg), cfg.event_at,
                                                         cfg.ttl, base)
    return analyse_restart("restart-only", event, cfg, records, event_at, lost, details, t0,
                           load_before)


# -- torchft -----------------------------------------------------------------------------------


def torchft_phases(records: list[dict[str, Any]], event_at: float, first_step_at: float,
                   drain_exit_at: float | None) -> dict[str, float | None]:
    """The restarted replica group's milestones, each the moment the last of its new workers
    reached it, as consecutive phases from the event: the drained group's stop, the
    replacement's or restarted workers' interpreters up (agent start or restart), imports
    (torch, torchft, the job), init (gloo group, manager, model), the quorum that healed them
    from the other group, the first step."""
    new = restarted_processes(records, event_at, first_step_at)

    def last(kind: str) -> float | None:
        return reached_by_all(records, new, kind, len(new))

    return consecutive_phases(
        [("drain_stop", drain_exit_at), ("restart", max(r["at"] for r in new) if new else None),
         ("imports", last("start")), ("init", last("init")),
         ("quorum_heal", last("healed")), ("first_step", first_step_at)], event_at)


def healed_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Commit lines for the steps a healed rank took over in its state instead of computing.

    The replica groups commit each on its own: a group that lost a rank after the DP
    all-reduce of step ``s`` but before its commit leaves the other group committing ``s``, and
    the restarted group heals to ``s + 1``. Its ranks hold step ``s`` from the moment they
    healed, so they complete it then (``healed``: true); without these lines the job would
    never complete ``s`` at all."""
    commits = steplog.step_records(records)
    out = []
    for h in records:
        if h.get("kind") != "healed":
            continue
        mine = [r["step"] for r in commits if r["rank"] == h["rank"] and r["t"] < h["t"]]
        out += [{"kind": "step", "step": step, "t": h["t"], "rank": h["rank"], "pid": h["pid"],
                 "loss": None, "healed": True}
                for step in range(max(mine, default=-1) + 1, h["step"])]
    return out


def run_torchft(event: str, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    # The drain handler only for the drain: with it, a rank whose TP peer was killed, blocked
    # in torchft's should_commit, would ignore its agent's SIGTERM and be killed 30 s later
    # (seen here); without it the default SIGTERM ends it at once.
    fcfg = TorchftConfig(steps=cfg.steps, step_sleep=cfg.step_sleep, state_bytes=cfg.state_bytes,
                         drain_notice=event == "planned-drain",
                         max_restarts=MAX_RESTARTS,
                         heartbeat_timeout_ms=cfg.torchft_heartbeat_ms)
    run = TorchftRun(fcfg, base)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    victim = WORLD // TP - 1  # the replica group of ranks 2 and 3
    try:
        run.start()
        # Every rank, not only the victim: the replica groups commit each on its own, and a
        # kill before the other group's commit would land in the step before.
        run.wait_step(cfg.event_at - 1, timeout=interruptions.steps_timeout(cfg.event_at))
        lost, event_at, _, powered_off = interrupt(run, event, victim, cfg)
        codes = run.wait_finished(timeout=interruptions.finish_timeout(cfg.steps))
    except TorchrunError as exc:
        raise BenchmarkError(f"torchft {event}: {exc}\n{run.log_tail()}") from exc
    finally:
        run.stop()
    current = {a.index for a in run.groups.values()}
    failed = {i: c for i, c in codes.items() if i in current and c != 0}
    if failed:
        raise BenchmarkError(f"torchft {event}: agents failed {failed} (logs in {base})")
    records = run.records()
    healed_over = healed_steps(records)
    done = steplog.completions(records + healed_over, WORLD)
    if not done or max(c.step for c in done) != cfg.steps - 1:
        raise BenchmarkError(f"torchft {event}: the job did not reach step {cfg.steps - 1}")
    normal = steplog.normal_step(done, event_at)
    inside, drain_exit = steplog.failure_inside(records, event_at, lost), None
    if event == "planned-drain":
        exits = [r for r in records if r.get("kind") == "exit" and r["reason"] == "drain"]
        if len(exits) != len(lost):
            raise BenchmarkError(f"torchft drain: {len(exits)} ranks stopped for it, not "
                                 f"{len(lost)}")
        drain_exit = max(r["t"] for r in exits)
        # The other group completes the last step before the stop a moment after the drained
        # one left (each group commits on its own): the interruption follows that completion.
        stop = exits[0]["step"]
        inside = next(c.t for c in done if c.step == stop - 1 and c.k == 1) + 1e-6
    figures = steplog.interruption(done, event_at, normal, inside)
    healed = [r for r in records if r.get("kind") == "healed"]
    return {"system": "torchft", "event": event, "event_at": event_at, "lost_ranks": lost,
            "frozen_killed_after_s": powered_off,
            **figures,
            "phases_s": torchft_phases(records, event_at, figures["at"]["first_step"],
                                       drain_exit),
            "details": {"agent_exit_codes": {str(k): v for k, v in codes.items()},
                        "healed_to_steps": sorted({r["step"] for r in healed}),
                        "healed_ranks": sorted({r["rank"] for r in healed}),
                        "steps_healed_over": sorted({r["step"] for r in healed_over}),
                        "discarded_steps": sorted({r["step"] for r in records
                                                   if r.get("kind") == "discarded"})},
            "losses": losses(records), "steps_completed": max(c.step for c in done) + 1,
            "wall_s": time.monotonic() - t0,
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]]}


# -- the run -----------------------------------------------------------------------------------


def run_repeat(i: int, cfg: BenchConfig, base: Path) -> dict[str, Any]:
    rep: dict[str, Any] = {"repeat": i}
    for event in cfg.events:
        rep[event] = {}
        for system in cfg.systems:
            where = base / event / system
            run = {"understudy": run_understudy, "restart-only": run_restart_only,
                   "torchrun": run_torchrun, "torchft": run_torchft}[system]
            rep[event][system] = run(event, cfg, where)
            r = rep[event][system]
            print(f"  repeat {i + 1}/{cfg.repeats} {event} {system}: downtime "
                  f"{r['downtime_s']:.3f}s, {r['steps_redone']} steps redone, full strength "
                  f"after {r['time_to_full_strength_s']:.2f}s; {r['wall_s']:.0f}s, load "
                  f"{r['loadavg_1m_before_after'][1]:.1f}", file=sys.stderr, flush=True)
        # Every system's losses against the first's (understudy's unless left out).
        ref, *others = cfg.systems
        logged = {s: rep[event][s].pop("losses") for s in cfg.systems}
        for other in others:
            rep[event][f"losses_{ref}_vs_{other}"] = compare_losses(logged[ref], logged[other])
    return rep


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(repeats: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for event in cfg.events:
        per: dict[str, Any] = {}
        for system in cfg.systems:
            rs = [r[event][system] for r in repeats]
            names = {"understudy": UNDERSTUDY_PHASES[event], "restart-only": TORCHRUN_PHASES,
                     "torchrun": TORCHRUN_PHASES, "torchft": TORCHFT_PHASES}[system]
            phases = {}
            for p in names:
                vals = [x["phases_s"][p] for x in rs if x["phases_s"].get(p) is not None]
                if vals:
                    phases[p] = summarize(vals)
            per[system] = {
                **{k: summarize([x[k] for x in rs]) for k in (
                    "downtime_s", "steps_redone", "time_to_full_strength_s", "time_lost_s",
                    "normal_step_s", "first_step_after_event_s")},
                "phases_s": phases,
            }
        for base in BASELINES:
            if base not in cfg.systems or "understudy" not in cfg.systems:
                continue
            u, t = per["understudy"], per[base]
            per[f"ratio_{base}_over_understudy"] = {
                "downtime": ratio(t["downtime_s"]["median"], u["downtime_s"]["median"]),
                "time_lost": ratio(t["time_lost_s"]["median"], u["time_lost_s"]["median"]),
                "downtime_per_repeat": summarize(
                    [x for r in repeats
                     if (x := ratio(r[event][base]["downtime_s"],
                                    r[event]["understudy"]["downtime_s"])) is not None]
                    or [0.0]),
            }
        if "restart-only" in cfg.systems and "torchrun" in cfg.systems:
            per["ratio_torchrun_over_restart-only"] = {
                "downtime": ratio(per["torchrun"]["downtime_s"]["median"],
                                  per["restart-only"]["downtime_s"]["median"]),
                "time_lost": ratio(per["torchrun"]["time_lost_s"]["median"],
                                   per["restart-only"]["time_lost_s"]["median"])}
        per["losses_identical"] = all(
            v["identical"] == v["compared"] for r in repeats for k, v in r[event].items()
            if k.startswith("losses_"))
        out[event] = per
    return out


def print_summary(result: dict[str, Any]) -> None:
    cfg, m, s = result["config"], result["machine"], result["summary"]
    systems = cfg["systems"]
    print(f"\ndowntime: TP2 x DP2 plain job, {cfg['repeats']} repeat(s) per event and system "
          f"({', '.join(systems)}), {cfg['steps']} steps, event after {cfg['event_at']}; "
          f"torchrun checkpoints every {cfg['ckpt_every']} steps ({cfg['ckpt_mode']} DCP); "
          f"on {m['cpus_usable']} CPUs, torch {m['torch']}")

    table = Table(46, repeats=cfg["repeats"])
    row = table.row
    table.header()
    for event in cfg["events"]:
        e = s[event]
        for system in systems:
            x = e[system]
            row(f"{event} {system}: downtime", x["downtime_s"], "s")
            for p, v in x["phases_s"].items():
                row(f"    {p}", v, "s")
            row("  steps redone", x["steps_redone"], "steps")
            row("  time to full strength", x["time_to_full_strength_s"], "s")
            row("  time lost (downtime + redone steps)", x["time_lost_s"], "s")
        fmt = (lambda v: "n/a" if v is None else f"{v:.1f}x")  # noqa: E731
        for base in BASELINES:
            if (r := e.get(f"ratio_{base}_over_understudy")) is not None:
                print(f"  {event}: {base} / understudy downtime {fmt(r['downtime'])}, time lost "
                      f"{fmt(r['time_lost'])}")
        if (r := e.get("ratio_torchrun_over_restart-only")) is not None:
            print(f"  {event}: torchrun / restart-only downtime {fmt(r['downtime'])}, time "
                  f"lost {fmt(r['time_lost'])}")
        print(f"  {event}: same losses in all systems: {e['losses_identical']}")
    loads = [x for r in result["repeats"] for ev in cfg["events"] for sys_ in systems
             for x in r[ev][sys_]["loadavg_1m_before_after"]]
    print(f"  1-minute load average during the run: {min(loads):.1f} to {max(loads):.1f}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Median downtime per event and system (whiskers: min and max; log scale), and the
    per-phase split of each median."""
    plt = harness.pyplot()
    cfg, s = result["config"], result["summary"]
    events, systems = cfg["events"], cfg["systems"]
    colors = {"understudy": "#2a7ab0", "restart-only": "#8a5ab0", "torchrun": "#d0702a",
              "torchft": "#5a9a3a"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5 + len(systems) - 2),
                                 gridspec_kw={"width_ratios": [1, 1.5]})
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        med = [max(s[e][system]["downtime_s"]["median"], 1e-3) for e in events]
        lo = [m - max(s[e][system]["downtime_s"]["min"], 1e-3) for e, m in zip(events, med,
                                                                                strict=True)]
        # A near-instant switch can measure a little below zero (noise): the log scale shows
        # it at the floor, whiskers included.
        hi = [max(s[e][system]["downtime_s"]["max"], 1e-3) - m
              for e, m in zip(events, med, strict=True)]
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(events))]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, color=colors[system], label=system)
    tops = [max(s[e][x]["downtime_s"]["max"] for x in systems) for e in events]
    for i, e in enumerate(events):
        said = [f"{base}: {r:.0f}x" for base in BASELINES
                if (r := s[e].get(f"ratio_{base}_over_understudy", {}).get("downtime"))
                is not None]
        if said:
            ax.text(i, tops[i] * 1.4, "\n".join(said), ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(top=max(tops) * 6)
    ax.set_xticks(range(len(events)), events)
    ax.set_ylabel("downtime per event, s (log)")
    ax.set_title(f"Downtime, median of {cfg['repeats']} (whiskers: min-max)")
    ax.legend(loc="upper left")

    labels, y = [], 0
    cmap = plt.get_cmap("tab20")
    seen: dict[str, Any] = {}
    for e in events:
        for system in systems:
            left = 0.0
            for p, v in s[e][system]["phases_s"].items():
                key = f"{system}: {p}"
                c = seen.setdefault(key, cmap(len(seen) % 20))
                bx.barh(y, v["median"], left=left, color=c, label=key if key not in labels
                        else None)
                if key not in labels:
                    labels.append(key)
                left += v["median"]
            bx.text(left, y, f" {left:.2f}s", va="center", fontsize=8)
            y += 1
    bx.set_yticks(range(y), [f"{e}\n{sy}" for e in events for sy in systems], fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel("seconds, median of each phase (failures: from the event on; understudy's "
                  "drain: its switch step)")
    bx.set_title("Where the time goes")
    bx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"{result['machine']['cpus_usable']} CPUs, TP2 x DP2 plain job, torchrun "
                 f"checkpoints every {cfg['ckpt_every']} steps ({cfg['ckpt_mode']} DCP)"
                 + (f"; torchft: live recovery, Lighthouse heartbeat timeout "
                    f"{cfg['torchft_heartbeat_ms']} ms" if "torchft" in systems else ""),
                 fontsize=9)
    harness.save_chart(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("downtime", __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="runs per event and system (default 5; smoke 1)")
    p.add_argument("--events", default=",".join(EVENTS),
                   help=f"comma-separated, of {', '.join(EVENTS)} (default: all)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all; the ratios "
                        "need understudy)")
    p.add_argument("--steps", type=int,
                   help="steps of the job (default 300; smoke 120: the event, at step 50 and "
                        "once understudy's standbys are warm, leaves some 70 steps to run past "
                        "the interruption)")
    p.add_argument("--step-sleep", type=float, default=0.04,
                   help="seconds of stand-in work per step (default 0.04, as the other "
                        "benchmarks)")
    p.add_argument("--event-at", type=int, default=LOG_EVERY,
                   help=f"the event comes once this many steps are committed (default "
                        f"{LOG_EVERY}; at least {MIN_EVENT_AT}, for a normal step before it)")
    p.add_argument("--ckpt-every", type=int, default=20,
                   help="torchrun's checkpoint cadence in steps (default 20: an event at step "
                        "50 lands halfway through an interval, the mean loss of a random one)")
    harness.side_by_side_options(p)
    p.add_argument("--torchft-heartbeat-ms", type=int,
                   help="torchft's Lighthouse heartbeat timeout (default 5000: torchft's own; "
                        "smoke 1000)")
    p.add_argument("--silent-limit", type=float,
                   help="silent node: seconds a baseline may take to train again by itself "
                        "before its frozen processes are killed, as an operator would power "
                        "the machine off (default 60; smoke 20)")
    p.add_argument("--state-size", type=size_arg, metavar="SIZE",
                   help="the job's state per rank (64MiB, 1GiB, ...: examples/plain_torch/"
                        "train.py --state-size), the same for every system (default: the "
                        "example's own, about 27 KB)")
    p.add_argument("--hand-off", choices=("ahead", "whole"), default="ahead",
                   help="understudy's drain: the leavers send their state ahead while training "
                        "goes on, then each step's gradients (default), or the whole state at "
                        "the switch (train.py --hand-off)")
    p.add_argument("--event-delay", type=float, default=0.0, metavar="SECONDS",
                   help="understudy's event comes this long after the commit of --event-at "
                        "(default 0): a failure in the middle of the survivors' step; "
                        "understudy only (the baselines' events are not delayed)")
    p.interruptible()
    p.add_argument("--smoke", action="store_true", help="one repeat, short runs: for the tests")
    p.outputs(keep="keep logs, step lines and checkpoints here", chart="chart")
    args = p.parse(argv, {"repeats": (5, 1), "steps": (300, 120),
                          "torchft_heartbeat_ms": (5000, 1000), "silent_limit": (60.0, 20.0)})
    args.events = tuple(e.strip() for e in args.events.split(",") if e.strip())
    if not args.events or set(args.events) - set(EVENTS):
        p.error(f"--events must name some of {', '.join(EVENTS)}, got {args.events}")
    # In SYSTEMS order, so that understudy, when there, is the reference for losses and ratios.
    named = {x.strip() for x in args.systems.split(",") if x.strip()}
    if not named or named - set(SYSTEMS):
        p.error(f"--systems must name some of {', '.join(SYSTEMS)}, got {args.systems!r}")
    args.systems = tuple(x for x in SYSTEMS if x in named)
    if args.silent_limit <= 0:
        p.error(f"--silent-limit must be positive, got {args.silent_limit}")
    if "torchft" in args.systems and importlib.util.find_spec("torchft") is None:
        p.error("torchft is not installed in this environment: install it with "
                "`pip install -c constraints.txt torchft` (scripts/setup does), or leave it out "
                "with --systems understudy,torchrun")
    if args.torchft_heartbeat_ms < 100:
        p.error(f"--torchft-heartbeat-ms must be at least 100, got {args.torchft_heartbeat_ms}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.event_at < MIN_EVENT_AT:
        p.error(f"--event-at must be at least {MIN_EVENT_AT} (a normal step is measured on the "
                f"steps before the event, the first {steplog.WARMUP_STEPS} left out), got "
                f"{args.event_at}")
    if "planned-drain" in args.events:
        after, why = RUN_ON_DRAIN, "a drain switches after phase 1"
    else:
        after = max(RUN_ON, args.ckpt_every + 10)
        why = f"torchrun redoes up to --ckpt-every ({args.ckpt_every}) steps first"
    if args.steps < args.event_at + after:
        p.error(f"--steps must be at least --event-at + {after} for the interruption to end "
                f"mid-run ({why}), got {args.steps}")
    if args.event_delay < 0:
        p.error(f"--event-delay must be >= 0, got {args.event_delay}")
    if args.event_delay and args.systems != ("understudy",):
        p.error("--event-delay delays understudy's events only: run it with --systems "
                "understudy")
    harness.check_side_by_side(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = BenchConfig(repeats=args.repeats, events=args.events, steps=args.steps,
                      step_sleep=args.step_sleep, event_at=args.event_at,
                      ckpt_every=args.ckpt_every, ckpt_mode=args.ckpt_mode, ttl=args.ttl,
                      keepalive_interval_s=args.keepalive[0],
                      keepalive_attempts=args.keepalive[1], smoke=args.smoke,
                      systems=args.systems, torchft_heartbeat_ms=args.torchft_heartbeat_ms,
                      silent_limit=args.silent_limit, state_bytes=args.state_size,
                      hand_off=args.hand_off, event_delay=args.event_delay,
                      interruptible=args.interruptible)
    os.environ.update(PROCESS_ENV)  # every process it starts inherits it
    scratch = harness.Scratch(args.keep_dir, "understudy-bench-down-")
    repeats = scratch.repeats("downtime benchmark", cfg.repeats,
                              lambda i, d: run_repeat(i, cfg, d),
                              (OSError, UnderstudyError, ValueError, psutil.Error))
    if isinstance(repeats, int):
        return repeats

    result = {
        **harness.header("downtime", scratch.started, torch=True),
        "config": {**asdict(cfg), "tp": TP, "dp": WORLD // TP,
                   "understudy_standby": 2, "job": "examples/plain_torch/train.py",
                   "threads_per_process": 1, "victim_rank": VICTIM,
                   "lost_node": {"understudy": LOST_NODE, "restart-only": LOST_NODE,
                                 "torchrun": "agent 1",
                                 "torchft": "replica group 1 (ranks 2, 3)"},
                   "torchrun": torchrun_setup(MAX_RESTARTS),
                   "torchft": {"version": _version("torchft"), "replica_groups": 2,
                               "ranks_per_group": TP, "min_replica_size": 2,
                               "use_async_quorum": False, "checkpoint_transport": "http",
                               "lighthouse_heartbeat_timeout_ms": cfg.torchft_heartbeat_ms,
                               "lighthouse_join_timeout_ms": 60000,
                               "tp_inside_group": "gloo default group of the replica group's "
                                                  "torchrun (not managed by torchft)",
                               "agents": "one torchrun --standalone per replica group",
                               "max_restarts": MAX_RESTARTS,
                               "drain_notice": "planned-drain only"}
                   if "torchft" in cfg.systems else None,
                   "downtime": "first step completed after the interruption - last step "
                               "completed before it - median step before the event"},
        "summary": collect(repeats, cfg),
        "chart": str(args.png),
        "repeats": repeats,
    }
    harness.report(result, args.out, print_summary, plot, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
