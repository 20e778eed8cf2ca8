"""Prometheus metrics of one daemon, served on ``metrics_listen``: plain HTTP, or HTTPS with
``[metrics] cert`` and ``key`` (and scrapers' client certificates checked with ``client_ca``).

Label values come from this daemon's own code, or from a bounded set: a value read from etcd
(a drain request's source, which anyone who may write the prefix writes) is mapped onto the
sources understudy writes, anything else counts as ``other``, so a foreign write cannot grow a
series per value."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import platform
import ssl
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from understudy.common.config import MetricsConfig
from understudy.common.errors import ConfigError
from understudy.common.records import DrainSource, JobState
from understudy.common.states import NodeState
from understudy.common.version import VERSION
from understudy.common.worker_report import DIRECTIONS, STEP_PARTS, WorkerReport

#: buckets of a step's duration, seconds: a tiny CPU job's milliseconds to a large model's
#: tens of seconds
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lease_age = Gauge("understudy_lease_age_seconds",
                               "Seconds since the last acknowledged lease keep-alive.",
                               registry=r)
        self.node_state = Gauge("understudy_node_state", "1 for the node's current state.",
                                ["state"], registry=r)
        self.cordoned = Gauge("understudy_node_cordoned", "1 if the node is cordoned.",
                              registry=r)
        self.controller = Gauge("understudy_controller",
                                "1 while this daemon is the elected controller.", registry=r)
        self.controller_failed_rounds = Gauge(
            "understudy_controller_failed_rounds",
            "Rounds in a row this controller failed (an etcd outage or an error of its own; it "
            "resigns after a few of its own: daemon/controller.py); 0 once a round succeeds.",
            registry=r)
        self.build_info = Gauge("understudy_build_info",
                                "1, labelled with this daemon's understudy and Python versions.",
                                ["version", "python"], registry=r)
        self.build_info.labels(VERSION, platform.python_version()).set(1)
        self.workers = Gauge("understudy_workers", "Running child workers.", registry=r)
        self.standby_warm_since = Gauge(
            "understudy_standby_warm_since_timestamp_seconds",
            "When this node's standby worker for the job reported itself warm (absent: not "
            "warm).", ["job", "mode"], registry=r)
        self.drains = Counter("understudy_drains_total", "Drains started on this node.",
                              ["source"], registry=r)
        self.events = Counter("understudy_events_total", "Events this daemon wrote.", ["kind"],
                              registry=r)
        self.errors = Counter("understudy_errors_total", "Errors by kind.", ["kind"],
                              registry=r)
        self.bad_values = Counter("understudy_bad_values_total",
                                  "Garbage or foreign values found under the cluster prefix.",
                                  ["collection"], registry=r)
        self.fences = Counter("understudy_fences_total",
                              "Times this daemon fenced itself on evidence that its lease is "
                              "gone.", registry=r)
        self.etcd_reachable = Gauge("understudy_etcd_reachable",
                                    "0 while etcd has acknowledged no keep-alive for longer "
                                    "than the lease can be proven alive (an outage), else 1.",
                                    registry=r)
        self.etcd_reachable.set(1)
        self.etcd_outages = Counter("understudy_etcd_outages_total",
                                    "etcd outages this daemon noticed (workers kept training).",
                                    registry=r)
        self.etcd_requests = Counter("understudy_etcd_requests_total",
                                     "Requests this daemon sent to etcd.", ["op"], registry=r)
        self.etcd_retries = Counter("understudy_etcd_retries_total",
                                    "Calls to etcd that failed and are tried again, by what "
                                    "they do.",
                                    ["call"], registry=r)
        # The node's ranks, from their reports (common/worker_report.py): labelled by job and
        # rank (a node holds a few ranks: the label sets stay few), dropped when the rank's
        # process ends.
        worker = ["job", "rank"]
        self.worker_steps = Counter("understudy_worker_steps_total",
                                    "Steps this node's rank committed.", worker, registry=r)
        self.worker_step_seconds = Histogram(
            "understudy_worker_step_seconds", "A committed step's duration on this node's rank, "
            "all its attempts.", worker, buckets=STEP_BUCKETS, registry=r)
        self.worker_part_seconds = Counter(
            "understudy_worker_step_part_seconds_total", "Time the rank's committed steps "
            "spent in each part: the boundary hook (migrations), compute, the vote, apply; "
            "over understudy_worker_step_seconds_sum, each part's share.", [*worker, "part"],
            registry=r)
        self.worker_transfer_bytes = Counter(
            "understudy_worker_transfer_bytes_total", "State-transfer payload bytes the rank "
            "sent or received.", [*worker, "direction"], registry=r)
        self.worker_transfer_seconds = Counter(
            "understudy_worker_transfer_seconds_total", "Time the rank's state transfers took "
            "(bytes over seconds: their rate).", [*worker, "direction"], registry=r)
        self._workers: set[tuple[str, str]] = set()
        self._server: Any = None
        self._thread: Any = None

    def set_state(self, state: NodeState) -> None:
        for s in NodeState:
            self.node_state.labels(state=s.value).set(1 if s == state else 0)

    def worker_report(self, job: str, report: WorkerReport) -> None:
        """Count a rank's report (``Op.METRICS``) in its series."""
        labels = (job, str(report.rank))
        self._workers.add(labels)
        if report.step_seconds:
            self.worker_steps.labels(*labels).inc(len(report.step_seconds))
            hist = self.worker_step_seconds.labels(*labels)
            for seconds in report.step_seconds:
                hist.observe(seconds)
        for part in STEP_PARTS:
            counter = self.worker_part_seconds.labels(*labels, part)
            if report.parts.get(part):
                counter.inc(report.parts[part])
        for t in report.transfers:
            self.worker_transfer_bytes.labels(*labels, t.direction).inc(t.payload_bytes)
            self.worker_transfer_seconds.labels(*labels, t.direction).inc(t.seconds)

    def forget_jobs(self, keep: set[str]) -> None:
        """Drop the series of every job not in ``keep`` (``understudy delete`` removed it). A
        job's series stay while it has records, after it ended too: its final counts remain
        to be read; a rank that moved to another node is counted on both, each its share."""
        for job, rank in sorted(self._workers):
            if job not in keep:
                self._forget_worker(job, rank)

    def _forget_worker(self, job: str, rank: str) -> None:
        labels = (job, rank)
        self._workers.discard(labels)
        for metric in (self.worker_steps, self.worker_step_seconds):
            with contextlib.suppress(KeyError):
                metric.remove(*labels)
        for part in STEP_PARTS:
            with contextlib.suppress(KeyError):
                self.worker_part_seconds.remove(*labels, part)
        for direction in DIRECTIONS:
            for metric in (self.worker_transfer_bytes, self.worker_transfer_seconds):
                with contextlib.suppress(KeyError):
                    metric.remove(*labels, direction)

    def serve(self, listen: str, tls: MetricsConfig | None = None) -> int:
        """Start the endpoint, over HTTPS with ``tls`` (and only for scrapers whose client
        certificate its ``client_ca`` signed, if given); returns the bound port (useful with
        port 0)."""
        host, _, port = listen.rpartition(":")
        tls = tls or MetricsConfig()
        try:
            self._server, self._thread = start_http_server(
                int(port), addr=host or "127.0.0.1", registry=self.registry,
                certfile=tls.cert or None, keyfile=tls.key or None,
                client_cafile=tls.client_ca or None, client_auth_required=bool(tls.client_ca))
        except ssl.SSLError as exc:
            raise ConfigError(f"cannot serve metrics over TLS: {exc} (check metrics.cert, "
                              "metrics.key and metrics.client_ca)") from exc
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {listen}: {exc.strerror or exc} (set "
                              "metrics_listen to a free HOST:PORT, HOST:0 for any free port, "
                              "or empty for no endpoint)") from exc
        bound: int = self._server.server_address[1]
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=2)
            self._server = None


