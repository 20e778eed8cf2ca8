"""Fault soak: one long job through a seeded random schedule of faults (issue 13).

One command, real processes. A local cluster set up as ``benchmarks/recovery.py`` does (an
embedded etcd; ``node-a``, which starts first and holds the controller, and ``node-b`` with two
slots each; standby nodes ``node-s1`` and ``node-s2``, warmed in the sandbox) runs the plain
example job (``examples/plain_torch/train.py``) TP=2 x DP=2 with ``--standby 2`` and a line per
committed step. A seeded schedule (``soak_plan.schedule``: ``--seed``, ``--faults``) then hits it,
one fault after the other, each drawn from:

- ``worker-kill``: kill -9 of one rank's process;
- ``daemon-kill``: kill -9 of a node's daemon (its ranks die with it: the worker lifeline);
- ``node-loss``: kill -9 of a node's daemon and its processes at once;
- ``silent-node``: SIGSTOP of a node's daemon and all its processes for longer than the lease
  TTL, then SIGCONT: the node must be replaced, then fence itself and join again;
- ``drain``: ``understudy drain NODE``;
- ``two-at-once``: two kills (of the three above) on two nodes, a few milliseconds apart;
- ``during-migration``: a kill or a drain, then a second kill (another node's, or a joiner's
  standby worker) as soon as the migration it causes is planned;
- ``while-paused``: the autoscaler holds off and the free standbys are taken away (their nodes
  killed; the controller's cordoned), a kill pauses the job ("paused: ... waiting for a
  standby"), a second kill lands while it is paused, then the autoscaler adds what it lacks;
- ``etcd-restart``: kill -9 of etcd, restarted on the same data and port 2-5 s later;
- ``controller-kill``: kill -9 of the controller's node (daemon and processes).

No fault takes every data-parallel replica of a rank (``soak_plan.keeps_a_replica``). Between
faults the benchmark acts as an autoscaler would: nodes left holding nothing leave (a drained
node, a node that fenced itself and joined again empty), and a fresh standby node (a new daemon,
a new name) joins whenever fewer free standbys than the job needs are left (its ``--standby``, or
the ranks a fault lost if more; checked every 2 s while the soak waits); the next
fault waits until the job's pool is full and warm, the job trains again (a step committed by
every rank after the fault was handled) and a seeded gap has passed. A fault is **survived**
when the job trains again, no rank on a node it took; a **hang** is no step committed by any
rank for ``--hang-timeout`` seconds: the run records it, with the cluster's state, and stops.

At the end the job runs out at full speed and must finish ``done``; its final state is compared
bit for bit (``tests/integration/bitwise.py``) with an uninterrupted run of the same job and
seed on four plain processes, as the tests' reference. Per fault, from the step lines the same
way as the other benchmarks (``steplog``, ``volatile.event_figures``): **downtime** = the
longest interruption between the fault and the moment the job trained again: (first step
completed after it) - (last step completed before it) - (one normal step: the median step of
the 30 s before the fault); steps redone and time lost. Per kind: count, survived, downtime
median and spread. Prints a summary, writes JSON; every process it starts is stopped on exit,
Ctrl-C and SIGTERM included.

    .venv/bin/python benchmarks/soak.py [--seed S] [--faults N] [--smoke] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import harness
import interruptions
import psutil
import soak_plan
import steplog
import volatile
from harness import PROCESS_ENV, TRAIN, BenchmarkError, log_records, read_records
from interruptions import JOB, TP, WORLD
from soak_plan import Hit, Picture, Planned

from understudy.cli.cluster import ClusterStatus, JobView, read_events
from understudy.common import config as config_mod
from understudy.common.errors import StoreError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.layout import Layout
from understudy.testing.localcluster import DaemonProcess

LAYOUT = Layout(world_size=WORLD, tp=TP)
STANDBY = 2
#: The first faults wait until every rank has committed this step (first touches are paid).
WARM_STEP = steplog.WARMUP_STEPS
#: Steps past WARM_STEP that a smoke's first fault also waits for: a fault's normal step is the
#: median of at least three step gaps past it (``steplog.normal_step``), which the smoke's short
#: gaps may not hold (the full run's gaps are seconds of steps).
SMOKE_NORMAL_GAPS = 3
#: Seconds of steps before a fault its normal step is the median of.
NORMAL_WINDOW_S = 30.0
#: A rank's step line this many steps behind the job's newest is a standby's shadow iteration
#: (or older): recoveries here redo at most the step that failed.
SHADOW_SLACK = 20
#: Seconds between two turns of the autoscaler while the soak waits.
AUTOSCALE_EVERY_S = 2.0
#: The smoke job's steps. Its seven faults were over 36 s after its first step here (165 steps
#: of 0.17 s); 350 steps of 0.3 s of sleep hold three times that. Every step beyond the schedule
#: costs both cores twice (the job running out at full speed, the reference run), about 30 ms.
SMOKE_STEPS = 350
#: Extra seconds a silent node stays stopped beyond the lease TTL (drawn from this range).
SILENCE_EXTRA_S = (1.0, 3.0)
#: Seconds etcd stays down in an etcd restart (drawn from this range).
ETCD_DOWN_S = (2.0, 5.0)


class SoakError(UnderstudyError):
    """The soak could not go on: set-up failed, or something it waits for never came."""


class Hang(SoakError):
    """No rank committed a step for the hang timeout."""


class JobFailed(SoakError):
    """The job was marked failed."""


@dataclass(frozen=True)
class SoakConfig:
    seed: int
    faults: int
    steps: int
    step_sleep: float
    gap_s: tuple[float, float]
    hang_s: float
    serve_timeout_s: float
    ttl: int
    smoke: bool


@dataclass
class Fault:
    """What the soak did for one planned fault and what it saw (wall times)."""

    planned: Planned
    epoch_before: int
    ranks_before: tuple[str, ...]
    controller_before: str | None
    hits: list[dict[str, Any]] = field(default_factory=list)
    setup: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    fired_at: float | None = None
    served_at: float | None = None
    survived: bool = False
    error: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"index": self.planned.index, "kind": self.planned.kind,
                "gap_s": self.planned.gap_s, "seed": self.planned.seed,
                "epoch_before": self.epoch_before, "ranks_before": list(self.ranks_before),
                "controller_before": self.controller_before, "hits": self.hits,
                "setup": self.setup, "notes": self.notes, "fired_at": self.fired_at,
                "served_at": self.served_at, "survived": self.survived, "error": self.error}


class Steps:
    """The job's step lines (``<dir>/rank<r>-<pid>.jsonl``, one file per process), read
    incrementally (polling must not load the machine it measures), and where each rank is.

    A standby's shadow iterations in the sandbox write such a file too and delete it once
    warm; the same process may later write a file of the same name for the rank it takes. So a
    file that shrank or was replaced is read again from its start, a deleted one is dropped, and
    a file whose newest step is far behind the job's is no rank's progress."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: path -> (inode, bytes read, the newest line read: (t, step, pid))
        self._files: dict[Path, tuple[int, int, tuple[float, int, int] | None]] = {}

    def poll(self) -> None:
        seen = set()
        for path in self.directory.glob("rank*.jsonl"):
            try:
                st = path.stat()
                inode, offset, newest = self._files.get(path, (st.st_ino, 0, None))
                if inode != st.st_ino or st.st_size < offset:
                    inode, offset, newest = st.st_ino, 0, None
                if st.st_size > offset:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                    end = data.rfind(b"\n") + 1
                    offset += end
                    for line in data[:end].splitlines():
                        with contextlib.suppress(ValueError, KeyError, TypeError):
                            r = json.loads(line)
                            if r.get("kind", "step") == "step":
                                newest = (float(r["t"]), int(r["step"]), int(r["pid"]))
            except FileNotFoundError:
                continue
            seen.add(path)
            self._files[path] = (inode, offset, newest)
        for path in set(self._files) - seen:
            del self._files[path]

    @property
    def newest(self) -> dict[int, tuple[float, int, int]]:
        """rank -> (time, step, pid) of its newest step line, shadow iterations left out."""
        last = {p: n for p, (_, _, n) in self._files.items() if n is not None}
        top = max((s for _, s, _ in last.values()), default=0)
        out: dict[int, tuple[float, int, int]] = {}
        for path, (t, step, pid) in last.items():
            rank = int(path.name.removeprefix("rank").split("-")[0])
            if step >= top - SHADOW_SLACK and t > out.get(rank, (0.0, 0, 0))[0]:
                out[rank] = (t, step, pid)
        return out

    def all_past(self, step: int) -> bool:
        self.poll()
        newest = self.newest
        return len(newest) == WORLD and all(s >= step for _, s, _ in newest.values())

    def all_after(self, t: float) -> bool:
        """Every rank has committed a step after wall time ``t``."""
        self.poll()
        newest = self.newest
        return len(newest) == WORLD and all(at > t for at, _, _ in newest.values())


