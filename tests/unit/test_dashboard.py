"""The Grafana dashboard and the Prometheus alert rules (``docs/grafana``, issue 18, item 4)
import as they are: every metric they name is one a daemon exports, under that name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from understudy.common.records import JobState
from understudy.common.states import NodeState
from understudy.common.worker_report import Transfer, WorkerReport
from understudy.daemon.metrics import ControllerMetrics, Metrics

DOCS = Path(__file__).parents[2] / "docs" / "grafana"
NAME = re.compile(r"\bunderstudy_[a-z_]+\b")


def _exported() -> set[str]:
    """Every sample name a controller daemon with a running job exports."""
    m = Metrics()
    jobs = ControllerMetrics()
    m.registry.register(jobs)
    jobs.migration_ended("planned", "done", {"planned": 1.0, "switching": 2.0, "done": 2.1})
    jobs.observe_downtime("planned", 0.1)
    jobs.observe_jobs({"j": {"state": JobState.RUNNING, "paused": False, "needed": 1,
                             "free": 1, "warm": 1}}, now=3.0)
    m.worker_report("j", WorkerReport(rank=0, step_seconds=(0.1,), parts={"vote": 0.01},
                                      transfers=(Transfer("send", 10, 0.1),)))
    m.fences.inc()
    m.etcd_outages.inc()
    m.bad_values.labels(collection="jobs").inc()
    m.set_state(NodeState.ACTIVE)
    text = generate_latest(m.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _names(exprs: list[str]) -> set[str]:
    return {n for e in exprs for n in NAME.findall(e)}


def test_the_dashboard_names_only_exported_metrics_and_asks_for_its_data_source() -> None:
    dash = json.loads((DOCS / "understudy.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    missing = _names(exprs) - _exported()
    assert not missing, missing
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "job"}


def test_the_alert_rules_name_only_exported_metrics_and_say_what_happened() -> None:
    rules = yaml.safe_load((DOCS / "alerts.yml").read_text())
    (group,) = rules["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert {"UnderstudyJobPaused", "UnderstudyNodeFenced", "UnderstudyStandbyPoolShort",
            "UnderstudyMigrationAborted"} <= alerts.keys()
    missing = _names([r["expr"] for r in alerts.values()]) - _exported()
    assert not missing, missing
    for name, r in alerts.items():
        assert r["labels"]["severity"] in ("info", "warning", "critical"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
