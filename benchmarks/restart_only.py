"""torchrun's job script, unmodified, under ``understudy run --restart-only``: the downtime
benchmark's ``restart-only`` system (``downtime.py --systems restart-only,torchrun``).

The job is ``baseline/torchrun_job.py`` with the same arguments as under torchrun (checkpoints
every ``--ckpt-every`` steps with DCP, resumed from on start, the careful team's drain handler:
on SIGTERM every rank saves at an agreed step and stops). The cluster is the understudy
system's: ``node-a`` (the controller) and ``node-b`` with two slots each, and two standby nodes
of one slot, which wait empty (a plain script has no standby worker). The events are the other
systems': kill -9 of rank 1's worker (on node-a), kill -9 of node-b's daemon and workers at once,
node-b's daemon and workers frozen (SIGSTOP), and ``understudy drain node-b``. Every one restarts
all four ranks from the newest checkpoint, node-b's two on the standbys where it is lost or
drained (``docs/restart.md``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from baseline.elastic import JOB_SCRIPT, TorchrunConfig
from harness import PROCESS_ENV, BenchmarkError, RecordTail, local_cluster, wait, wait_done
from harness import worker_pid as newest_worker
from interruptions import LOST_NODE, VICTIM, WORLD, bring_up, finish_timeout, steps_timeout

JOB = "plain"


def run(event: str, tcfg: TorchrunConfig, event_step: int, ttl: int,
        base: Path) -> tuple[list[dict[str, Any]], float, list[int], dict[str, Any]]:
    """One run hit by ``event`` once the ranks have committed ``event_step`` steps (rank
    :data:`VICTIM` alone for a worker crash); returns the job's step lines, the event's time,
    the ranks it hit and what the cluster said (restarts, epochs, the nodes at the end).

    Raises:
        BenchmarkError: the job did not restart and finish.
    """
    tail = RecordTail(base / "steps")
    frozen: list[int] = []
    with local_cluster(base, ttl) as (_, cluster):
        try:
            bring_up(cluster)
            env = [f"--env={k}={v}" for k, v in PROCESS_ENV.items()]
            out = cluster.cli("run", "--job", JOB, "--tp", "1", "--dp", str(WORLD), "--standby",
                              "2", "--restart-only", "--max-restarts", "10", *env, "--",
                              sys.executable, str(JOB_SCRIPT), *tcfg.job_args(base))
            if out.returncode != 0:
                raise BenchmarkError(f"understudy run --restart-only failed: {out.stderr}")
            ranks = [VICTIM] if event == "worker-crash" else list(range(WORLD))

            def reached() -> bool:
                tail.poll()
                return all(tail.newest.get(r, (0.0, -1))[1] >= event_step - 1 for r in ranks)

            wait(f"step {event_step - 1} on rank(s) {ranks}", reached,
                 steps_timeout(event_step), interval=0.02)
            lost = [r for r in range(WORLD) if r // 2 == 1]  # node-b's, as placed
            if event == "worker-crash":
                pid = newest_worker(cluster.daemons["node-a"], f"{JOB}.r{VICTIM}")
                event_at = time.time()
                os.kill(pid, signal.SIGKILL)
                lost = [VICTIM]
            elif event == "planned-drain":
                event_at = time.time()
                drained = cluster.cli("drain", LOST_NODE)
                if drained.returncode != 0:
                    raise BenchmarkError(f"understudy drain failed: {drained.stderr}")
            else:
                d = cluster.daemons[LOST_NODE]
                pids = [newest_worker(d, f"{JOB}.r{r}") for r in lost]
                sig = signal.SIGSTOP if event == "silent-node" else signal.SIGKILL
                if sig == signal.SIGSTOP:
                    frozen = [d.pid, *pids]
                event_at = time.time()
                os.kill(d.pid, sig)
                for pid in pids:  # each worker leads a process group of its own
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, sig)
            job = wait_done(cluster, JOB, timeout=finish_timeout(tcfg.steps))
        finally:
            for pid in frozen:  # past saving: stopping the cluster would only ask them to stop
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    tail.poll()
    a = job.assignment
    assert a is not None
    return tail.records, event_at, lost, {"epoch": a.epoch, "restarts_after_failures":
                                          a.restarts, "nodes_at_the_end": list(a.ranks)}
