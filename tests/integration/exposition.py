"""Reading a live daemon's ``/metrics`` with Prometheus's own parser, and the naming rules
every family must follow (issue 18, item 3)."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

#: labels whose values grow without bound (one series each): never a label
UNBOUNDED = {"step", "pid", "id", "migration", "time", "timestamp", "epoch", "incarnation"}
NAME = re.compile(r"^understudy_[a-z][a-z0-9_]*$")
#: base units a name may end in, where it names one
UNITS = ("_seconds", "_bytes", "_ratio")


def scrape(port: int) -> dict[str, list[Sample]]:
    """Every family of the daemon on ``port``: name (as the parser gives it) -> samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        check(family.name, family.type, family.samples)
        families[family.name] = family.samples
    return families


def check(name: str, kind: str, samples: list[Sample]) -> None:
    """Raises AssertionError: ``name`` breaks the Prometheus naming conventions."""
    assert NAME.match(name), f"{name}: not understudy_ and snake case"
    if kind == "counter":
        assert all(s.name in (f"{name}_total", f"{name}_created") for s in samples), \
            f"{name}: a counter's samples end in _total"
    if kind == "histogram":
        assert name.endswith(UNITS), f"{name}: a histogram names its base unit"
    assert not name.endswith(("_ms", "_milliseconds", "_minutes", "_kb", "_mb")), \
        f"{name}: not a base unit"
    for s in samples:
        bad = UNBOUNDED & set(s.labels)
        assert not bad, f"{name}: unbounded label(s) {sorted(bad)}"


def value(families: dict[str, list[Sample]], sample: str, **labels: str) -> float | None:
    """The value of ``sample`` with exactly these labels (among others), or None."""
    for samples in families.values():
        for s in samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