def running(pid: int) -> bool:
    """``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Soak:
    """The cluster, the job on it, the faults fired at it and the capacity they used."""

    def __init__(self, cfg: SoakConfig, base: Path) -> None:
        self.cfg, self.base = cfg, base
        #: wall time this soak began: only processes started since are its own
        self.began = time.time()
        self.etcd, self.cluster = harness.new_cluster(base, cfg.ttl)
        self.out, self.steps_dir = base / "out", base / "steps"
        self.faults_over = base / "faults-over"
        self.progress = Steps(self.steps_dir)
        #: node -> the pids stopped by a silent-node fault and not woken yet
        self.frozen: dict[str, list[int]] = {}
        self.cordoned: list[str] = []
        self.joined: list[str] = []
        self.retired: list[str] = []
        #: the autoscaler holds off (a while-paused fault uses the pool up)
        self.hold = False
        #: hangs are watched for once the job trains
        self.watching = False
        self.events: dict[tuple[Any, ...], dict[str, Any]] = {}
        #: every fault begun, the last one possibly cut short
        self.faults: list[Fault] = []

    # -- cluster and job ---------------------------------------------------------------------

    def start(self) -> None:
        self.steps_dir.mkdir(parents=True, exist_ok=True)
        harness.start_etcd(self.etcd, self.cluster)
        interruptions.bring_up(self.cluster)
        env = {**PROCESS_ENV, "UNDERSTUDY_RECORDINGS": str(self.base / "recordings")}
        run = self.cluster.cli(
            "run", "--job", JOB, "--tp", str(TP), "--dp", str(WORLD // TP), "--standby",
            str(STANDBY), *(f"--env={k}={v}" for k, v in env.items()), "--", sys.executable,
            str(TRAIN), "--steps", str(self.cfg.steps), "--step-sleep", str(self.cfg.step_sleep),
            "--step-sleep-off", str(self.faults_over), "--save", str(self.out),
            "--step-log", str(self.steps_dir), *harness.example_options(self.cfg.smoke))
        if run.returncode != 0:
            raise SoakError(f"understudy run failed: {run.stderr.strip()}")
        warm = WARM_STEP + (SMOKE_NORMAL_GAPS if self.cfg.smoke else 0)
        self.wait(f"every rank to commit step {warm}", lambda: self.progress.all_past(warm),
                  timeout=300)
        self.watching = True
        self.wait_pool("the first standbys to warm up")

    def status(self) -> ClusterStatus:
        return self.cluster.status()

    def job(self, s: ClusterStatus) -> JobView:
        """The job as ``s`` shows it.

        Raises:
            JobFailed: it was marked failed.
            SoakError: it is gone, has no assignment, or finished while faults were due.
        """
        job = s.job(JOB)
        if job is None or job.assignment is None:
            raise SoakError("the job or its assignment is gone from etcd")
        if job.state == "failed":
            raise JobFailed(f"the job failed: {job.status.reason if job.status else ''}")
        if job.state == "done" and not self.faults_over.exists():
            raise SoakError("the job ran out of steps before the schedule did: raise --steps")
        return job

    def picture(self) -> tuple[Picture, JobView]:
        s = self.status()
        job = self.job(s)
        assert job.assignment is not None  # job() checked
        return Picture(job.assignment.ranks, s.controller, LAYOUT), job

    def watch(self) -> None:
        """Raises Hang when no rank has committed a step for the hang timeout."""
        self.progress.poll()
        if not self.watching or not self.progress.newest:
            return
        last = max(t for t, _, _ in self.progress.newest.values())
        if time.time() - last > self.cfg.hang_s:
            raise Hang(f"no rank committed a step for {time.time() - last:.0f} s (the last: "
                       f"{ {r: s for r, (_, s, _) in sorted(self.progress.newest.items())} })")

    def wait(self, what: str, check: Callable[[], bool], timeout: float,
             interval: float = 0.1, autoscale: int = 0) -> float:
        """Poll ``check`` (an etcd error counts as not yet: etcd may be restarting), watching
        for hangs, and with ``autoscale`` > 0 keeping that many free standbys (the autoscaler
        runs all the time, not only between faults); returns the seconds it took.

        Raises:
            Hang, JobFailed: as :meth:`watch` and :meth:`job`.
            SoakError: ``timeout`` passed.
        """
        t0 = time.monotonic()
        scaled = t0
        while True:
            self.watch()
            with contextlib.suppress(StoreError):
                if check():
                    return time.monotonic() - t0
                if autoscale and time.monotonic() - scaled > AUTOSCALE_EVERY_S:
                    scaled = time.monotonic()
                    self.autoscale(autoscale)
            if time.monotonic() - t0 > timeout:
                raise SoakError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)

    def sleep(self, seconds: float) -> None:
        """Sleep, watching for hangs."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.watch()
            time.sleep(min(left, 0.2))

    # -- capacity (the autoscaler) -----------------------------------------------------------

    def free_standbys(self, s: ClusterStatus, job: JobView) -> list[str]:
        """Online standby nodes holding no rank, cordoned ones left out, and those whose
        daemon was killed or stopped (their record outlives them until their lease ends)."""
        assert job.assignment is not None
        return [n.name for n in s.nodes if n.online and n.state == "standby" and not n.cordoned
                and n.name not in job.assignment.ranks and self.runs(n.name)]

    def runs(self, node: str) -> bool:
        """``node``'s daemon runs and is not stopped by a silent-node fault."""
        d = self.cluster.daemons.get(node)
        return d is not None and d.alive() and node not in self.frozen

    def retire_idle(self) -> None:
        """Nodes that hold no rank and are no standby (a drained node, one that fenced itself
        and joined again empty) leave, as a cloud would reclaim them; the controller stays."""
        s = self.status()
        job = self.job(s)
        assert job.assignment is not None
        for n in s.nodes:
            d = self.cluster.daemons.get(n.name)
            # A standby node whose rank moved away goes back to the pool: it stays.
            idle = n.state == "drained" or (n.state == "active" and n.role == "active")
            if (d is None or not d.alive() or not n.online or n.name == s.controller
                    or n.name in job.assignment.ranks or n.name in self.frozen or not idle):
                continue
            harness.retire(d)
            self.retired.append(n.name)

    def autoscale(self, want: int = STANDBY) -> list[str]:
        """Fresh standby nodes until ``want`` are free or on their way (added, not registered
        yet); none while the autoscaler holds off."""
        if self.hold:
            return []
        s = self.status()
        online = {n.name for n in s.nodes if n.online}
        coming = [n for n in self.joined if self.runs(n) and n not in online]
        return interruptions.add_standbys(
            self.cluster, max(0, want - len(self.free_standbys(s, self.job(s))) - len(coming)),
            self.joined)

    def pool_ready(self) -> bool:
        s = self.status()
        job = self.job(s)
        assert job.assignment is not None
        free = set(self.free_standbys(s, job))
        pool = [n for n in job.assignment.standbys if n in free]
        warm = {n.name for n in s.nodes if JOB in n.warmth}
        return len(pool) >= STANDBY and all(n in warm for n in pool)

    @staticmethod
    def rank_pid(d: DaemonProcess, rank: int) -> int:
        """The process of ``rank`` under daemon ``d``, as the daemon named it (``mig.r1``, a
        promoted standby included). Not from the step lines: a standby warming as that rank
        writes some too (its shadow iterations' before it forgets them; the soak once killed
        one of those for the rank, and the job then ran out of steps waiting on a recovery that
        nothing called for).

        Raises:
            SoakError: no live process holds it there.
        """
        try:
            pid = harness.worker_pid(d, f"{JOB}.r{rank}")
        except BenchmarkError as exc:
            raise SoakError(f"no process holds rank {rank} on {d.name}: {exc}") from exc
        if not running(pid):
            raise SoakError(f"rank {rank}'s process on {d.name} (pid {pid}) is not running")
        return pid

    def wait_pool(self, what: str) -> None:
        self.wait(what, self.pool_ready, self.cfg.serve_timeout_s, interval=0.25,
                  autoscale=STANDBY)

    # -- hits ---------------------------------------------------------------------------------

    def prepare(self, hit: Hit, rng: random.Random) -> tuple[Callable[[], None], dict[str, Any]]:
        """What firing ``hit`` does, worked out beforehand (so that two hits land
        milliseconds apart), and what it targets."""
        info: dict[str, Any] = hit.as_json()
        d = self.cluster.daemons.get(hit.node)
        if hit.action == "kill-worker":
            assert d is not None
            pid = self.rank_pid(d, hit.rank)
            info["pid"] = pid
            return lambda: os.kill(pid, signal.SIGKILL), info
        if hit.action == "kill-joiner":
            assert d is not None
            pid = harness.worker_pid(d, f"{JOB}.standby")
            info["pid"] = pid
            return lambda: signal_all([pid], signal.SIGKILL), info
        if hit.action in ("kill-daemon", "kill-node", "freeze-node"):
            assert d is not None
            pids = process_tree(d.pid)
            info["pids"] = pids
            if hit.action == "kill-daemon":
                return d.kill9, info
            if hit.action == "kill-node":
                def lose() -> None:
                    signal_all(pids, signal.SIGKILL)
                    d.wait(timeout=10)
                return lose, info

            info["rank_pids"] = [self.rank_pid(d, r) for r in hit.lost]

            def freeze() -> None:
                self.frozen[hit.node] = pids
                signal_all(pids, signal.SIGSTOP)
            return freeze, info
        if hit.action == "drain":
            def drain() -> None:
                res = self.cluster.cli("drain", hit.node, "--deadline", "300")
                if res.returncode != 0:
                    raise SoakError(f"understudy drain {hit.node} failed: {res.stdout}"
                                    f"{res.stderr}")
            return drain, info
        if hit.action == "restart-etcd":
            down = rng.uniform(*ETCD_DOWN_S)
            info["down_s"] = down

            def restart() -> None:
                self.etcd.stop()
                self.sleep(down)
                self.etcd.start()
            return restart, info
        raise AssertionError(f"unknown hit {hit.action}")

    def fire(self, fault: Fault, hits: tuple[Hit, ...], rng: random.Random) -> None:
        prepared = [self.prepare(h, rng) for h in hits]
        for run, info in prepared:
            info["at"] = time.time()
            if fault.fired_at is None:
                fault.fired_at = info["at"]
            fault.hits.append(info)
            run()
            info["done_at"] = time.time()

    def thaw(self, node: str) -> None:
        signal_all(self.frozen.pop(node, []), signal.SIGCONT)

    # -- one fault ---------------------------------------------------------------------------

    def run_fault(self, planned: Planned) -> Fault:
        """Fire one planned fault and wait until the job trains again.

        Raises:
            Hang, JobFailed, SoakError: as :meth:`wait`; ValueError: no target keeps a replica
                of every rank (``soak_plan``).
        """
        rng = random.Random(planned.seed)
        pic, job = self.picture()
        assert job.assignment is not None
        fault = Fault(planned, job.assignment.epoch, job.assignment.ranks, pic.controller)
        self.faults.append(fault)
        before = job.migration.id if job.migration is not None else None
        joined_before = len(self.joined)
        kind = planned.kind
        if kind == "while-paused":
            self.use_up_pool(fault)
            pic, _ = self.picture()
        hits = soak_plan.pick(kind, pic, rng)
        self.fire(fault, hits, rng)
        if kind == "during-migration":
            m = self.wait_migration(before)
            fault.notes.update(migration=m.id, migration_kind=m.kind, joiners=list(m.joiners),
                               planned_seen_after_s=time.time() - (fault.fired_at or 0.0))
            pic2, _ = self.picture()
            hits += (soak_plan.second(pic2, hits, rng, joiners=m.joiners),)
            self.fire(fault, hits[-1:], rng)
            fault.notes["second_after_planned_s"] = fault.hits[-1]["at"] - m.created_at
        elif kind == "while-paused":
            def paused_or_planned() -> bool:  # planned: a standby came free meanwhile
                job = self.job(self.status())
                return self.paused(job) or (job.migration is not None
                                            and job.migration.id != before)
            self.wait("the job to pause", paused_or_planned, 60)
            job = self.job(self.status())
            fault.notes["paused"] = self.paused(job)
            fault.notes["paused_after_s"] = time.time() - (fault.fired_at or 0.0)
            pic2, _ = self.picture()
            hits += (soak_plan.second(pic2, hits, rng),)
            self.fire(fault, hits[-1:], rng)
            self.sleep(1.0)
            job = self.job(self.status())
            fault.notes["reason_after_second"] = job.status.reason if job.status else ""
            fault.notes["paused_after_second"] = self.paused(job)
            self.hold = False  # the autoscaler adds what the job lacks (in serve)
            fault.notes["released_at"] = time.time()
        elif kind == "silent-node":
            self.wake_silent(fault, hits[0], rng)
        elif kind == "etcd-restart":
            self.wait("every daemon to be online again", self.all_online, 60)
        vacate = {h.node for h in hits if h.action in ("kill-daemon", "kill-node",
                                                       "freeze-node", "drain")}
        moved = any(h.lost or h.action == "drain" for h in hits)
        lost = {r for h in hits for r in h.lost}
        self.serve(fault, vacate, moved, want=max(STANDBY, len(lost)))
        if kind == "while-paused":
            fault.notes["standbys_joined"] = self.joined[joined_before:]
        for n in self.cordoned:
            self.cluster.cli("uncordon", n)
        self.cordoned = []
        fault.survived = True
        return fault

    def use_up_pool(self, fault: Fault) -> None:
        """The autoscaler holds off and every free standby is taken away: killed (daemon and
        standby worker at once), or cordoned if it is the controller's node."""
        self.hold = True
        s = self.status()
        killed = []
        for n in self.free_standbys(s, self.job(s)):
            if n == s.controller:
                self.cluster.cli("cordon", n)
                self.cordoned.append(n)
                fault.setup.append({"action": "cordon", "node": n, "at": time.time()})
                continue
            d = self.cluster.daemons[n]
            pids = process_tree(d.pid)
            fault.setup.append({"action": "kill-node", "node": n, "pids": pids,
                                "at": time.time()})
            signal_all(pids, signal.SIGKILL)
            d.wait(timeout=10)
            killed.append(n)

        def used_up() -> bool:  # ... the killed ones' records gone with their leases too
            s = self.status()
            return not self.free_standbys(s, self.job(s)) and not any(
                n.online for n in s.nodes if n.name in killed)
        self.wait("the standby pool to be used up", used_up, 60)

    def wait_migration(self, before: str | None) -> Any:
        """The first migration planned after ``before`` (polled every 20 ms)."""
        seen: dict[str, Any] = {}

        def planned() -> bool:
            m = self.job(self.status()).migration
            if m is None or m.id == before:
                return False
            seen["m"] = m
            return True
        self.wait("a migration to be planned", planned, 60, interval=0.02)
        return seen["m"]

    def paused(self, job: JobView) -> bool:
        return job.status is not None and job.status.paused

    def all_online(self) -> bool:
        s = self.status()
        online = {n.name for n in s.nodes if n.online}
        return all(name in online for name, d in self.cluster.daemons.items() if d.alive())

    def wake_silent(self, fault: Fault, hit: Hit, rng: random.Random) -> None:
        """Keep the node stopped past the lease TTL and until its ranks are replaced, then
        wake it: it must find its lease gone, join again and stop its old ranks' processes
        (those still running 10 s after it joined are noted: they would be a finding)."""
        node = hit.node
        d = self.cluster.daemons[node]
        lost_before = d.log_text().count("Node lost its lease")
        silence = self.cfg.ttl + rng.uniform(*SILENCE_EXTRA_S)
        fault.notes["silence_s"] = silence
        self.sleep(max(0.0, (fault.fired_at or 0.0) + silence - time.time()))

        def replaced() -> bool:
            job = self.job(self.status())
            assert job.assignment is not None
            return node not in job.assignment.ranks
        self.wait(f"{node}'s ranks to be replaced", replaced, self.cfg.serve_timeout_s)
        fault.notes["woken_at"] = time.time()
        self.thaw(node)

        def rejoined() -> bool:
            v = self.status().node(node)
            return (d.log_text().count("Node lost its lease") > lost_before and v is not None
                    and v.online)
        self.wait(f"{node} to fence itself and join again", rejoined, 60)
        fault.notes["rejoined_after_wake_s"] = time.time() - fault.notes["woken_at"]
        old = fault.hits[0]["rank_pids"]
        with contextlib.suppress(SoakError):
            self.wait("the old ranks' processes to end",
                      lambda: not any(running(p) for p in old), 10)
        fault.notes["old_rank_pids_alive"] = [p for p in old if running(p)]
        fault.notes["fence_lines"] = [
            str(r["event"]) for r in log_records(d.log_text())[-400:]
            if "lost its lease" in str(r.get("event")) or "fenced itself" in str(r.get("event"))
            or "Node kept" in str(r.get("event"))][-3:]

    def serve(self, fault: Fault, vacate: set[str], moved: bool, want: int) -> None:
        """Wait until the fault is handled (no migration under way, the job not paused, no rank
        on a node it took, every rank's node online, a live controller; the epoch raised if a
        rank was lost or moved) and every rank has committed a step since; meanwhile the
        autoscaler keeps ``want`` standbys free (a job short of them pauses until they come)."""
        def handled() -> bool:
            s = self.status()
            job = self.job(s)
            a = job.assignment
            assert a is not None
            online = {n.name for n in s.nodes if n.online}
            return not (self.paused(job) or (job.migration is not None and job.migration.active)
                        or (moved and a.epoch <= fault.epoch_before)
                        or vacate & set(a.ranks) or not set(a.ranks) <= online
                        or s.controller is None or not self.runs(s.controller))
        self.wait(f"fault {fault.planned.index} ({fault.planned.kind}) to be handled", handled,
                  self.cfg.serve_timeout_s, autoscale=want)
        handled_at = time.time()
        self.wait("every rank to train again", lambda: self.progress.all_after(handled_at),
                  self.cfg.serve_timeout_s)
        fault.served_at = time.time()
        s = self.status()
        job = self.job(s)
        assert job.assignment is not None
        fault.notes.update(epoch_after=job.assignment.epoch,
                           ranks_after=list(job.assignment.ranks), controller_after=s.controller)

    # -- the run ------------------------------------------------------------------------------

    def between(self) -> None:
        """After a fault: the autoscaler's turn, then a full warm pool and a training job."""
        self.read_events()
        self.retire_idle()
        self.autoscale()
        self.wait_pool("the standby pool to be full and warm again")

    def finish(self) -> float:
        """The job runs out at full speed and must end done; returns when it did."""
        self.faults_over.touch()
        left = self.cfg.steps - min((s for _, s, _ in self.progress.newest.values()), default=0)

        def done() -> bool:
            return self.job(self.status()).state == "done"
        self.wait("the job to finish", done, 120 + 0.2 * left, interval=0.5)
        self.watching = False
        return time.time()

    def read_events(self) -> None:
        """Keep every event seen (the controller prunes the oldest past a thousand)."""
        async def read() -> list[Any]:
            store = harness.etcd_store(self.cluster.etcd_endpoint, self.cluster.prefix)
            try:
                return (await read_events(store, Keys(self.cluster.prefix)))[0]
            finally:
                await store.close()
        with contextlib.suppress(StoreError):
            for e in asyncio.run(read()):
                rec = asdict(e)
                self.events[(e.time, e.node, e.kind, e.message)] = rec

    def evidence(self) -> dict[str, Any]:
        """The cluster's state for a report: status, the newest events, each daemon's newest
        warnings and errors, each rank's newest step."""
        out: dict[str, Any] = {"at": time.time()}
        try:
            out["status"] = self.status().as_json()
        except StoreError as exc:
            out["status"] = f"unreadable: {exc}"
        self.read_events()
        out["events"] = sorted(self.events.values(), key=lambda e: e["time"])[-60:]
        out["newest_steps"] = {str(r): {"t": t, "step": s, "pid": p}
                               for r, (t, s, p) in sorted(self.progress.newest.items())}
        logs = {}
        for name, d in self.cluster.daemons.items():
            bad = [r for r in log_records(d.log_text())
                   if r.get("level") in ("warning", "error", "critical")]
            logs[name] = {"alive": d.alive(), "frozen": name in self.frozen,
                          "warnings_and_errors": bad[-20:]}
        out["daemon_logs"] = logs
        return out

    def stop(self, grace: float) -> None:
        """Wake what is stopped, stop the daemons (SIGTERM, SIGKILL after ``grace`` seconds;
        at once with 0), then every process left that this run started (workers run in
        sessions of their own: the ones started since this soak began whose command lines name
        its scratch directory, never one of its own ancestors), then etcd."""
        for node in list(self.frozen):
            self.thaw(node)
        try:
            self.cluster.stop_all(timeout=grace)
        finally:
            mine = []
            ancestors = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
            for p in psutil.process_iter(["cmdline", "create_time"]):
                with contextlib.suppress(psutil.Error):
                    if (p.pid not in ancestors and p.info["create_time"] >= self.began
                            and str(self.base) in " ".join(p.info["cmdline"] or ())):
                        mine.append(p)
            for p in mine:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(mine, timeout=10)
            self.etcd.stop()


