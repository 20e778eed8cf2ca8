"""Runs this node's share of each job: spawns the ranks the assignment places here, and writes
how each rank's process ended (``jobs/<job>/exits/<epoch>/<rank>``) for the controller.

A rank is spawned only while the node is ``active`` and the job ``running``. Each worker gets
its coordinates and the daemon's socket in its environment (names in ``common/env.py``); it
reaches etcd only through that socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from understudy.common import env, failpoints, logs
from understudy.common.backoff import Backoff
from understudy.common.errors import RecordError, StoreError
from understudy.common.keys import Keys
from understudy.common.records import (
    JOB_RECORDS,
    TRANSFER_OK,
    Assignment,
    DecodedRecords,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    MigrationKind,
    MigrationPhase,
    RankExit,
    Record,
    Rendezvous,
    Report,
    ResizeRequest,
    StopRequest,
    decode_job_record,
    job_misfit,
)
from understudy.common.states import NodeState
from understudy.common.store import KV, EtcdStore, WatchEvent, wait_any
from understudy.daemon.metrics import BadValues
from understudy.daemon.node import NodeAgent
from understudy.daemon.ranklogs import RankLogs
from understudy.daemon.restarts import torchrun_env
from understudy.daemon.supervisor import ChildExit, ChildState, SpawnError, Supervisor

_CHILD_RE = re.compile(r"^(?P<job>[a-z0-9-]+)\.(r(?P<rank>\d+)|standby)$")
#: A standby worker that failed this many times is not started again (no crash loop).
MAX_STANDBY_FAILURES = 3
#: A warm standby worker polls its daemon every 0.1 s while it waits; one silent this long is
#: hung (stopped, deadlocked, swapping) and is replaced.
STANDBY_SILENCE_S = 10.0
#: How long the daemon of a joiner that died at the switch waits for its leaver's word on the
#: transfer before it calls the migration off anyway: longer than a leaver's send may take to fail
#: (its transfer timeout, 60 s), since a decision without that word can lose the rank.
JOINER_VERDICT_WAIT_S = 90.0
#: A joiner whose leaver said the state went through has only its prepared groups left to
#: switch in, which takes well under a second. One that has not said it switched this long
#: after is hung (deadlocked, stopped, swapping), and the job's other ranks wait on it in
#: their first collective of the new epoch, with no recovery coming while the switch stands
#: (review M5). Its daemon stops it: its rank is then recovered from a replica, as after a
#: joiner that died holding the state. Below the job's collective timeout (60 s by default),
#: so that the ranks waiting on it are still there to take part.
JOINER_SWITCH_S = 30.0
#: The job runner decides from a listing of ``jobs/`` that the watch keeps current
#: (``_Listing``); it lists the whole prefix again this often (+-20 %, so that a fleet spreads
#: out), starting the watch afresh from there: the backstop for a watch that stopped delivering
#: without an error. At 4,096 nodes, 137 reads/s; before, every daemon read the prefix every
#: 5 s (819/s) and on every change under it (4,096 reads per change).
JOBS_RELIST_S = 30.0


async def _set_when(event: asyncio.Event, then: asyncio.Event) -> None:
    await event.wait()
    then.set()


def rank_child(job: str, rank: int) -> str:
    return f"{job}.r{rank}"


def standby_child(job: str) -> str:
    return f"{job}.standby"


def huge_pages(job_env: Mapping[str, str], inherited: Mapping[str, str]) -> dict[str, str]:
    """What a worker is given for torch's CPU allocator: ``THP_MEM_ALLOC_ENABLE=1`` (each
    allocation of 2 MiB or more on transparent huge pages, where the kernel allows them), unless
    the job's ``--env`` or the daemon's environment (``inherited``) says otherwise.

    A rank holding gigabytes of state in host memory steps faster on them (Adam and the copies
    touch 512 times fewer pages) and, once killed, is gone sooner: the kernel frees its memory
    before it closes its sockets and before the daemon can reap it. At 1 GiB of state a rank,
    the example's step took 3.80 s against 5.07 s on 4 KiB pages, and a killed rank was reaped
    0.031 s after SIGKILL against 0.152 s (``benchmarks/huge_pages.py``, ``docs/recovery.md``).
    Results are bitwise the same: where memory lies changes no number."""
    if env.THP_MEM_ALLOC_ENABLE in job_env or env.THP_MEM_ALLOC_ENABLE in inherited:
        return {}
    return {env.THP_MEM_ALLOC_ENABLE: "1"}


class _Listing:
    """The job records under ``jobs/`` (``JOB_RECORDS``: spec, assignment, status, ...) as this
    daemon last saw them: listed once, then kept current by the watch of the prefix. A change
    there then costs each daemon one watch message. Before, each daemon read the whole prefix
    again on every change and every 5 s: N Range requests of every job's records per change,
    at N nodes (``docs/benchmarks.md``, "Job records kept by the watch").

    The watch delivers every event after the listing's revision, in order, and a transaction's
    events together (etcd never splits a revision across watch responses, and aetcd queues a
    response's events before its reader runs): the copy is etcd's state at some revision, as a
    read's was, never a half-applied transaction. Listings and the watch take turns (the watch
    starts after each listing, from its revision), so a listing is always taken whole: even one
    at a lower revision than the copy's, as after etcd was restored from a backup."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.kvs: dict[str, KV] = {}
        #: the revision the copy is current to (0: never listed)
        self.revision = 0
        #: the revision of the last listing: events up to it are in it already
        self._listed_at = 0

    def listed(self, kvs: list[KV], revision: int) -> None:
        """A read of the whole prefix at ``revision`` replaces the copy."""
        self.kvs = {kv.key: kv for kv in kvs if self._is_record(kv.key)}
        self.revision = self._listed_at = revision

    def apply(self, event: WatchEvent) -> bool:
        """One watch event; False if the copy had it already (or it is not a job record)."""
        kv = event.kv
        if kv.mod_revision <= self._listed_at:
            return False
        self.revision = kv.mod_revision
        if not self._is_record(kv.key):
            return False
        if event.kind == "delete":
            self.kvs.pop(kv.key, None)
        else:
            self.kvs[kv.key] = kv
        return True

    def _is_record(self, key: str) -> bool:
        """``jobs/<job>/<name>`` with a name in ``JOB_RECORDS`` (not a rank's exit)."""
        job, _, name = Keys.name_of(key, self.prefix).partition("/")
        return bool(job) and name in JOB_RECORDS


