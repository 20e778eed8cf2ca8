"""The dashboard's picture (issue 18, item 4): a local cluster runs a job through a drain and a
crash while every daemon's ``/metrics`` is scraped each second, and the dashboard's main panels
(``docs/grafana/understudy.json``) are drawn from those scrapes with matplotlib, as Grafana
would draw them from Prometheus: ``docs/grafana/dashboard.png``.

    .venv/bin/python benchmarks/dashboard.py [--out docs/grafana/dashboard.png]

The cluster: node-a and node-b (2 slots each), three standby nodes; the plain example, TP 2 x
DP 2, two standbys, 0.05 s of stand-in work a step. Node-b is drained at 12 s; rank 0's worker
is killed at 30 s (a recovery from its data-parallel replica); the job runs to its end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import harness

REPO = Path(__file__).resolve().parents[1]
JOB = "demo"
Scrape = dict[str, list[tuple[dict[str, str], float]]]


def _total(scrapes: dict[str, Scrape], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with these labels over every daemon."""
    return sum(v for s in scrapes.values() for lab, v in s.get(name, [])
               if all(lab.get(k) == x for k, x in labels.items()))


def _by(scrapes: dict[str, Scrape], name: str, label: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in scrapes.values():
        for lab, v in s.get(name, []):
            if all(lab.get(k) == x for k, x in labels.items()):
                out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def run(base: Path) -> tuple[list[tuple[float, dict[str, Scrape]]], list[tuple[float, str]]]:
    """The scenario; returns every second's scrapes of every daemon and the events fired."""
    series: list[tuple[float, dict[str, Scrape]]] = []
    fired: list[tuple[float, str]] = []
    with harness.local_cluster(base) as (_, c):
        c.add("node-a", "active", extra=["--slots", "2"])
        c.add("node-b", "active", extra=["--slots", "2"])
        for n in ("node-s1", "node-s2", "node-s3"):
            c.add(n, "standby")
        for n in c.daemons:
            c.wait_state(n, "standby" if n.startswith("node-s") else "active")
        env = [f"--env={k}={v}" for k, v in harness.PROCESS_ENV.items()]
        run = c.cli("run", "--job", JOB, "--tp", "2", "--dp", "2", "--standby", "2", *env,
                    "--", sys.executable, str(harness.TRAIN), "--steps", "800",
                    "--step-sleep", "0.05", "--adam", "functional")
        if run.returncode != 0:
            raise harness.BenchmarkError(run.stderr)
        t0 = time.monotonic()
        plan = {12.0: "drain node-b", 30.0: "kill rank 0"}
        while True:
            now = time.monotonic() - t0
            for at, what in list(plan.items()):
                if now >= at:
                    del plan[at]
                    fired.append((now, what))
                    if what.startswith("drain"):
                        c.cli("drain", "node-b", "--deadline", "120")
                    else:
                        os.kill(harness.worker_pid(c.daemons["node-a"], f"{JOB}.r0"),
                                signal.SIGKILL)
            scrapes = {}
            for name, d in c.daemons.items():
                if d.alive():
                    try:
                        scrapes[name] = harness.scrape(f"http://127.0.0.1:{d.metrics_port}"
                                                       "/metrics")
                    except OSError:
                        continue
            series.append((now, scrapes))
            job = c.status().job(JOB)
            if (job is not None and job.state in ("done", "failed", "stopped")) or now > 240:
                break
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - now)))
    return series, fired


def _rate(points: list[tuple[float, float]], window: float) -> list[tuple[float, float]]:
    out = []
    for i, (t, v) in enumerate(points):
        j = next((k for k in range(i, -1, -1) if t - points[k][0] >= window), None)
        if j is not None and t > points[j][0]:
            out.append((t, max(0.0, v - points[j][1]) / (t - points[j][0])))
    return out


def _quantile(buckets: dict[str, float], q: float) -> float | None:
    """``histogram_quantile`` of cumulative bucket counts (le -> count)."""
    items = sorted(((float(le), n) for le, n in buckets.items()), key=lambda x: x[0])
    if not items or items[-1][1] <= 0:
        return None
    rank, prev_le, prev_n = q * items[-1][1], 0.0, 0.0
    for le, n in items:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n
                                               else 0)
        prev_le, prev_n = le, n
    return None


