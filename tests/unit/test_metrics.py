"""The controller's job metrics (issue 18, item 1), read back through Prometheus's parser."""

from __future__ import annotations

import ssl
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.certs import CertAuthority, have_openssl
from understudy.common.config import MetricsConfig
from understudy.common.records import JobState
from understudy.common.version import VERSION
from understudy.daemon.metrics import (
    BadValues,
    ControllerMetrics,
    Metrics,
    drain_source_label,
    exposed_without_tls,
)


def _samples(m: ControllerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(m)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_ended_migrations_count_their_phases_and_downtime_by_kind() -> None:
    m = ControllerMetrics()
    m.migration_ended("planned", "done", {"planned": 10.0, "preparing": 10.5, "ready": 12.0,
                                          "switching": 13.0, "done": 13.04})
    m.migration_ended("recovery", "done", {"planned": 20.0, "preparing": 20.2, "ready": 21.0,
                                           "done": 22.5})
    m.migration_ended("planned", "aborted", {"planned": 30.0, "preparing": 30.1,
                                             "aborted": 90.0, "bogus": "x"})
    got = _samples(m)
    assert got["understudy_migrations_total", (("kind", "drain"), ("outcome", "done"))] == 1
    assert got["understudy_migrations_total", (("kind", "drain"), ("outcome", "aborted"))] == 1
    assert got["understudy_migrations_total", (("kind", "recovery"), ("outcome", "done"))] == 1
    sums = {labels: v for (name, labels), v in got.items()
            if name == "understudy_migration_phase_seconds_sum"}
    # drain: planned 0.5 (done) + 0.1 (aborted); switching 0.04; recovery: ready 1.5
    assert abs(sums[(("kind", "drain"), ("phase", "planned"))] - 0.6) < 1e-9
    assert abs(sums[(("kind", "drain"), ("phase", "preparing"))] - (1.5 + 59.9)) < 1e-9
    assert abs(sums[(("kind", "drain"), ("phase", "switching"))] - 0.04) < 1e-9
    assert abs(sums[(("kind", "recovery"), ("phase", "ready"))] - 1.5) < 1e-9
    # Downtime: what the ranks reported, by kind.
    m.observe_downtime("planned", 0.04)
    m.observe_downtime("recovery", 2.5)
    m.observe_downtime("", 1.0)  # a migration the controller no longer holds
    got = _samples(m)
    assert abs(got["understudy_job_downtime_seconds_sum", (("kind", "drain"),)] - 0.04) < 1e-9
    assert abs(got["understudy_job_downtime_seconds_sum", (("kind", "recovery"),)] - 2.5) < 1e-9
    assert got["understudy_job_downtime_seconds_count", (("kind", "other"),)] == 1
    assert got["understudy_job_downtime_seconds_bucket", (("kind", "drain"), ("le", "0.05"))] == 1
    assert got["understudy_job_downtime_seconds_bucket", (("kind", "drain"), ("le", "0.025"))] == 0


def test_job_state_pause_time_and_standby_pool_follow_the_rounds() -> None:
    m = ControllerMetrics()
    paused = {"state": JobState.RUNNING, "paused": True, "needed": 2, "free": 0, "warm": 0}
    m.observe_jobs({"j": paused}, now=100.0)
    m.observe_jobs({"j": paused}, now=103.5)
    m.observe_jobs({"j": {**paused, "paused": False, "free": 2, "warm": 1}}, now=104.0)
    m.observe_jobs({"j": {**paused, "paused": False, "free": 2, "warm": 1}}, now=110.0)
    got = _samples(m)
    assert got["understudy_job_paused_seconds_total", (("job", "j"),)] == 4.0
    assert got["understudy_job_paused", (("job", "j"),)] == 0
    assert got["understudy_job_state", (("job", "j"), ("state", "running"))] == 1
    assert got["understudy_job_state", (("job", "j"), ("state", "stopped"))] == 0
    assert got["understudy_job_standbys", (("job", "j"), ("pool", "warm"))] == 1
    # A job that is gone leaves no series behind.
    m.observe_jobs({}, now=111.0)
    assert not [k for k in _samples(m) if dict(k[1]).get("job") == "j"]


def test_a_worker_report_is_checked_field_by_field_and_counted_under_its_rank() -> None:
    import pytest

    from understudy.common.worker_report import ReportError, Transfer, WorkerReport
    from understudy.daemon.metrics import Metrics

    good = WorkerReport(rank=3, step_seconds=(0.2, 0.3), parts={"vote": 0.01, "compute": 0.4},
                        transfers=(Transfer("send", 1000, 0.5),))
    assert WorkerReport.parse(good.as_request()) == good
    for bad in ({"rank": -1}, {"rank": True}, {"rank": 1, "step_seconds": [float("nan")]},
                {"rank": 1, "step_seconds": "1"}, {"rank": 1, "parts": {"pid": 1.0}},
                {"rank": 1, "step_seconds": [0.1] * 5001},
                {"rank": 1, "transfers": [{"direction": "up", "bytes": 1, "seconds": 1}]},
                {"rank": 1, "transfers": [{"direction": "send", "bytes": -1, "seconds": 1}]}):
        with pytest.raises(ReportError):
            WorkerReport.parse(bad)
    m = Metrics()
    m.worker_report("j", good)
    m.worker_report("j", good)
    text = generate_latest(m.registry).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["understudy_worker_steps_total", (("job", "j"), ("rank", "3"))] == 4
    assert got["understudy_worker_transfer_bytes_total", (
        ("direction", "send"), ("job", "j"), ("rank", "3"))] == 2000
    m.forget_jobs({"j"})
    assert "understudy_worker_steps_total" in generate_latest(m.registry).decode()
    m.forget_jobs(set())  # deleted: its series go
    assert 'job="j"' not in generate_latest(m.registry).decode()


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def warning(self, message: str, **fields: object) -> None:
        self.lines.append((message, fields))


def test_a_bad_value_is_counted_and_logged_once_per_revision_and_remembered_within_a_bound(
        ) -> None:
    m, log = Metrics(), _Log()
    bad = BadValues(m, log, limit=3)

    def counted(collection: str) -> float:
        return m.bad_values.labels(collection=collection)._value.get()

    for _ in range(5):  # the same value read again at every relist
        bad.found("jobs", "/u/jobs/j/spec", 7, "not JSON")
    assert counted("jobs") == 1 and log.lines == [
        ("Ignoring a bad value in etcd.", {"key": "/u/jobs/j/spec", "revision": 7,
                                           "problem": "not JSON"})]
    bad.found("jobs", "/u/jobs/j/spec", 8, "not JSON")  # written again: a new bad value
    bad.found("nodes", "/u/nodes/x", 9, "foreign")
    assert (counted("jobs"), counted("nodes"), len(log.lines)) == (2, 1, 3)
    # A flood of distinct bad writes: what is remembered stays within the bound.
    for rev in range(100, 200):
        bad.found("kv", "/u/kv/k", rev, "garbage")
    assert len(bad._seen) <= 3 and counted("kv") == 100


def test_a_drain_source_from_etcd_is_a_bounded_label() -> None:
    """Review L5: the drains counter's label was a drain request's source as written in etcd,
    so foreign writes could grow a series per value."""
    m = Metrics()
    for source in ("operator", "aws-spot", "x" * 200, "evil-1", "evil-2"):
        m.drains.labels(source=drain_source_label(source)).inc()
    text = generate_latest(m.registry).decode()
    counts = {s.labels["source"]: s.value for f in text_string_to_metric_families(text)
              if f.name == "understudy_drains" for s in f.samples if s.name.endswith("_total")}
    assert counts == {"operator": 1.0, "aws-spot": 1.0, "other": 3.0}


def test_the_metrics_endpoint_serves_https_and_checks_client_certificates(
        tmp_path: Path) -> None:
    """Review L5: metrics over TLS ([metrics] cert, key, client_ca), and a warning for a plain
    endpoint that answers beyond the machine."""
    if not have_openssl():
        pytest.fail("openssl is not installed: the test command installs it (scripts/setup)")
    authority = CertAuthority.create(tmp_path / "pki")
    server, client = authority.server("metrics"), authority.client("prometheus")
    tls = MetricsConfig(cert=str(server.cert), key=str(server.key),
                        client_ca=str(authority.cert))
    m = Metrics()
    port = m.serve("127.0.0.1:0", tls)
    try:
        url = f"https://127.0.0.1:{port}/metrics"
        trusted = ssl.create_default_context(cafile=str(authority.cert))
        with pytest.raises(OSError):  # plain HTTP gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        with pytest.raises(OSError):
            urllib.request.urlopen(url, context=trusted, timeout=5)  # no client certificate
        trusted.load_cert_chain(str(client.cert), str(client.key))
        with urllib.request.urlopen(url, context=trusted, timeout=5) as reply:
            assert b"understudy_workers" in reply.read()
    finally:
        m.close()
    assert exposed_without_tls("0.0.0.0:9464", MetricsConfig())
    assert exposed_without_tls("node-a.example:9464", MetricsConfig())
    assert not exposed_without_tls("127.0.0.1:9464", MetricsConfig())
    assert not exposed_without_tls("[::1]:9464", MetricsConfig())
    assert not exposed_without_tls("0.0.0.0:9464", tls)


def test_the_build_info_says_the_version() -> None:
    m = Metrics()
    text = generate_latest(m.registry).decode()
    (sample,) = [s for f in text_string_to_metric_families(text)
                 if f.name == "understudy_build_info" for s in f.samples]
    assert sample.value == 1.0 and sample.labels["version"] == VERSION