# -- after the run -------------------------------------------------------------------------


def downtimes(faults: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Each fault served: its interruption's figures (``volatile.event_figures``), in place.

    A rank killed just as the job committed a step may never write that step's line, while
    its survivors wrote theirs and its replacement goes on from the step after: that step
    counts as the replacement's from its first commit (``steplog.taken_over``)."""
    done = steplog.completions(records + steplog.taken_over(records), WORLD)
    for f in faults:
        if f["fired_at"] is None or f["served_at"] is None:
            continue
        fired, served = f["fired_at"], f["served_at"]
        window = [c for c in done if c.t >= fired - NORMAL_WINDOW_S]
        try:
            try:
                normal = steplog.normal_step(window, fired)
            except ValueError:
                normal = steplog.normal_step(done, fired)
            figures = volatile.event_figures(done, fired, served, normal)
        except ValueError as exc:
            f["downtime_error"] = str(exc)
            continue
        f.update({k: figures[k] for k in ("downtime_s", "time_lost_s", "steps_redone",
                                          "normal_step_s", "last_step_before",
                                          "first_step_after")})
        f["fault_to_served_s"] = served - fired


def attach_events(faults: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """Each fault's migrations and node events, from its first hit to when it was served."""
    interesting = ("migration-", "node-failed", "node-fenced", "job-", "standbys-added",
                   "controller")
    for f in faults:
        start = (f["setup"][0]["at"] if f["setup"] else f["fired_at"]) or 0.0
        end = f["served_at"] or float("inf")
        f["events"] = [f"{e['time'] - start:+.3f}s {e['kind']} {e['node']}: {e['message']}"
                       for e in events if start - 0.5 <= e["time"] <= end
                       and e["kind"].startswith(interesting)]


# -- the command -----------------------------------------------------------------------------


def run(cfg: SoakConfig, base: Path) -> dict[str, Any]:
    soak = Soak(cfg, base)
    plan = soak_plan.schedule(cfg.seed, cfg.faults, cfg.gap_s, cfg.smoke)
    faults = soak.faults
    outcome: dict[str, Any] = {"hang": None, "job_failed": None, "stopped_by": None}
    t0 = time.monotonic()
    job_done_at = None
    started_at = time.time()
    try:
        soak.start()
        started_at = time.time()
        for planned in plan:
            soak.sleep(planned.gap_s)
            fault = soak.run_fault(planned)
            print(f"  fault {planned.index + 1}/{len(plan)} {planned.kind} "
                  f"({', '.join(_hit_line(h) for h in fault.hits)}): trained again after "
                  f"{(fault.served_at or 0) - (fault.fired_at or 0):.1f} s; "
                  f"{time.monotonic() - t0:.0f} s in, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)
            if planned.index + 1 < len(plan):
                soak.between()
        job_done_at = soak.finish()
    except (UnderstudyError, ValueError, psutil.Error) as exc:  # StoreError, EtcdStartError...
        key = ("hang" if isinstance(exc, Hang) else "job_failed"
               if isinstance(exc, JobFailed) else "stopped_by")
        where = faults[-1].planned.index if faults and not faults[-1].survived else None
        outcome[key] = {"error": f"{type(exc).__name__}: {exc}", "fault_index": where,
                        **soak.evidence()}
        if faults and not faults[-1].survived:
            faults[-1].error = str(exc)
        print(f"soak stopped: {exc}", file=sys.stderr, flush=True)
    finally:
        soak.read_events()
        # A job that ran out leaves its daemons idle: they may leave cleanly; otherwise (a
        # hang, a failure, Ctrl-C) nothing is worth waiting for.
        soak.stop(grace=5.0 if job_done_at is not None else 0.0)
    records = read_records(soak.steps_dir)
    wall = time.monotonic() - t0
    events = sorted(soak.events.values(), key=lambda e: e["time"])
    fjson = [f.as_json() for f in faults]
    downtimes(fjson, records)
    attach_events(fjson, events)
    bitwise: dict[str, Any] = {"equal": None, "difference": "the job did not finish"}
    ref_s = None
    if job_done_at is not None:
        t1 = time.monotonic()
        try:
            bitwise = harness.compare_states(harness.reference_run(
                base / "reference", WORLD, TP, cfg.steps, cfg.smoke), soak.out, WORLD)
        except harness.BenchmarkError as exc:
            bitwise = {"equal": None, "difference": f"no reference: {exc}"}
        ref_s = time.monotonic() - t1
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    done = steplog.completions(records, WORLD)
    return {
        "totals": {
            "faults_planned": len(plan), "faults_fired": len(faults),
            "faults_survived": sum(f.survived for f in faults),
            "hangs": int(outcome["hang"] is not None),
            "jobs_failed": int(outcome["job_failed"] is not None),
            "job_done": job_done_at is not None, "bitwise_equal": bitwise["equal"],
            "standbys_joined": len(soak.joined), "nodes_retired": len(soak.retired),
            "steps_completed": max((c.step for c in done), default=-1) + 1,
            "steps_redone": sum(1 for c in done if c.k > 1),
            "wall_s": wall, "faults_s": (faults[-1].served_at or time.time()) - started_at
            if faults else 0.0, "reference_run_s": ref_s,
        },
        "by_kind": soak_plan.by_kind(fjson),
        "schedule": [asdict(p) for p in plan],
        "faults": fjson,
        "outcome": outcome,
        "bitwise": bitwise,
        "standbys_joined": soak.joined,
        "nodes_retired": soak.retired,
        "event_counts": kinds,
        "daemon_log_tracebacks": {n: d.log_text().count("Traceback")
                                  for n, d in soak.cluster.daemons.items()},
    }


def _hit_line(h: dict[str, Any]) -> str:
    what = h["action"]
    if h["rank"] >= 0:
        what += f" rank {h['rank']}"
    return what + (f" on {h['node']}" if h["node"] else "")


def print_summary(result: dict[str, Any]) -> None:
    cfg, t = result["config"], result["totals"]
    print(f"\nsoak: TP2 x DP2 plain job, --standby {STANDBY}, seed {cfg['seed']}, "
          f"{t['faults_planned']} faults planned, {cfg['steps']} steps; lease TTL {cfg['ttl']} s; "
          f"on {result['machine']['cpus_usable']} CPUs")
    print(f"\n  {'kind':<18}{'count':>6}{'survived':>9}{'median':>9}{'min':>9}{'max':>9}"
          f"{'spread':>9}  downtime, s")
    for kind, k in result["by_kind"].items():
        d = k["downtime_s"]
        figures = "".join(f"{d[x]:>9.3f}" for x in ("median", "min", "max", "spread")) \
            if d else f"{'(none measured)':>36}"
        print(f"  {kind:<18}{k['count']:>6}{k['survived']:>9}{figures}")
    print(f"\n  faults fired {t['faults_fired']}, survived {t['faults_survived']}; hangs "
          f"{t['hangs']}; jobs failed {t['jobs_failed']}; job done {t['job_done']}; final state "
          f"bitwise equal to an uninterrupted run: {t['bitwise_equal']}")
    print(f"  {t['steps_completed']} steps, {t['steps_redone']} redone; {t['standbys_joined']} "
          f"standby nodes joined, {t['nodes_retired']} idle nodes left; wall {t['wall_s']:.0f} s "
          f"(faults {t['faults_s']:.0f} s, reference run {t['reference_run_s'] or 0:.0f} s)")
    for key in ("hang", "job_failed", "stopped_by"):
        if (o := result["outcome"][key]) is not None:
            print(f"  {key}: {o['error']}")
    if result["bitwise"]["difference"] and result["bitwise"]["equal"] is False:
        print(f"  state differs: {result['bitwise']['difference'][:300]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.Parser("soak", __doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (default 0)")
    p.add_argument("--faults", type=int, help="faults in the schedule (default 50; smoke 7)")
    p.add_argument("--steps", type=int,
                   help=f"steps of the job (default 200 per fault + 1000; smoke "
                        f"{SMOKE_STEPS}); it must outlast the schedule, then runs out at full "
                        "speed")
    p.add_argument("--step-sleep", type=float,
                   help="seconds of stand-in work per step while faults are due (default 0.08, "
                        "a step of about 0.1 s; smoke 0.3): the job outlasts the schedule on "
                        "fewer steps, and the reference run of as many steps is shorter")
    p.add_argument("--gap", help="seconds of normal training before each fault, drawn "
                   "uniformly from MIN,MAX (default 2,8; smoke 0.1,0.5)")
    p.add_argument("--hang-timeout", type=float, default=120.0,
                   help="no step committed by any rank for this long is a hang (default 120)")
    p.add_argument("--serve-timeout", type=float, default=240.0,
                   help="seconds for a fault to be handled, or the pool to be warm again, "
                        "before the soak gives up (default 240)")
    p.add_argument("--ttl", type=int, default=config_mod.LeaseConfig().ttl,
                   help="the daemons' lease TTL in seconds (default: the daemon's)")
    p.add_argument("--smoke", action="store_true", help="a short mixed schedule: for the tests")
    p.outputs(keep="keep daemon logs, step lines and states here")
    args = p.parse(argv, {"faults": (50, 7), "step_sleep": (0.08, 0.3),
                          "gap": ("2,8", "0.1,0.5")})
    if args.steps is None:
        args.steps = SMOKE_STEPS if args.smoke else 200 * args.faults + 1000
    gap = args.gap
    try:
        args.gap = tuple(float(x) for x in gap.split(","))
    except ValueError:
        p.error(f"--gap takes two numbers, MIN,MAX, got {gap!r}")
    if len(args.gap) != 2 or not 0 <= args.gap[0] <= args.gap[1]:
        p.error(f"--gap must be MIN,MAX with 0 <= MIN <= MAX, got {gap!r}")
    if args.faults < 1:
        p.error(f"--faults must be at least 1, got {args.faults}")
    if args.steps < 200:
        p.error(f"--steps must be at least 200, got {args.steps}")
    if args.step_sleep < 0:
        p.error("--step-sleep must be >= 0")
    if args.hang_timeout < 10 or args.serve_timeout < 10:
        p.error("--hang-timeout and --serve-timeout must be at least 10 s")
    if args.ttl < 3:
        p.error(f"--ttl must be at least 3, got {args.ttl}")
    return args


def passed(found: dict[str, Any]) -> bool:
    """Every fault survived, no hang, no failed job, and the job done with the reference's
    state."""
    t = found["totals"]
    return (t["faults_survived"] == t["faults_planned"] and t["hangs"] == 0
            and t["jobs_failed"] == 0 and t["job_done"] and t["bitwise_equal"] is True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = SoakConfig(seed=args.seed, faults=args.faults, steps=args.steps,
                     step_sleep=args.step_sleep, gap_s=args.gap, hang_s=args.hang_timeout,
                     serve_timeout_s=args.serve_timeout, ttl=args.ttl, smoke=args.smoke)
    os.environ.update(PROCESS_ENV)  # the daemons and their workers inherit it
    scratch = harness.Scratch(args.keep_dir, "understudy-soak-")

    def work() -> dict[str, Any]:
        found = run(cfg, scratch.base)
        # The scratch directory goes unless asked to keep it or the soak found something: then
        # its daemon logs are the evidence.
        scratch.keep = scratch.keep or not passed(found)
        return found

    found = scratch.run("soak", (OSError, UnderstudyError, psutil.Error), work)
    if isinstance(found, int):
        return found
    ok = passed(found)
    result = {**harness.header("soak", scratch.started),
              "config": {**asdict(cfg), "tp": TP, "dp": WORLD // TP, "standby": STANDBY,
                         "job": "examples/plain_torch/train.py", "threads_per_process": 1,
                         "kinds": list(soak_plan.KINDS),
                         "downtime": "longest gap between job-level step completions from "
                                     "the fault until the job trained again, minus the median "
                                     "step of the 30 s before the fault"},
              "passed": ok, **found}
    print_summary(result)
    harness.write_results(result, args.out)
    print(f"\nresults written to {args.out}"
          + ("" if not scratch.keep else f"; logs in {scratch.base}"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
