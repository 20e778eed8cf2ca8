"""The job commands of ``understudy``: ``jobs``, ``stop`` and ``delete`` (a job's whole life
from the CLI; ``run``, ``resize`` and ``status`` are in ``cli/main.py``).

Each reads and writes etcd as the rest of the CLI does, refuses bad input with one sentence and
changes nothing then, and prints a table, or a JSON document with ``-o json``.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import socket
import time
from typing import Any

from understudy.cli.cluster import JobView, read_cluster
from understudy.common.errors import RecordError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.records import (
    PROGRESS_NAMESPACE,
    JobState,
    ProgressReport,
    StopRequest,
    stopped_cleanly,
)
from understudy.common.store import EtcdStore

#: seconds ``stop`` waits past the grace for the controller to say the job stopped
STOP_MARGIN_S = 30.0


class JobCommandError(UnderstudyError):
    """Shown to the operator as one sentence; exit code 1."""


def _age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


async def _steps(store: EtcdStore, keys: Keys, job: str) -> tuple[int, float] | None:
    """The committed step count rank 0 last reported, and when (``worker/progress.py``)."""
    kv = await store.get(keys.kv(PROGRESS_NAMESPACE.format(job=job)) + "0")
    if kv is None:
        return None
    try:
        report = ProgressReport.decode(kv.value)
    except RecordError:
        return None
    return (report.step, report.at) if report.job == job else None


def _row(job: JobView, steps: tuple[int, float] | None, now: float) -> dict[str, Any]:
    a, spec = job.assignment, job.spec
    return {
        "name": spec.name, "state": job.state, "paused": job.paused,
        # how its ranks survive a failure: moved live (the worker API), the same with a
        # data-parallel size that may change (--reshape), or restarted (--restart-only)
        "mode": "restart-only" if spec.restart_only else "reshape" if spec.reshape else "live",
        "reason": job.status.reason if job.status else "",
        "epoch": a.epoch if a else 0,
        "layout": {"tp": spec.tp, "dp": spec.dp, "pp": spec.pp, "dp_now": job.dp_now},
        "nodes": list(dict.fromkeys(a.ranks)) if a else [],
        "standbys": list(a.standbys) if a else [],
        "steps": steps[0] if steps else None, "steps_reported_at": steps[1] if steps else None,
        "created_at": spec.created_at, "created_by": spec.created_by,
        "age_s": round(now - spec.created_at, 3),
        "stop": None if job.stop is None else {
            "requested_at": job.stop.requested_at, "grace": job.stop.grace,
            "requested_by": job.stop.requested_by},
    }


def _layout(row: dict[str, Any]) -> str:
    lay = row["layout"]
    dp = f"{lay['dp_now']}/{lay['dp']}" if lay["dp_now"] != lay["dp"] else str(lay["dp"])
    return f"tp{lay['tp']}xdp{dp}" + (f"xpp{lay['pp']}" if lay["pp"] > 1 else "")


async def list_jobs(store: EtcdStore, keys: Keys, output: str) -> int:
    """``understudy jobs``: every job, one line each (or a JSON list)."""
    status = await read_cluster(store, keys)
    now = time.time()
    rows = [_row(j, await _steps(store, keys, j.spec.name), now) for j in status.jobs]
    if output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no jobs")
        return 0
    table = [("NAME", "STATE", "EPOCH", "LAYOUT", "NODES", "STANDBYS", "STEPS", "AGE", "MODE")]
    for job, r in zip(status.jobs, rows, strict=True):
        table.append((r["name"], job.shown_state, str(r["epoch"] or "-"), _layout(r),
                      ",".join(r["nodes"]) or "-", ",".join(r["standbys"]) or "-",
                      "-" if r["steps"] is None else str(r["steps"]), _age(r["age_s"]),
                      r["mode"]))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())
    return 0


async def stop(store: EtcdStore, keys: Keys, name: str, grace: float, wait: bool,
               output: str) -> int:
    """``understudy stop JOB``: ask the job's ranks to finish their step and end; wait for the
    controller to say the job stopped. Exit 0 when it stopped with every rank finished (or was
    never placed, or finished on its own meanwhile); 1 when a rank did not finish within the
    grace (the status names it), or the job failed."""
    status = await read_cluster(store, keys)
    job = status.require_job(name)
    if job.status is not None and job.status.state.ended:
        raise JobCommandError(f"job {name!r} is {job.state}: there is nothing to stop")
    req = StopRequest(job=name, requested_at=time.time(), grace=grace,
                      requested_by=f"{getpass.getuser()}@{socket.gethostname()}")
    written = await store.txn(compare=[("create", keys.job_stop(name), 0)],
                              success=[("put", keys.job_stop(name), req.encode(), None)])
    if not written:
        current = (await read_cluster(store, keys)).job(name)
        if current is not None and current.stop is not None:
            req = current.stop
    if output != "json":
        print(f"stop of job {name} {'requested' if written else 'already requested'} "
              f"(grace {req.grace:g}s, by {req.requested_by or 'the operator'})", flush=True)
    if not wait:
        if output == "json":
            print(json.dumps({"job": name, "requested": written, "state": job.state}))
        return 0
    deadline = req.requested_at + req.grace + STOP_MARGIN_S
    while True:
        view = (await read_cluster(store, keys)).job(name)
        if view is None:
            raise JobCommandError(f"job {name!r} was deleted while it stopped")
        st = view.status
        if st is not None and st.state.ended:
            clean = stopped_cleanly(st) or st.state == JobState.DONE
            if output == "json":
                print(json.dumps({"job": name, "state": str(st.state), "reason": st.reason,
                                  "clean": clean}))
            else:
                print(f"job {name} {st.state}: {st.reason}", flush=True)
            return 0 if clean else 1
        if time.time() > deadline:
            raise JobCommandError(f"job {name!r} has not stopped {req.grace + STOP_MARGIN_S:g} "
                                  "s after the request (is a controller running?)")
        await asyncio.sleep(0.2)


async def delete(store: EtcdStore, keys: Keys, name: str, output: str) -> int:
    """``understudy delete JOB``: remove an ended job's records (``jobs/<job>/``), its
    workers' keys (``kv/<job>/``) and its log files' index (``logs/files/<job>/``: the files
    stay on their nodes), in one transaction that holds only while its status is the one read.
    A pending or running job is refused: stop it first."""
    status = await read_cluster(store, keys)
    job = status.require_job(name)
    if job.status is None or not job.status.state.ended:
        raise JobCommandError(f"job {name!r} is {job.state}: stop it first "
                              f"(understudy stop {name})")
    kv = await store.get(keys.job_status(name))
    if kv is None or not await store.txn(
            compare=[("mod", keys.job_status(name), kv.mod_revision)],
            success=[("delete-prefix", keys.job(name)), ("delete-prefix", keys.kv(name)),
                     ("delete-prefix", keys.log_files_of(name))]):
        raise JobCommandError(f"job {name!r} changed while it was being deleted; try again")
    if output == "json":
        print(json.dumps({"job": name, "deleted": True, "state": job.state}))
    else:
        print(f"job {name} ({job.state}) deleted")
    return 0
