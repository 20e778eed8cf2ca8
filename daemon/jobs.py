"""Runs this node's share of each job: spawns the ranks the assignment places here, and writes
how each rank's process ended (``jobs/<job>/exits/<epoch>/<rank>``) for the controller.

A rank is spawned only while the node is ``active`` and the job ``running``. Each worker gets
its coordinates and the daemon's socket in its environment (names in ``daemon/env.py``); it
reaches etcd only through that socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable

from understudy.daemon import env, logs
from understudy.daemon.errors import RecordError, StoreError
from understudy.daemon.keys import Keys
from understudy.daemon.node import NodeAgent
from understudy.daemon.records import Assignment, JobSpec, JobState, JobStatus, RankExit
from understudy.daemon.states import NodeState
from understudy.daemon.store import EtcdStore, wait_any
from understudy.daemon.supervisor import ChildExit, Supervisor

_CHILD_RE = re.compile(r"^(?P<job>[a-z0-9-]+)\.r(?P<rank>\d+)\.e(?P<epoch>\d+)$")


def child_name(job: str, rank: int, epoch: int) -> str:
    return f"{job}.r{rank}.e{epoch}"


class JobRunner:
    def __init__(self, agent: NodeAgent, store: EtcdStore, supervisor: Supervisor,
                 stop: asyncio.Event, wall: Callable[[], float] = time.time,
                 resync_interval: float = 5.0) -> None:
        self.agent, self.store, self.supervisor, self.stop = agent, store, supervisor, stop
        self.keys = Keys(agent.cfg.etcd.prefix)
        self.node = agent.cfg.node
        self.wall = wall
        self.resync_interval = resync_interval
        self.log = logs.get(node=self.node)
        self._changed = asyncio.Event()
        self._bad_seen: set[tuple[str, int]] = set()
        #: Ranks whose process ended here, even if etcd has not heard yet: never started again
        #: under the same epoch (after a fence, the old epoch's rank must not come back).
        self._ended: set[str] = set()

    async def run(self) -> None:
        watch = asyncio.create_task(self._watch(), name="jobs-watch")
        try:
            while not self.stop.is_set():
                await wait_any((self._changed, self.stop), self.resync_interval)
                self._changed.clear()
                if self.stop.is_set():
                    break
                try:
                    await self._reconcile()
                except StoreError as exc:
                    self.log.debug("Job reconcile failed; will retry.", error=str(exc))
        finally:
            watch.cancel()
            await asyncio.wait({watch}, timeout=2)

    def poke(self) -> None:
        self._changed.set()

    async def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                rev = await self.store.current_revision()
            except StoreError:
                await wait_any((self.stop,), 0.5)
                continue
            self._changed.set()
            async for _ in self.store.watch_prefix(self.keys.jobs, rev + 1, self.stop):
                self._changed.set()

    async def _read_jobs(self) -> dict[str, tuple[JobSpec, Assignment, JobStatus]]:
        kvs, _ = await self.store.get_prefix(self.keys.jobs)
        specs: dict[str, JobSpec] = {}
        assignments: dict[str, Assignment] = {}
        statuses: dict[str, JobStatus] = {}
        for kv in kvs:
            job, _, rest = Keys.name_of(kv.key, self.keys.jobs).partition("/")
            try:
                if rest == "spec":
                    specs[job] = JobSpec.decode(kv.value)
                elif rest == "assignment":
                    assignments[job] = Assignment.decode(kv.value)
                elif rest == "status":
                    statuses[job] = JobStatus.decode(kv.value)
            except RecordError as exc:
                if (kv.key, kv.mod_revision) not in self._bad_seen:
                    self._bad_seen.add((kv.key, kv.mod_revision))
                    self.agent.metrics.bad_values.labels(collection="jobs").inc()
                    self.log.warning("Ignoring a bad value in etcd.", key=kv.key,
                                     problem=str(exc))
        return {j: (specs[j], assignments[j], statuses[j]) for j in specs
                if j in assignments and j in statuses}

    async def _reconcile(self) -> None:
        jobs = await self._read_jobs()
        wanted: dict[str, tuple[JobSpec, Assignment, int]] = {}
        if self.agent.state == NodeState.ACTIVE and self.agent.lease is not None:
            for spec, assignment, status in jobs.values():
                if status.state != JobState.RUNNING:
                    continue
                for rank in assignment.ranks_on(self.node):
                    name = child_name(spec.name, rank, assignment.epoch)
                    wanted[name] = (spec, assignment, rank)
        running = self.supervisor.children
        for name, (spec, assignment, rank) in sorted(wanted.items()):
            if name in running or name in self._ended \
                    or await self._exited(spec.name, assignment.epoch, rank):
                continue
            await self._spawn(spec, assignment, rank)
        for name in running:
            if _CHILD_RE.match(name) and name not in wanted:
                self.log.info("Stopping a rank this node no longer holds.", child=name)
                await self.supervisor.stop(name, self.agent.cfg.drain.stop_grace)

    async def _exited(self, job: str, epoch: int, rank: int) -> bool:
        return await self.store.get(self.keys.rank_exit(job, epoch, rank)) is not None

    async def _spawn(self, spec: JobSpec, assignment: Assignment, rank: int) -> None:
        tp_index, dp_index = rank % spec.tp, rank // spec.tp
        worker_env = {
            **spec.env,
            env.CHILD_SOCKET: str(self.agent.cfg.socket_path),
            env.CHILD_NODE: self.node,
            env.JOB: spec.name,
            env.RANK: str(rank),
            env.WORLD_SIZE: str(spec.world_size),
            env.TP: str(spec.tp),
            env.DP: str(spec.dp),
            env.TP_INDEX: str(tp_index),
            env.DP_INDEX: str(dp_index),
            env.EPOCH: str(assignment.epoch),
            env.WORKER_ROLE: "rank",
        }
        name = child_name(spec.name, rank, assignment.epoch)
        try:
            pid = await self.supervisor.spawn(name, list(spec.argv), env=worker_env,
                                              cwd=spec.cwd or None)
        except (OSError, ValueError) as exc:
            self.log.error("Could not start a rank.", job=spec.name, rank=rank, error=str(exc))
            self._ended.add(name)
            await self._write_exit(spec.name, rank, assignment.epoch, 127, True,
                                   f"could not start {spec.argv[0]!r}: {exc}")
            return
        self.log.info(f"Started rank {rank} of job {spec.name}.", job=spec.name, rank=rank,
                      epoch=assignment.epoch, pid=pid)
        with contextlib.suppress(StoreError):
            await self.agent.publish()  # the node record carries the worker count

    async def on_exit(self, child: ChildExit) -> None:
        m = _CHILD_RE.match(child.name)
        if m is None:
            return
        self._ended.add(child.name)
        code = child.returncode if child.returncode is not None else -(child.signal or 0)
        await self._write_exit(m["job"], int(m["rank"]), int(m["epoch"]), code, code != 0,
                               child.describe())
        self._changed.set()

    async def _write_exit(self, job: str, rank: int, epoch: int, code: int, failed: bool,
                          description: str) -> None:
        record = RankExit(job=job, rank=rank, epoch=epoch, node=self.node, returncode=code,
                          failed=failed, description=description, time=self.wall())
        for _ in range(20):
            try:
                await self.store.put(self.keys.rank_exit(job, epoch, rank), record.encode())
                return
            except StoreError:
                if self.stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 0.5)
        self.log.error("Could not record a rank's exit in etcd.", job=job, rank=rank)
