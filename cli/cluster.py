"""What the CLI reads: one consistent picture of the cluster from etcd."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from understudy.common.errors import RecordError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.ranklogs import LogFile
from understudy.common.records import (
    JOB_RECORDS,
    Assignment,
    ControllerRecord,
    DrainRequest,
    Event,
    JobSpec,
    JobState,
    JobStatus,
    Migration,
    NodeRecord,
    RegistryEntry,
    ResizeRequest,
    StopRequest,
    decode_job_record,
)
from understudy.common.states import NodeState
from understudy.common.store import EtcdStore


class UnknownJob(UnderstudyError):
    """A CLI command named a job the cluster does not have (exit code 1)."""


@dataclass
class NodeView:
    name: str
    state: NodeState
    online: bool
    cordoned: bool = False
    role: str = ""
    slots: int = 0
    workers: int = 0
    failure_domain: str = ""
    addresses: tuple[str, ...] = ()
    reason: str = ""
    since: float = 0.0
    drain: DrainRequest | None = None
    first_failure: str = ""
    health: tuple[str, ...] = ()
    #: job -> what this node's standby worker for it reported warm (as in the node record)
    warmth: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "state": self.state, "online": self.online,
            "cordoned": self.cordoned, "role": self.role, "slots": self.slots,
            "workers": self.workers, "failure_domain": self.failure_domain,
            "addresses": list(self.addresses), "reason": self.reason, "since": self.since,
            "drain": None if self.drain is None else {
                "source": self.drain.source, "reason": self.drain.reason,
                "deadline": self.drain.deadline, "requested_by": self.drain.requested_by},
            "first_failure": self.first_failure, "health": list(self.health),
            "warmth": self.warmth,
        }


@dataclass
class JobView:
    spec: JobSpec
    status: JobStatus | None
    assignment: Assignment | None
    migration: Migration | None = None
    resize: ResizeRequest | None = None
    stop: StopRequest | None = None
    #: where each process that held one of its ranks wrote its output, in the order they
    #: started (``understudy logs``)
    logs: list[LogFile] = field(default_factory=list)

    def log_places(self) -> dict[str, tuple[str, list[int]]]:
        """node -> (the job's log directory there, the ranks whose files it holds)."""
        out: dict[str, tuple[str, list[int]]] = {}
        for f in self.logs:
            ranks = out.setdefault(f.node, (f.path.rsplit("/", 1)[0], []))[1]
            if f.rank not in ranks:
                ranks.append(f.rank)
        return {n: (d, sorted(r)) for n, (d, r) in sorted(out.items())}

    @property
    def state(self) -> JobState:
        return self.status.state if self.status else JobState.PENDING

    @property
    def paused(self) -> bool:
        """Running, but waiting for standbys to recover a lost rank."""
        return self.status is not None and self.status.paused

    @property
    def shown_state(self) -> str:
        """The state as a table shows it: ``running (paused)``, ``running (stopping)``."""
        note = "paused" if self.paused else "stopping" if self.stop is not None and \
            not self.state.ended else ""
        return f"{self.state} ({note})" if note else self.state

    @property
    def dp_now(self) -> int:
        """The data-parallel size the job trains at: its assignment's (smaller than its
        ``--dp`` after a reshape shrank it)."""
        a, spec = self.assignment, self.spec
        return len(a.ranks) // (spec.tp * spec.pp) if a is not None and a.ranks else spec.dp

    def as_json(self) -> dict[str, Any]:
        a = self.assignment
        return {
            "name": self.spec.name, "state": self.state, "paused": self.paused,
            "reason": self.status.reason if self.status else "",
            "tp": self.spec.tp, "dp": self.spec.dp, "pp": self.spec.pp,
            "dp_now": self.dp_now, "reshape": self.spec.reshape,
            "resize_dp": self.resize.dp if self.resize is not None else None,
            "stop": None if self.stop is None else {
                "requested_at": self.stop.requested_at, "grace": self.stop.grace,
                "requested_by": self.stop.requested_by},
            "standby": self.spec.standby,
            "argv": list(self.spec.argv), "epoch": a.epoch if a else 0,
            "ranks": list(a.ranks) if a else [], "standbys": list(a.standbys) if a else [],
            "migration": None if self.migration is None else {
                "id": self.migration.id, "phase": str(self.migration.phase),
                "ranks": list(self.migration.ranks), "leavers": list(self.migration.leavers),
                "joiners": list(self.migration.joiners), "reason": self.migration.reason,
                "timings": self.migration.timings},
            "logs": {"command": f"understudy logs {self.spec.name}",
                     "files": [{"rank": f.rank, "node": f.node, "epoch": f.epoch, "pid": f.pid,
                                "path": f.path, "started_at": f.started_at}
                               for f in self.logs]},
        }


@dataclass
class ClusterStatus:
    nodes: list[NodeView]
    controller: str | None
    revision: int
    ignored: list[str] = field(default_factory=list)
    jobs: list[JobView] = field(default_factory=list)

    def node(self, name: str) -> NodeView | None:
        return next((n for n in self.nodes if n.name == name), None)

    def job(self, name: str) -> JobView | None:
        return next((j for j in self.jobs if j.spec.name == name), None)

    def require_job(self, name: str) -> JobView:
        """Job ``name``.

        Raises: UnknownJob: there is none (the sentence names the jobs there are)."""
        job = self.job(name)
        if job is None:
            known = ", ".join(j.spec.name for j in self.jobs) or "none"
            raise UnknownJob(f"no job named {name!r} in this cluster (known: {known})")
        return job

    def as_json(self) -> dict[str, Any]:
        return {"controller": self.controller, "revision": self.revision,
                "nodes": [n.as_json() for n in self.nodes],
                "jobs": [j.as_json() for j in self.jobs], "ignored_keys": self.ignored}


async def read_cluster(store: EtcdStore, keys: Keys) -> ClusterStatus:
    """Read nodes, registry, drains and controller. Bad values are listed, never fatal."""
    ignored: list[str] = []
    registry: dict[str, RegistryEntry] = {}
    kvs, revision = await store.get_prefix(keys.registry)
    for kv in kvs:
        try:
            registry[Keys.name_of(kv.key, keys.registry)] = RegistryEntry.decode(kv.value)
        except RecordError:
            ignored.append(kv.key)
    live: dict[str, NodeRecord] = {}
    for kv in (await store.get_prefix(keys.nodes))[0]:
        try:
            live[Keys.name_of(kv.key, keys.nodes)] = NodeRecord.decode(kv.value)
        except RecordError:
            ignored.append(kv.key)
    drains: dict[str, DrainRequest] = {}
    for kv in (await store.get_prefix(keys.drains))[0]:
        try:
            drains[Keys.name_of(kv.key, keys.drains)] = DrainRequest.decode(kv.value)
        except RecordError:
            ignored.append(kv.key)
    controller = None
    ckv = await store.get(keys.controller)
    if ckv is not None:
        try:
            controller = ControllerRecord.decode(ckv.value).node
        except RecordError:
            ignored.append(ckv.key)
    nodes = []
    for name in sorted(set(registry) | set(live)):
        entry, rec = registry.get(name), live.get(name)
        if rec is not None:
            view = NodeView(name=name, state=rec.state, online=True, role=rec.role,
                            slots=rec.slots, workers=rec.workers,
                            failure_domain=rec.failure_domain, addresses=rec.addresses,
                            reason=rec.reason, since=rec.state_since,
                            first_failure=rec.first_failure, health=rec.health,
                            warmth=rec.warmth)
        else:
            assert entry is not None
            view = NodeView(name=name, state=entry.state, online=False,
                            reason=entry.reason, since=entry.updated_at)
        view.cordoned = bool(entry and entry.cordoned)
        view.drain = drains.get(name)
        nodes.append(view)
    return ClusterStatus(nodes=nodes, controller=controller, revision=revision, ignored=ignored,
                         jobs=await _read_jobs(store, keys, ignored))


async def _read_jobs(store: EtcdStore, keys: Keys, ignored: list[str]) -> list[JobView]:
    tables: dict[str, dict[str, Any]] = {name: {} for name in JOB_RECORDS}
    for kv in (await store.get_prefix(keys.jobs))[0]:
        try:
            decoded = decode_job_record(Keys.name_of(kv.key, keys.jobs), kv.value)
        except RecordError:
            ignored.append(kv.key)
            continue
        if decoded is not None:
            job, name, record = decoded
            tables[name][job] = record
    files: dict[str, list[LogFile]] = {}
    for kv in (await store.get_prefix(keys.log_files))[0]:
        try:
            f = LogFile.decode(kv.value)
        except RecordError:
            ignored.append(kv.key)
            continue
        files.setdefault(f.job, []).append(f)
    return [JobView(spec, tables["status"].get(name), tables["assignment"].get(name),
                    tables["migration"].get(name), tables["resize"].get(name),
                    tables["stop"].get(name),
                    sorted(files.get(name, []), key=lambda f: (f.epoch, f.started_at, f.rank)))
            for name, spec in sorted(tables["spec"].items())]


async def read_events(store: EtcdStore, keys: Keys) -> tuple[list[Event], int]:
    events = []
    kvs, rev = await store.get_prefix(keys.events)
    for kv in kvs:
        try:
            events.append(Event.decode(kv.value))
        except RecordError:
            continue
    return events, rev