def drain_source_label(source: str) -> str:
    """The drains counter's label for ``source``: itself if understudy writes it (a
    :class:`DrainSource`), else ``other``."""
    return source if source in _DRAIN_SOURCES else "other"


_DRAIN_SOURCES = frozenset(s.value for s in DrainSource)


def exposed_without_tls(listen: str, tls: MetricsConfig) -> bool:
    """Whether the endpoint ``listen`` (HOST:PORT) answers beyond this machine in plain HTTP:
    its host is not a loopback address (a host name counts as reachable)."""
    if tls.tls or not listen:
        return False
    host = listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"


class BadValues:
    """A bad value in etcd (garbage, a foreign write), counted in
    ``understudy_bad_values_total{collection}`` and logged once per key and revision, however
    often it is read again. At most ``limit`` are remembered: past that the memory starts over,
    so a flood of distinct bad writes is counted and logged again at worst, never held without
    bound (the security review's L7)."""

    def __init__(self, metrics: Metrics, log: Any, limit: int = 4096) -> None:
        self.metrics, self.log, self.limit = metrics, log, limit
        self._seen: set[tuple[str, int]] = set()

    def found(self, collection: str, key: str, revision: int, problem: str) -> None:
        if (key, revision) in self._seen:
            return
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen.add((key, revision))
        self.metrics.bad_values.labels(collection=collection).inc()
        self.log.warning("Ignoring a bad value in etcd.", key=key, revision=revision,
                         problem=problem)