@dataclass
class _Job:
    spec: JobSpec | None = None
    assignment: Assignment | None = None
    status: JobStatus | None = None
    migration: Migration | None = None
    resize: ResizeRequest | None = None
    stop: StopRequest | None = None
    rendezvous: Rendezvous | None = None

    @property
    def complete(self) -> bool:
        return None not in (self.spec, self.assignment, self.status)


class JobRunner:
    def __init__(self, agent: NodeAgent, store: EtcdStore, supervisor: Supervisor,
                 stop: asyncio.Event, wall: Callable[[], float] = time.time,
                 resync_interval: float = 5.0, ranklogs: RankLogs | None = None) -> None:
        self.agent, self.store, self.supervisor, self.stop = agent, store, supervisor, stop
        #: where the workers' own output goes (None: the daemon's stdout, as before)
        self.ranklogs = ranklogs
        self.keys = Keys(agent.cfg.etcd.prefix)
        self.node = agent.cfg.node
        self.wall = wall
        self.resync_interval = resync_interval
        self.log = logs.get(node=self.node)
        self._bad_values = BadValues(agent.metrics, self.log)
        self._changed = asyncio.Event()
        #: set (and replaced) each time the jobs' view is read afresh: see next_view()
        self._published = asyncio.Event()
        #: (job, rank, epoch) whose process ended here, even if etcd has not heard yet: never
        #: started again under that epoch (after a fence, the old epoch's rank stays dead).
        self._ended: set[tuple[str, int, int]] = set()
        #: (job, rank, epoch) this node started a process for: started once at most. A rank
        #: killed a moment ago is no longer running before its exit is handled; a reconcile in
        #: between must not start it again at the epoch a recovery is about to replace.
        self._started: set[tuple[str, int, int]] = set()
        #: child name -> the newest epoch under which this node held that rank
        self._held_epoch: dict[str, int] = {}
        self._standby_failures: dict[str, int] = {}
        self._jobs: dict[str, _Job] = {}
        #: ``jobs/``'s records, kept current by the watch (what a reconcile decides from)
        self._listing = _Listing(self.keys.jobs)
        #: the records the last view was made of: a reconcile decodes only what changed since
        self._decoded = DecodedRecords()
        #: child name -> (migration id, epoch) of a joiner promoted here whose migration may not
        #: have committed yet
        self._promoted: dict[str, tuple[str, int]] = {}
        #: rank child names whose process ended and whose exit is still being decided
        self._settling: set[str] = set()
        #: rank child name -> (migration id, rank, new epoch, pid of the standby worker) for a
        #: joiner chosen on this node: its promotion stands even if the migration record is
        #: replaced by the next one before this daemon saw it done
        self._chosen: dict[str, tuple[str, int, int, int]] = {}
        #: (migration id, rank) -> when this daemon first saw its joiner here hold the state
        #: without having switched (see JOINER_SWITCH_S)
        self._holding_since: dict[tuple[str, int], float] = {}
        #: job -> monotonic time of the last request from its standby worker's reporting
        #: connection
        self._standby_seen: dict[str, float] = {}
        self._publish_warmth = False

    async def run(self) -> None:
        watch = asyncio.create_task(self._watch(), name="jobs-watch")
        failing = ""  # the last unexpected failure's text, logged once while it repeats
        try:
            while not self.stop.is_set():
                await wait_any((self._changed, self.stop), self.resync_interval)
                self._changed.clear()
                if self.stop.is_set():
                    break
                try:
                    await self._reconcile()
                    failing = ""
                except StoreError as exc:
                    self.log.debug("Job reconcile failed; will retry.", error=str(exc))
                    # Long polls look again: what they answer says whether etcd is reachable.
                    self._republish()
                except Exception as exc:  # contained, counted and logged
                    # A record no check foresaw, or a bug: the running workers go on, and the
                    # next change or resync tries again. Stopping the daemon here would take
                    # its ranks down and, restarted, meet the same record again.
                    self.agent.metrics.errors.labels(kind="job-reconcile").inc()
                    text = f"{type(exc).__name__}: {exc}"
                    if text != failing:
                        failing = text
                        self.log.error("Job reconcile failed; the workers run on, and it is "
                                       "tried again at the next change.", exc_info=exc)
        finally:
            watch.cancel()
            await asyncio.wait({watch}, timeout=2)

    def poke(self) -> None:
        self._changed.set()

    async def _watch(self) -> None:
        """List ``jobs/``, then keep the listing current from the watch, from the listing's
        revision on; list again every ``JOBS_RELIST_S`` (jittered), and at once when etcd
        compacted the revisions the watch had to resume from. (The watch itself resumes a
        broken stream where it stopped, through an outage of any length.)"""
        backoff = Backoff()  # jittered: the fleet comes back spread out
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            try:
                kvs, rev = await self.store.get_prefix(self.keys.jobs)
            except StoreError:
                self.agent.metrics.etcd_retries.labels(call="watch-jobs").inc()
                await wait_any((self.stop,), backoff.next())
                continue
            backoff.reset()
            self._listing.listed(kvs, rev)
            self._changed.set()
            window = asyncio.Event()  # set: the watch ends, and the prefix is listed again
            relist = loop.call_later(JOBS_RELIST_S * random.uniform(0.8, 1.2), window.set)
            stopping = asyncio.create_task(_set_when(self.stop, window))
            try:
                events = self.store.watch_prefix(self.keys.jobs, rev + 1, window)
                async with contextlib.aclosing(events):
                    async for ev in events:
                        if not isinstance(ev, WatchEvent):
                            break  # RESYNC: events were compacted away, list again
                        if self._listing.apply(ev):
                            self._changed.set()
            finally:
                relist.cancel()
                stopping.cancel()

    async def _read_jobs(self) -> dict[str, _Job]:
        """The jobs as etcd has them now: a read of the whole prefix, for decisions that must
        not rest on the watch's listing (``readopt``); a reconcile decides from the listing
        (:meth:`_listed_jobs`)."""
        kvs, _ = await self.store.get_prefix(self.keys.jobs)
        return self._decode_jobs(kvs)

    def _listed_jobs(self) -> dict[str, _Job]:
        """The jobs as the watch's listing has them. Raises StoreError before the first
        listing (etcd not reached yet since the daemon started): no view, so no decision."""
        if not self._listing.revision:
            raise StoreError("the job records have not been listed from etcd yet")
        return self._decode_jobs(sorted(self._listing.kvs.values(), key=lambda kv: kv.key))

    def _decode_jobs(self, kvs: list[KV]) -> dict[str, _Job]:
        """The complete, consistent jobs among ``kvs``. A record is decoded once per revision:
        at rest, or when one job changes, a reconcile decodes nothing, or that job's records,
        instead of every record of every job (``benchmarks/scale.py``, 54 jobs: 3.49 ms a
        view, against 0.16 ms; every 5 s and on every change, on every daemon). Records are
        immutable, so they can be shared."""
        jobs: dict[str, _Job] = {}
        revisions: dict[str, int] = {}  # job -> the newest of its records' revisions
        self._decoded.begin()
        prefix = self.keys.jobs
        for kv in kvs:

            def decode(value: bytes, key: str = kv.key) -> tuple[str, str, Record] | None:
                return decode_job_record(Keys.name_of(key, prefix), value)  # named if decoded

            try:
                decoded = self._decoded.decode(kv, decode)
            except RecordError as exc:
                self._bad_values.found("jobs", kv.key, kv.mod_revision, str(exc))
                continue
            if decoded is not None:
                job, name, record = decoded
                setattr(jobs.setdefault(job, _Job()), name, record)
                revisions[job] = max(revisions.get(job, 0), kv.mod_revision)
        self._decoded.end()
        complete = {}
        for name, j in jobs.items():
            if not j.complete:
                continue
            assert j.spec is not None
            misfit = job_misfit(j.spec, j.assignment, j.migration)
            if misfit is not None:  # ignored, as a garbage value is: nothing is started for it
                self._bad_values.found("jobs", f"{self.keys.jobs}{name}/", revisions[name],
                                       f"the records of job {name} do not fit together: "
                                       f"{misfit}")
                continue
            complete[name] = j
        return complete

    async def _reconcile(self) -> None:
        jobs = self._listed_jobs()
        self._jobs = jobs
        self.agent.metrics.forget_jobs(set(jobs))
        self._republish()
        if not self.agent.registered.is_set():
            # Joining (again, after a lost lease): what this node runs is readopt's to decide,
            # once the new record exists. Nothing is started or stopped before.
            return
        # What is decided below is decided under this lease: a worker is started only while
        # the node still holds it (the awaits in between may straddle a fence).
        lease = self.agent.lease
        await self._renumber(jobs)
        children = self.supervisor.children
        running = {n for n, c in children.items() if c.state == ChildState.RUNNING}
        promotions = self._promotions(jobs)
        await self._promote(promotions, running)
        wanted: dict[str, tuple[_Job, int | None]] = {
            name: (job, rank) for name, (job, rank, _, _) in promotions.items()}
        await self._restarted_here(jobs)
        state = self.agent.state
        if self.agent.registered.is_set():
            for job in jobs.values():
                assert job.spec and job.assignment and job.status
                if job.status.state != JobState.RUNNING:
                    continue
                restart_only = job.spec.restart_only
                for held in job.assignment.ranks_on(self.node):
                    name = rank_child(job.spec.name, held)
                    self._held_epoch[name] = job.assignment.epoch
                    if restart_only and (job.stop is not None or _replacing(job, held)):
                        continue  # stopped below: SIGTERM, so the script can save
                    # A draining node keeps its ranks until they have moved (or its deadline).
                    if state in (NodeState.ACTIVE, NodeState.DRAINING):
                        wanted[name] = (job, held)
                # A plain script has no standby worker: its standby nodes wait empty.
                if self.node in job.assignment.standbys and state == NodeState.STANDBY and \
                        not restart_only:
                    wanted[standby_child(job.spec.name)] = (job, None)
        for name, (job, rank) in sorted(wanted.items()):
            if name in running or name in self._settling or \
                    (name in promotions and name not in self._assigned_here(job)):
                # a joiner's rank comes from its standby worker, never from a fresh process
                # (until the new assignment makes it this node's rank)
                continue
            assert job.spec and job.assignment
            if rank is None:
                if self._standby_failures.get(name, 0) >= MAX_STANDBY_FAILURES:
                    continue
            elif state != NodeState.ACTIVE or \
                    (job.spec.name, rank, job.assignment.epoch) in self._ended or \
                    (job.spec.name, rank, job.assignment.epoch) in self._started or \
                    _replacing(job, rank) or \
                    await self._exited(job.spec.name, job.assignment.epoch, rank):
                continue
            elif job.assignment.epoch > 1 and not job.spec.restart_only:
                # Only a job's first epoch starts ranks from nothing; later, a rank's process
                # is the one that held it (or the joiner that took it). If none is here, it
                # died (during a migration's switch, or with a restarted daemon): a fresh one
                # would start at step 0 among ranks far ahead. Say it failed; the job recovers.
                # (A restart-only job's every epoch starts from nothing: from its checkpoint.)
                await self._rank_missing(job.spec.name, rank, job.assignment.epoch)
                continue
            extra = None
            if job.spec.restart_only and rank is not None:
                extra = await self._torchrun_env(job, rank)
                if extra is None:
                    continue  # rank 0's daemon has not said where the ranks meet yet
            await self._spawn(job.spec, job.assignment, rank, extra, lease)
        stopping = []
        for name in running:
            if not self.agent.registered.is_set():
                return  # the lease was lost meanwhile: see above
            if _CHILD_RE.match(name) and name not in wanted:
                self.log.info("Stopping a worker this node no longer needs.", child=name)
                stopping.append(name)
        # Side by side: every rank of a restarting job has its SIGTERM at once (one saving
        # while its peer is not yet told would leave the peer blocked on it).
        await asyncio.gather(*(self.supervisor.stop(name, self._stop_grace(name, jobs))
                               for name in stopping))
        await self._check_standbys(jobs, running)
        await self._check_switches(jobs)
        await self._back_to_the_pool(jobs, promotions)

    def _stop_grace(self, name: str, jobs: dict[str, _Job]) -> float:
        """Seconds from SIGTERM to SIGKILL for child ``name``: the stop request's grace for a
        restart-only job being stopped, else ``drain.stop_grace``."""
        m = _CHILD_RE.match(name)
        job = jobs.get(m["job"]) if m else None
        if job is not None and job.spec is not None and job.spec.restart_only and \
                job.stop is not None:
            return job.stop.grace
        return self.agent.cfg.drain.stop_grace

    async def _restarted_here(self, jobs: dict[str, _Job]) -> None:
        """A standby node that a restart-only job's restart gave ranks becomes active (a live
        migration's joiner does so at its promotion)."""
        if self.agent.state != NodeState.STANDBY:
            return
        for job in jobs.values():
            assert job.spec and job.assignment and job.status
            held = job.assignment.ranks_on(self.node)
            if job.spec.restart_only and held and job.status.state == JobState.RUNNING:
                await self.agent.set_state(NodeState.ACTIVE,
                                           f"holds rank(s) {', '.join(map(str, held))} of job "
                                           f"{job.spec.name} after its restart")
                return

    async def _torchrun_env(self, job: _Job, rank: int) -> dict[str, str] | None:
        """The torchrun environment of a restart-only job's ``rank`` at the current epoch, or
        None while the epoch's rendezvous is not known. For rank 0 this node publishes it
        first: a free port on this node's address, where rank 0's script hosts the env://
        store."""
        assert job.spec and job.assignment
        a, rdzv = job.assignment, job.rendezvous
        if rdzv is not None and (rdzv.epoch != a.epoch or rdzv.node != a.ranks[0]):
            rdzv = None
        if rdzv is None and rank == 0:
            addr = self.agent.cfg.addresses[0] if self.agent.cfg.addresses \
                else socket.gethostname()
            rdzv = Rendezvous(job=a.job, epoch=a.epoch, node=self.node, addr=addr,
                              port=_free_port(addr))
            await self.store.put(self.keys.job_rendezvous(a.job), rdzv.encode())
            self.log.info(f"Ranks of job {a.job} meet at {addr}:{rdzv.port} (MASTER_ADDR, "
                          "MASTER_PORT) this epoch.", job=a.job, epoch=a.epoch)
        if rdzv is None:
            return None
        return torchrun_env(job.spec, a, rank, rdzv, os.environ)

    async def _renumber(self, jobs: dict[str, _Job]) -> None:
        """A reshape committed (the job's assignment is at its new epoch): this node's ranks that
        stay keep their processes under their new numbers, and those of a dropped replica are
        stopped (they end cleanly: the job goes on without them). ``docs/reshape.md``."""
        for job in jobs.values():
            m, a, spec = job.migration, job.assignment, job.spec
            if m is None or a is None or spec is None or m.kind != MigrationKind.RESHAPE or \
                    m.phase != MigrationPhase.DONE or a.epoch != m.to_epoch:
                continue
            stay = m.renumbering(spec.tp, spec.pp)
            held = sorted(r for r in range(m.from_dp * spec.tp * spec.pp)
                          if self._held_epoch.get(rank_child(spec.name, r)) == m.from_epoch and
                          (c := self.supervisor.children.get(rank_child(spec.name, r)))
                          is not None and c.state == ChildState.RUNNING)
            for r in held:
                if r not in stay:
                    name = rank_child(spec.name, r)
                    self.log.info(f"Rank {r} of job {spec.name} was in a replica the reshape "
                                  f"{m.id} dropped; stopping it.", job=spec.name, rank=r)
                    await self.supervisor.stop(name, self.agent.cfg.drain.stop_grace)
            # Two passes, with nothing awaited in between: a new number may be another kept
            # rank's old one (either way round, with pipeline stages).
            moving = [r for r in held if r in stay]
            for r in moving:
                if stay[r] != r:
                    self.supervisor.rename(rank_child(spec.name, r),
                                           f"{rank_child(spec.name, r)}-renumbering")
                    self._held_epoch.pop(rank_child(spec.name, r), None)
            for r in moving:
                new = rank_child(spec.name, stay[r])
                if stay[r] != r:
                    self.supervisor.rename(f"{rank_child(spec.name, r)}-renumbering", new)
                    if self.ranklogs is not None:  # its output goes on in the new rank's file
                        self.ranklogs.retarget(self.supervisor.children[new].pid, spec.name,
                                               stay[r], m.to_epoch)
                self._held_epoch[new] = m.to_epoch
                self.log.info(f"Rank {r} of job {spec.name} is rank {stay[r]} after reshape "
                              f"{m.id}.", job=spec.name, epoch=m.to_epoch)

    async def _back_to_the_pool(self, jobs: dict[str, _Job],
                                promotions: dict[str, tuple[_Job, int, int, str]]) -> None:
        """An active node that holds no rank of any job and runs no rank's process goes to the
        standby pool when it is configured as a standby (it was promoted; its job ended, or its
        ranks moved on), or when a job names it a standby (a reshape dropped its ranks: it
        stands by to grow the job back, ``docs/reshape.md``); spare capacity returns by itself
        instead of idling as an active node. A node configured as active that stands by for no
        job any more (the job ended) is active again."""
        state = self.agent.state
        if state not in (NodeState.ACTIVE, NodeState.STANDBY):
            return

        def live(job: _Job) -> bool:
            return job.status is not None and job.status.state in (JobState.PENDING,
                                                                   JobState.RUNNING)

        if any(live(job) and job.assignment is not None and job.assignment.ranks_on(self.node)
               for job in jobs.values()) or any(live(job) for job, *_ in promotions.values()):
            return
        if any((m := _CHILD_RE.match(name)) is not None and m["rank"] is not None
               and child.state == ChildState.RUNNING
               for name, child in self.supervisor.children.items()):
            return
        standing = sorted(name for name, job in jobs.items() if live(job) and
                          job.assignment is not None and self.node in job.assignment.standbys)
        if state == NodeState.ACTIVE and (self.agent.cfg.role == "standby" or standing):
            why = ("holds no rank: back in the standby pool" if not standing else
                   f"holds no rank and stands by for job {', '.join(standing)}")
            await self.agent.set_state(NodeState.STANDBY, why)
            await self.agent.events.emit(
                "node-back-in-pool", f"Node {self.node} holds no rank and is a standby again"
                + (f" of job {', '.join(standing)}." if standing else "."))
        elif state == NodeState.STANDBY and self.agent.cfg.role == "active" and not standing:
            await self.agent.set_state(NodeState.ACTIVE, "stands by for no job: active again")

    # -- standby workers' warmth and liveness -----------------------------------------------

    def standby_report(self, job: str, warmth: dict[str, Any] | None) -> None:
        """From the local socket: ``job``'s standby worker reported ``warmth``, or (None) made
        any request on the connection it reported on (a sign of life)."""
        self._standby_seen[job] = time.monotonic()
        if warmth is None:
            return
        old = self.agent.warmth.get(job)
        if old is not None:
            self.agent.metrics.standby_warm_since.remove(job, old["mode"])
            if "holder" in old and "holder" not in warmth:
                # The same worker (warmth is dropped when it exits): its holder still runs.
                warmth = {**warmth, "holder": old["holder"]}
        self.agent.warmth[job] = {**warmth, "since": self.wall()}
        self.agent.metrics.standby_warm_since.labels(job=job, mode=warmth["mode"]).set(
            self.wall())
        self.log.info(f"Standby worker of job {job} is warm ({warmth['mode']}).", job=job,
                      roles=warmth["roles"], detail=warmth["detail"])
        self._publish_warmth = True
        self._changed.set()

    def _drop_warmth(self, job: str) -> None:
        old = self.agent.warmth.pop(job, None)
        self._standby_seen.pop(job, None)
        if old is not None:
            self.agent.metrics.standby_warm_since.remove(job, old["mode"])
            self._publish_warmth = True

    async def _check_standbys(self, jobs: dict[str, _Job], running: set[str]) -> None:
        """Forget the warmth of standby workers that are gone; replace those that stopped
        answering (but not a chosen joiner, which is busy taking its rank)."""
        now = time.monotonic()
        for job in list(self.agent.warmth):
            name = standby_child(job)
            if name not in running:
                self._drop_warmth(job)
                continue
            j = jobs.get(job)
            m = j.migration if j else None
            chosen = m is not None and m.active and self.node in m.joiners
            silent = now - self._standby_seen.get(job, now)
            if not chosen and silent > STANDBY_SILENCE_S:
                self.log.warning(f"The standby worker of job {job} stopped answering "
                                 f"({silent:.1f} s silent); replacing it.", job=job)
                self.agent.metrics.errors.labels(kind="standby-silent").inc()
                self._drop_warmth(job)
                await self.supervisor.stop(name, 0.5)
        if self._publish_warmth:
            self._publish_warmth = False
            with contextlib.suppress(StoreError):
                await self.agent.publish()

    async def _check_switches(self, jobs: dict[str, _Job]) -> None:
        """Stop a joiner here that holds its rank's state but has not switched within
        ``JOINER_SWITCH_S`` (it is hung; see there)."""
        now = time.monotonic()
        seen = set()
        for job in jobs.values():
            m = job.migration
            if m is None or m.phase != MigrationPhase.SWITCHING or self.node not in m.joiners:
                continue
            prefix = self.keys.kv(f"{m.job}/migration/{m.id}")
            for rank, joiner in zip(m.ranks, m.joiners, strict=True):
                chosen = self._chosen.get(rank_child(m.job, rank))
                if joiner != self.node or chosen is None or chosen[0] != m.id:
                    continue
                transferred = await self.store.get(prefix + Report.TRANSFERRED.of(rank))
                if transferred is None or transferred.value != TRANSFER_OK or \
                        await self.store.get(prefix + Report.SWITCHED.of(rank)) is not None:
                    continue
                seen.add((m.id, rank))
                since = self._holding_since.setdefault((m.id, rank), now)
                child = next((n for n, c in self.supervisor.children.items()
                              if c.pid == chosen[3] and c.state == ChildState.RUNNING), None)
                if child is None or now - since <= JOINER_SWITCH_S:
                    continue
                self.log.error(f"The joiner of rank {rank} of job {m.job} holds the rank's state "
                               f"but has not switched in {now - since:.0f} s: it is hung. "
                               "Stopping it; the rank is recovered from a replica.",
                               job=m.job, rank=rank, migration=m.id, child=child)
                self.agent.metrics.errors.labels(kind="joiner-hung").inc()
                await self.supervisor.stop(child, 0.5)
        for key in set(self._holding_since) - seen:
            del self._holding_since[key]

    def worker_job(self, pid: int) -> str | None:
        """The job of this daemon's running child ``pid`` (None: no such child): what the local
        socket binds that child's connections to."""
        for name, child in self.supervisor.children.items():
            if child.pid == pid and child.state == ChildState.RUNNING:
                m = _CHILD_RE.match(name)
                return m["job"] if m else None
        return None

    def _assigned_here(self, job: _Job) -> set[str]:
        assert job.spec and job.assignment
        return {rank_child(job.spec.name, r) for r in job.assignment.ranks_on(self.node)}

    def _promotions(self, jobs: dict[str, _Job]) -> dict[str, tuple[_Job, int, int, str]]:
        """Ranks this node takes over in a migration that reached its switch: child name ->
        (job, rank, new epoch, migration id). Held from the switch on, before the new
        assignment lands."""
        out = {}
        children = self.supervisor.children
        for job in jobs.values():
            m = job.migration
            assert job.spec is not None
            if m is not None and m.kind == MigrationKind.RESTART:
                continue  # a restart starts its ranks afresh: nobody is promoted
            standby = children.get(standby_child(job.spec.name))
            if m is not None and m.phase != MigrationPhase.ABORTED and standby is not None \
                    and standby.state == ChildState.RUNNING:
                for rank, joiner in zip(m.ranks, m.joiners, strict=True):
                    chosen = self._chosen.get(rank_child(m.job, rank))
                    if joiner == self.node and (chosen is None or chosen[0] != m.id):
                        # The standby running when the migration was first seen: a fresh
                        # one started after it died is not the joiner (it never took part).
                        self._chosen[rank_child(m.job, rank)] = (m.id, rank, m.to_epoch,
                                                                 standby.pid)
            a = job.assignment
            for name, (mid, rank, epoch, pid) in list(self._chosen.items()):
                if not name.startswith(f"{job.spec.name}."):
                    continue
                if a is not None and a.epoch > epoch:
                    del self._chosen[name]
                elif a is not None and a.epoch == epoch and rank < len(a.ranks) and \
                        a.ranks[rank] == self.node and standby is not None and \
                        standby.pid == pid:
                    # committed, and the migration record moved on before we saw it done
                    out[name] = (job, rank, epoch, mid)
            if m is None or m.phase not in (MigrationPhase.SWITCHING, MigrationPhase.DONE):
                continue
            if job.assignment is not None and job.assignment.epoch > m.to_epoch:
                continue
            for rank, joiner in zip(m.ranks, m.joiners, strict=True):
                name = rank_child(m.job, rank)
                chosen, held = self._chosen.get(name), children.get(name)
                if chosen is not None and chosen[0] == m.id and not (
                        held is not None and held.state == ChildState.RUNNING) and (
                        standby is None or standby.pid != chosen[3]):
                    continue  # the joiner died (see on_exit); the standby now is another
                if joiner == self.node:
                    out[rank_child(m.job, rank)] = (job, rank, m.to_epoch, m.id)
        return out

    async def _promote(self, promotions: dict[str, tuple[_Job, int, int, str]],
                       running: set[str]) -> None:
        """A standby chosen as a joiner becomes the rank's child once the switch is agreed,
        and its node becomes active."""
        for name, (job, rank, epoch, migration) in promotions.items():
            self._held_epoch[name] = max(self._held_epoch.get(name, 0), epoch)
            assert job.spec is not None
            standby = standby_child(job.spec.name)
            if name in running or standby not in running:
                continue
            self.supervisor.rename(standby, name)
            if self.ranklogs is not None:
                self.ranklogs.retarget(self.supervisor.children[name].pid, job.spec.name, rank,
                                       epoch)
            self._promoted[name] = (migration, epoch)
            running.discard(standby)
            running.add(name)
            self.log.info(f"Standby promoted to rank {rank} of job {job.spec.name}.",
                          job=job.spec.name, rank=rank, epoch=epoch)
            if self.agent.state == NodeState.STANDBY:
                await self.agent.set_state(NodeState.ACTIVE,
                                           f"holds rank {rank} of job {job.spec.name}")

    async def readopt(self) -> tuple[list[str], list[str]]:
        """After this node lost its lease and registered again: kill at once every worker that
        was replaced meanwhile, or cannot be shown not to be; returns (killed, kept) child
        names. Called once the new node record exists, so what it reads is final: the
        controller writes a recovery of a lost node's ranks only while that node has no record
        (its transaction compares that), so a plan that is not here now can never come.

        A rank is kept when its job still runs it here at the epoch this node held it, and no
        migration from that epoch is taking it; a standby worker when its node is still one of
        the job's standbys and not a joiner of an unfinished migration. Retries the read while
        etcd does not answer (the workers run on meanwhile, as in an outage)."""
        backoff = Backoff()  # jittered: the fleet comes back spread out
        while True:
            try:
                jobs = await self._read_jobs()
                break
            except StoreError:
                if self.stop.is_set():
                    return [], []
                self.agent.metrics.etcd_retries.labels(call="read-jobs").inc()
                await wait_any((self.stop,), backoff.next())
        killed: list[str] = []
        kept: list[str] = []
        for name, child in sorted(self.supervisor.children.items()):
            m = _CHILD_RE.match(name)
            if m is None or child.state != ChildState.RUNNING:
                continue
            j = jobs.get(m["job"])
            ok = False
            if j is not None and j.assignment is not None and j.status is not None and \
                    j.status.state == JobState.RUNNING:
                a, mig = j.assignment, j.migration
                taking = mig is not None and mig.phase != MigrationPhase.ABORTED and \
                    mig.from_epoch == a.epoch and mig.kind != MigrationKind.RESHAPE
                if m["rank"] is not None:
                    rank = int(m["rank"])
                    ok = a.epoch == self._held_epoch.get(name) and rank < len(a.ranks) and \
                        a.ranks[rank] == self.node and not (
                            taking and mig is not None and rank in mig.ranks)
                else:
                    ok = self.node in a.standbys and not (
                        taking and mig is not None and self.node in mig.joiners)
            (kept if ok else killed).append(name)
        self.supervisor.kill_now(killed)
        self._changed.set()
        return killed, kept

    def epoch_check(self, namespace: str, epoch: int) -> str | None:
        """Refuse a worker whose epoch is older than its job's assignment: it was fenced out
        (its rank moved, or its node lost its lease) and must not touch the job's groups."""
        j = self._jobs.get(namespace.split("/", 1)[0])
        if j is None or j.assignment is None or epoch >= j.assignment.epoch:
            return None
        return f"job {j.assignment.job} is at epoch {j.assignment.epoch}"

    def _republish(self) -> None:
        """Workers waiting for their job's view to change (localsock's job watch) look again."""
        published, self._published = self._published, asyncio.Event()
        published.set()

    def next_view(self) -> asyncio.Event:
        """An event set the next time the jobs' view (what :meth:`job_info` answers from) is
        taken afresh from the watch's listing (at each reconcile)."""
        return self._published

    def job_info(self, job: str) -> dict[str, Any] | None:
        """What a worker of ``job`` may know about it, from the last reconcile; during an etcd
        outage also ``"etcd": "unreachable"``: the view may be stale, and a recovery cannot be
        planned before etcd is back (a survivor waiting for one waits on)."""
        j = self._jobs.get(job)
        if j is None:
            return None
        info: dict[str, Any] = {
            name: json.loads(rec.encode()) if rec is not None else None
            for name, rec in (("assignment", j.assignment), ("status", j.status),
                              ("migration", j.migration), ("stop", j.stop))}
        if self.agent.outage_since is not None:
            info["etcd"] = "unreachable"
        return info

    async def ranks_moved(self, deadline: float) -> bool:
        """Wait (until wall time ``deadline``) for this node to hold no rank of a running job
        with a standby to move to. True if nothing is left to move."""
        while self.wall() < deadline and not self.stop.is_set():
            try:
                jobs = self._listed_jobs()
            except StoreError:
                jobs = None
            if jobs is not None and not any(
                    j.status and j.status.state == JobState.RUNNING and j.assignment
                    and j.assignment.ranks_on(self.node) and j.assignment.standbys
                    for j in jobs.values()):
                return True
            await wait_any((self.stop, self._changed), 0.2)
        return False

    async def _exited(self, job: str, epoch: int, rank: int) -> bool:
        return await self.store.get(self.keys.rank_exit(job, epoch, rank)) is not None

    async def _spawn(self, spec: JobSpec, assignment: Assignment, rank: int | None,
                     extra: Mapping[str, str] | None = None, lease: int | None = None) -> None:
        """Start rank ``rank`` of the job (a standby worker: None), as decided under
        ``lease``: if the node no longer holds it (it fenced since, and may have registered
        again), nothing is started; the next reconcile decides afresh under the new lease."""
        await failpoints.ahit("daemon.spawn")
        if not self._still_holds(lease):
            self.log.info("Not starting a worker: this node lost the lease it was decided "
                          "under.", job=spec.name, rank=rank, epoch=assignment.epoch)
            return
        worker_env = {
            **spec.env,
            env.CHILD_SOCKET: str(self.agent.cfg.socket_path),
            env.CHILD_NODE: self.node,
            env.JOB: spec.name,
            # The submitted shape, also for a standby of a job that shrank: its recordings are
            # of it, and a grow takes the job back to it (a standby chosen for another shape
            # builds the job for that one: worker.launch._follow_shape).
            env.WORLD_SIZE: str(spec.world_size),
            env.TP: str(spec.tp),
            env.DP: str(spec.dp),
            env.PP: str(spec.pp),
            env.EPOCH: str(assignment.epoch),
            env.WORKER_ROLE: env.WorkerRole.STANDBY if rank is None else env.WorkerRole.RANK,
        }
        if rank is not None:
            tp_index, dp_index, pp_index = spec.layout.coordinates(rank)
            worker_env.update({env.RANK: str(rank), env.TP_INDEX: str(tp_index),
                               env.DP_INDEX: str(dp_index), env.PP_INDEX: str(pp_index)})
            name = rank_child(spec.name, rank)
        else:
            name = standby_child(spec.name)
        worker_env.update(huge_pages(spec.env, os.environ))
        if self.agent.worker_address:  # its gloo groups and servers (a snapshot holder)
            worker_env[env.NODE_ADDRESS] = self.agent.worker_address
        worker_env.update(extra or {})  # a restart-only rank's torchrun variables
        if rank is not None:
            self._started.add((spec.name, rank, assignment.epoch))
        # The worker's stdout and stderr: a pipe into its own log file (``daemon/ranklogs.py``).
        pipe = self.ranklogs.pipe() if self.ranklogs is not None else None
        try:
            pid = await self.supervisor.spawn(name, list(spec.argv), env=worker_env,
                                              cwd=spec.cwd or None,
                                              output=pipe[1] if pipe else None,
                                              local_slots=self.agent.cfg.slots)
        except (OSError, ValueError, SpawnError) as exc:
            if pipe is not None:
                os.close(pipe[0])
            self.log.error("Could not start a worker.", job=spec.name, rank=rank,
                           error=str(exc))
            if rank is not None:
                self._ended.add((spec.name, rank, assignment.epoch))
                await self._write_exit(spec.name, rank, assignment.epoch, 127, True,
                                       f"could not start {spec.argv[0]!r}: {exc}")
            return
        finally:
            if pipe is not None:
                os.close(pipe[1])  # the child holds its own copy
        if not self._still_holds(lease):
            # The fence came while the process started (readopt may have run without it).
            self.log.warning("Stopping a worker started as the node lost its lease.",
                             job=spec.name, rank=rank, epoch=assignment.epoch, pid=pid)
            self.supervisor.kill_now([name])
        if pipe is not None and self.ranklogs is not None:
            await self.ranklogs.attach(pipe[0], pid, spec.name, rank, assignment.epoch)
        what = "a standby worker" if rank is None else f"rank {rank}"
        self.log.info(f"Started {what} of job {spec.name}.", job=spec.name, rank=rank,
                      epoch=assignment.epoch, pid=pid)
        with contextlib.suppress(StoreError):
            await self.agent.publish()  # the node record carries the worker count

    def _still_holds(self, lease: int | None) -> bool:
        """The node is registered under ``lease`` (any lease, for None)."""
        return self.agent.registered.is_set() and (lease is None or self.agent.lease == lease)

    async def on_exit(self, child: ChildExit) -> None:
        m = _CHILD_RE.match(child.name)
        if m is None:
            return
        if self.ranklogs is not None:
            self.ranklogs.ended(child.pid)
        self._changed.set()
        if m["rank"] is None:
            self._drop_warmth(m["job"])
            chosen = self._chosen_joiner(m["job"], child)
            if chosen is not None:
                name, rank, mid = chosen
                epoch = self._chosen[name][2]
                self._held_epoch[name] = max(self._held_epoch.get(name, 0), epoch)
                await self._settle_exit(m["job"], rank, name, child, (mid, epoch))
                return
            await self._joiner_gone(m["job"], child)
            if child.failed:
                self._standby_failures[child.name] = \
                    self._standby_failures.get(child.name, 0) + 1
                if self._standby_failures[child.name] >= MAX_STANDBY_FAILURES:
                    self.log.error("A standby worker keeps failing; not starting it again.",
                                   child=child.name, cause=child.describe())
            return
        rank = int(m["rank"])
        promoted = self._promoted.pop(child.name, None)
        await self._settle_exit(m["job"], rank, child.name, child, promoted)

    def _chosen_joiner(self, job: str, child: ChildExit) -> tuple[str, int, str] | None:
        """(rank child name, rank, migration id) when ``child``, a standby worker of ``job``,
        was chosen as the joiner of a migration that got as far as ``ready``: it may have held
        the rank (the ranks agree on the switch by their step vote, and a joiner can take the
        state and end before its daemon sees the switch), so its end is settled as a promoted
        joiner's: by its leaver's word, never by its absence."""
        j = self._jobs.get(job)
        mig = j.migration if j else None
        for name, (mid, rank, _, pid) in self._chosen.items():
            if pid == child.pid and name.startswith(f"{job}.") and mig is not None \
                    and mig.id == mid and mig.phase in (MigrationPhase.READY,
                                                        MigrationPhase.SWITCHING,
                                                        MigrationPhase.DONE):
                return name, rank, mid
        return None

    async def _settle_exit(self, job: str, rank: int, name: str, child: ChildExit,
                           promoted: tuple[str, int] | None) -> None:
        """Record the end of the process that held (or may have held) ``rank``."""
        if promoted is not None:
            # Until the exit is settled (the wait below reads etcd), a reconcile must not take
            # the rank for one that no process holds.
            self._settling.add(name)
            try:
                if await self._joiner_died_before_commit(job, rank, child, *promoted):
                    return
            finally:
                self._settling.discard(name)
        epoch = self._held_epoch.get(name, 0)
        self._ended.add((job, rank, epoch))
        code = child.returncode if child.returncode is not None else -(child.signal or 0)
        await self._write_exit(job, rank, epoch, code, code != 0, child.describe(),
                               child.error.exc_type if child.error else "")

    async def _joiner_gone(self, job: str, child: ChildExit) -> None:
        """A standby that was chosen as a joiner ended before the switch: the migration cannot
        complete. Say so at once (the controller aborts it; the leaver keeps training)."""
        j = self._jobs.get(job)
        m = j.migration if j else None
        if m is None or not m.active or self.node not in m.joiners \
                or m.phase == MigrationPhase.SWITCHING:
            return
        key = self.keys.kv(f"{job}/migration/{m.id}") + Report.ABORTED
        why = _joiner_end(self.node, child)
        self.log.warning("A joiner ended before the switch; its migration is called off.",
                         job=job, migration=m.id, cause=why)
        # Through an etcd outage too: a call-off lost there left the migration live, and the
        # fresh standby chosen for it after the outage waited 20 s for groups that could never
        # come up (seen in test_a_drain_caught_in_phase_1_by_an_outage).
        await self._put_until_taken(key, why.encode(), "a migration's call-off", job=job,
                                    migration=m.id)

    async def _joiner_died_before_commit(self, job: str, rank: int, child: ChildExit,
                                         migration: str, epoch: int) -> bool:
        """A joiner promoted at the switch died before its migration committed. If the
        leaver's state never reached it, the leaver still holds the rank (the survivors switch
        only after ``transferred ok``): the migration is called off, no exit is recorded for
        the rank (the epoch is reused by the next attempt) and the node is a standby again.
        True in that case; False if the joiner held the rank (its exit is the rank's).

        The leaver's word decides, never its absence: a joiner that took the whole state can
        die before its leaver has said so (the two reports travel through different daemons),
        and calling the migration off then would lose the rank, since its leaver has handed
        off and left. So this waits, reading etcd afresh, until the leaver reports the
        transfer, the migration is called off (by anyone), or the new epoch is committed."""
        prefix = self.keys.kv(f"{job}/migration/{migration}")
        deadline = time.monotonic() + JOINER_VERDICT_WAIT_S
        outcome: str | None = None
        while outcome is None:
            if self.stop.is_set():
                return False
            try:
                transferred = await self.store.get(prefix + Report.TRANSFERRED.of(rank))
                if transferred is not None:
                    outcome = "ok" if transferred.value == TRANSFER_OK else "failed"
                    break
                a = await self.store.get(self.keys.job_assignment(job))
                if a is not None and Assignment.decode(a.value).epoch >= epoch:
                    return False  # committed: the joiner held the rank
                m = await self.store.get(self.keys.job_migration(job))
                mig = Migration.decode(m.value) if m is not None else None
                if mig is None or mig.id != migration or mig.phase == MigrationPhase.ABORTED:
                    outcome = "called off"
                    break
            except (StoreError, RecordError) as exc:
                self.log.debug("Cannot read the migration's outcome yet.", job=job,
                               error=str(exc))
            if time.monotonic() > deadline:
                outcome = "no word"
                self.log.error(f"No word from rank {rank}'s leaver within "
                               f"{JOINER_VERDICT_WAIT_S:.0f} s of its joiner's death; calling "
                               "the migration off.", job=job, rank=rank, migration=migration)
                break
            await wait_any((self.stop,), 0.1)
        if outcome == "ok":
            return False
        why = _joiner_end(self.node, child, "before it held the state")
        if outcome != "called off":
            with contextlib.suppress(StoreError):
                await self.store.put(prefix + Report.ABORTED, why.encode())
        self.log.warning("A joiner ended before it held the state; its migration is called "
                         "off and the leaver keeps the rank.", job=job, rank=rank,
                         migration=migration, cause=why)
        holds = any(jb.assignment and jb.assignment.ranks_on(self.node)
                    for jb in (await self._read_jobs_or_cached()).values())
        if self.agent.state == NodeState.ACTIVE and not holds:
            with contextlib.suppress(StoreError):
                await self.agent.set_state(NodeState.STANDBY,
                                           "its joiner died before the switch completed")
        return True

    async def _read_jobs_or_cached(self) -> dict[str, _Job]:
        try:
            return await self._read_jobs()
        except StoreError:
            return self._jobs

    async def _rank_missing(self, job: str, rank: int, epoch: int) -> None:
        self._ended.add((job, rank, epoch))
        self.log.error(f"Rank {rank} of job {job} is assigned here at epoch {epoch} but no "
                       "process of this node holds it; recording it as failed.", job=job,
                       rank=rank, epoch=epoch)
        await self._write_exit(job, rank, epoch, -1, True,
                               f"no process holds rank {rank} on {self.node} at epoch {epoch} "
                               "(it ended during a migration, or the daemon restarted)")

    async def _write_exit(self, job: str, rank: int, epoch: int, code: int, failed: bool,
                          description: str, error_type: str = "") -> None:
        """Record how a rank's process ended. Retried until etcd takes it (an outage of any
        length) or the daemon stops: the rank is in ``_ended`` already, so an exit that never
        reached etcd would leave the job waiting for a rank nobody runs."""
        if not failed:
            # A fault test's node lost as its ranks end, before it reports them (exit(N))
            failpoints.hit("daemon.rank-exit.clean")
        record = RankExit(job=job, rank=rank, epoch=epoch, node=self.node, returncode=code,
                          failed=failed, description=description, time=self.wall(),
                          error_type=error_type)
        await self._put_until_taken(self.keys.rank_exit(job, epoch, rank), record.encode(),
                                    "a rank's exit", job=job, rank=rank, epoch=epoch)

    async def _put_until_taken(self, key: str, value: bytes, what: str, **fields: Any) -> None:
        """Write ``value`` at ``key``, retried until etcd takes it (an outage of any length)
        or the daemon stops; ``what`` and ``fields`` name it in the log."""
        delay, warned = 0.2, False
        while True:
            try:
                await self.store.put(key, value)
                if warned:
                    self.log.info(f"Recorded {what} in etcd after all.", **fields)
                return
            except StoreError as exc:
                if not warned:
                    warned = True
                    self.log.warning(f"Cannot record {what} in etcd yet; retrying until it "
                                     "can.", error=str(exc), **fields)
            await wait_any((self.stop,), delay)
            if self.stop.is_set():
                self.log.error(f"Stopping before {what} reached etcd.", **fields)
                return
            delay = min(2.0, delay * 2)


def _replacing(job: _Job, rank: int) -> bool:
    """Whether a migration from the job's current epoch is taking ``rank`` elsewhere."""
    m, a = job.migration, job.assignment
    # (a reshape's ranks are numbered in the new shape)
    return m is not None and a is not None and m.active and m.from_epoch == a.epoch and \
        m.kind != MigrationKind.RESHAPE and rank in m.ranks


def _free_port(addr: str) -> int:
    """A port free on ``addr`` now (the kernel's choice), for rank 0's script to bind. Another
    process could take it before the script does; the script then fails and the job restarts
    with a fresh one, as torchrun's own pick of a free port can."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _joiner_end(node: str, child: ChildExit, when: str = "") -> str:
    """Why a joiner's migration is called off: it "gave up" if it left on its own (its takeover
    failed; its recorded error says why), else it "died"."""
    when = f" {when}" if when else ""
    if child.state == ChildState.EXITED:
        return (f"the joiner on {node} gave up{when}: "
                f"{child.error.summary() if child.error else child.describe()}")
    return f"the joiner on {node} died{when}: {child.describe()}"