def draw(series: list[tuple[float, dict[str, Scrape]]], fired: list[tuple[float, str]],
         out: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    t = [s[0] for s in series]

    def events(ax: Any) -> None:
        for at, what in fired:
            ax.axvline(at, color="grey", ls=":", lw=1)
            ax.text(at, ax.get_ylim()[1], f" {what}", fontsize=7, va="top", color="grey")

    steps = [(ts, _total(s, "understudy_worker_steps_total", job=JOB) / 4) for ts, s in series]
    ax = axes[0][0]
    ax.plot(*zip(*_rate(steps, 10.0), strict=True), label=JOB)
    ax.set_title("Steps per second (10 s window: ranks report every 5 s)", fontsize=9)
    ax.set_ylabel("steps/s")

    ax = axes[0][1]
    for q in (0.5, 0.95):
        pts = []
        for i, (ts, s) in enumerate(series):
            j = max(0, i - 10)
            now = _by(s, "understudy_worker_step_seconds_bucket", "le", job=JOB)
            then = _by(series[j][1], "understudy_worker_step_seconds_bucket", "le", job=JOB)
            v = _quantile({k: now[k] - then.get(k, 0.0) for k in now}, q)
            if v is not None:
                pts.append((ts, v))
        if pts:
            ax.plot(*zip(*pts, strict=True), label=f"p{int(q * 100)}")
    ax.set_title("Step time (10 s window)")
    ax.set_ylabel("seconds")

    ax = axes[0][2]
    total = _rate([(ts, _total(s, "understudy_worker_step_seconds_sum", job=JOB))
                   for ts, s in series], 10.0)
    for part in ("compute", "vote", "boundary", "apply"):
        rate = dict(_rate([(ts, _total(s, "understudy_worker_step_part_seconds_total", job=JOB,
                                       part=part)) for ts, s in series], 10.0))
        pts = [(ts, rate[ts] / v) for ts, v in total if v > 0 and ts in rate]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=part)
    ax.set_title("Share of a step")
    ax.set_ylim(0, 1.05)

    ax = axes[1][0]
    for pool in ("needed", "free", "warm"):
        ax.step(t, [_total(s, "understudy_job_standbys", job=JOB, pool=pool) for _, s in series],
                where="post", label=pool)
    ax.set_title("Standby pool")

    ax = axes[1][1]
    for kind in ("drain", "recovery"):
        ax.step(t, [_total(s, "understudy_migrations_total", kind=kind, outcome="done")
                    for _, s in series], where="post", label=f"{kind} done")
    last = series[-1][1]
    notes = []
    for kind in ("drain", "recovery"):
        n = _total(last, "understudy_job_downtime_seconds_count", kind=kind)
        if n:
            mean = _total(last, "understudy_job_downtime_seconds_sum", kind=kind) / n
            notes.append(f"{kind}: {mean:.3f} s")
    ax.set_title("Migrations; downtime per event: " + ", ".join(notes), fontsize=9)

    ax = axes[1][2]
    for direction in ("send", "receive"):
        ax.step(t, [_total(s, "understudy_worker_transfer_bytes_total", job=JOB,
                           direction=direction) / 1e3 for _, s in series], where="post",
                label=direction)
    ax.set_title("State transferred (kB)")
    for row in axes:
        for ax in row:
            ax.set_xlabel("seconds")
            ax.legend(fontsize=7, loc="lower right")
            events(ax)
    fig.suptitle("understudy: one job through a drain and a crash (local cluster, scraped "
                 "each second)")
    harness.save_chart(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "grafana" / "dashboard.png")
    p.add_argument("--keep", type=Path, help="keep the cluster's logs here")
    args = p.parse_args(argv)
    scratch = harness.Scratch(args.keep, "understudy-dashboard-")
    result = scratch.run("the dashboard's run", (harness.BenchmarkError,),
                         lambda: run(scratch.base))
    if isinstance(result, int):
        return result
    series, fired = result
    draw(series, fired, args.out)
    print(f"{len(series)} scrapes, events {fired}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