#: a migration's kind as the metrics name it (a planned migration is a drain's)
MIGRATION_KIND = {"planned": "drain", "recovery": "recovery", "rollback": "rollback",
                  "reshape": "reshape", "restart": "restart"}
#: the phases whose durations are observed, in order (``MigrationPhase``); a phase lasts from
#: its timestamp to the next one's
PHASES = ("planned", "preparing", "ready", "switching")
#: histogram buckets, seconds: a switch of tens of milliseconds to a recovery of minutes
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Histogram:
    """Bucket counts and a sum, exported through :class:`ControllerMetrics`."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*map(str, BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


class ControllerMetrics:
    """What the elected controller knows of the jobs, exported only by the daemon that is the
    controller (registered on election, unregistered when it steps down), so that a sum over
    the fleet counts each thing once. Counters and histograms start again at the next
    election, as a restarted process's do.

    - ``understudy_migrations_total{kind,outcome}``: migrations ended (kind ``drain``,
      ``recovery``, ``rollback``, ``reshape``, or ``restart`` for a restart-only job; outcome
      ``done`` or ``aborted``);
    - ``understudy_migration_phase_seconds{kind,phase}``: how long each phase of an ended
      migration lasted, from the controller's timestamps (``Migration.timings``);
    - ``understudy_job_downtime_seconds{kind}``: the time the job did not train for a
      migration, as its ranks saw it (the first rank that stays reports it,
      ``Report.DOWNTIME``): a drain's phase 2, from the agreed boundary to the new groups; a
      recovery's, rollback's or reshape's from the failed step's abort to the recovered
      groups (the failure's detection before the abort, and the redone step, not counted);
    - ``understudy_job_state{job,state}``: 1 for the job's state, 0 for the others;
    - ``understudy_job_paused``{job} and ``understudy_job_paused_seconds_total{job}``: whether
      the job waits for a standby, and for how long in all;
    - ``understudy_job_standbys{job,pool}``: its standby pool: ``needed`` (``--standby``),
      ``free`` (standby nodes of its pool online and standing by), ``warm`` (those whose
      standby worker for it reported warm).
    """

    def __init__(self) -> None:
        self.migrations: dict[tuple[str, str], int] = {}
        self.phases: dict[tuple[str, str], _Histogram] = {}
        self.downtime: dict[str, _Histogram] = {}
        self.paused_seconds: dict[str, float] = {}
        self._jobs: dict[str, dict[str, Any]] = {}
        self._seen: float | None = None

    def migration_ended(self, kind: str, outcome: str, timings: dict[str, Any]) -> None:
        """A migration of ``kind`` (the record's) ended ``outcome`` with these timestamps."""
        name = MIGRATION_KIND.get(kind, "other")
        self.migrations[name, outcome] = self.migrations.get((name, outcome), 0) + 1
        stamps = {k: float(v) for k, v in timings.items()
                  if isinstance(v, int | float) and not isinstance(v, bool)}
        order = [p for p in (*PHASES, outcome) if p in stamps]
        for phase, after in itertools.pairwise(order):
            if phase in PHASES:
                self.phases.setdefault((name, phase), _Histogram()).observe(
                    max(0.0, stamps[after] - stamps[phase]))

    def observe_downtime(self, kind: str, seconds: float) -> None:
        """The job stood still ``seconds`` for a migration of ``kind`` (the record's), as its
        first staying rank said (``Report.DOWNTIME``)."""
        self.downtime.setdefault(MIGRATION_KIND.get(kind, "other"), _Histogram()).observe(
            seconds)

    def observe_jobs(self, jobs: dict[str, dict[str, Any]], now: float) -> None:
        """The jobs as this round saw them: name -> ``{"state", "paused", "needed", "free",
        "warm"}``. Time paused since the last round counts for the jobs paused then."""
        if self._seen is not None:
            for name, job in self._jobs.items():
                if job.get("paused"):
                    self.paused_seconds[name] = self.paused_seconds.get(name, 0.0) + max(
                        0.0, now - self._seen)
        self._seen = now
        self._jobs = jobs
        for name in jobs:
            self.paused_seconds.setdefault(name, 0.0)
        for name in list(self.paused_seconds):
            if name not in jobs:
                del self.paused_seconds[name]

    def collect(self) -> Iterator[Metric]:
        m = CounterMetricFamily("understudy_migrations", "Migrations ended, by kind and "
                                "outcome (the controller's count).", labels=["kind", "outcome"])
        for (kind, outcome), n in sorted(self.migrations.items()):
            m.add_metric([kind, outcome], n)
        yield m
        h = HistogramMetricFamily("understudy_migration_phase_seconds",
                                  "How long each phase of an ended migration lasted.",
                                  labels=["kind", "phase"])
        for (kind, phase), hist in sorted(self.phases.items()):
            h.add_metric([kind, phase], hist.buckets(), hist.total)
        yield h
        d = HistogramMetricFamily("understudy_job_downtime_seconds",
                                  "Time a job did not train for a migration, as its first "
                                  "staying rank saw it.", labels=["kind"])
        for kind, hist in sorted(self.downtime.items()):
            d.add_metric([kind], hist.buckets(), hist.total)
        yield d
        s = GaugeMetricFamily("understudy_job_state", "1 for the job's state.",
                              labels=["job", "state"])
        p = GaugeMetricFamily("understudy_job_paused", "1 while the job waits for a standby.",
                              labels=["job"])
        ps = CounterMetricFamily("understudy_job_paused_seconds", "Seconds the job has waited "
                                 "for a standby, since this controller was elected.",
                                 labels=["job"])
        sb = GaugeMetricFamily("understudy_job_standbys", "The job's standby pool: needed "
                               "(--standby), free (standing by), warm (its worker warm).",
                               labels=["job", "pool"])
        for name, job in sorted(self._jobs.items()):
            for state in JobState:
                s.add_metric([name, str(state)], 1.0 if job.get("state") == state else 0.0)
            p.add_metric([name], 1.0 if job.get("paused") else 0.0)
            ps.add_metric([name], self.paused_seconds.get(name, 0.0))
            for pool in ("needed", "free", "warm"):
                sb.add_metric([name, pool], float(job.get(pool, 0)))
        yield from (s, p, ps, sb)
