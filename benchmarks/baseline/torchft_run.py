"""Running ``torchft_job.py`` on this machine: a Lighthouse and one torchrun per replica group,
and hurting it.

- **The Lighthouse**: torchft's own ``torchft_lighthouse`` binary on loopback, ``--min_replicas``
  the DP degree, torchft's defaults otherwise unless the benchmark sets them (heartbeat timeout
  5 s, join timeout 60 s, quorum tick 100 ms). Nothing in the events touches it.
- **A replica group**: ``python -m torch.distributed.run --standalone --nproc-per-node 2
  --max-restarts N --monitor-interval 0.1``, one per DP index, each on a rendezvous of its own:
  one agent stands for one node of two slots, as in ``elastic.py``. A failed worker makes its
  agent restart the whole group, which rejoins the quorum and heals from the other group.

Events (each hits replica group ``victim``; the understudy and torchrun benchmarks hit the node
that holds ranks 2 and 3, and rank 1 for a worker crash):

- ``kill_worker(rank)``: kill -9 of one worker. Its agent sees it exit within its monitor
  interval, stops its other worker and restarts both; the other group's DP all-reduce fails, its
  step is not committed, and it waits in the next quorum until the restarted group joins.
- ``drain(replica)``: SIGTERM to the group's agent, which forwards it to its workers; with
  ``--drain-notice`` both stop at an agreed step boundary. Once the agent has exited a
  replacement agent for the same replica is started (the spare node that takes its place).
  torchft has no planned-migration path: this is a graceful stop and a cold replacement.
- ``kill_node(replica)``: kill -9 of the agent and its workers at once, and a replacement agent
  started at once (a spare node ready: the baseline's best case).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from baseline.elastic import Agent, BaselineRun, TorchrunError, free_port, listening
from harness import RecordTail, wait

JOB_SCRIPT = Path(__file__).resolve().parent / "torchft_job.py"
#: As in elastic.py: a store per incarnation of a group, hosted by its local rank 0, so that a
#: restarted group reads no keys of the previous one (the manager's address among them).
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}
TP = 2  # workers per agent: the TP ranks of one replica group
DP = 2  # replica groups


class TorchftError(TorchrunError):
    """A torchft run did not do what the benchmark waited for."""


@dataclass(frozen=True)
class TorchftConfig:
    steps: int
    step_sleep: float
    drain_notice: bool = False
    max_restarts: int = 10
    #: the Lighthouse's (torchft's defaults: 5000 ms and 60000 ms)
    heartbeat_timeout_ms: int = 5000
    join_timeout_ms: int = 60000
    seed: int = 0
    #: state per rank in bytes (None: the example's own size)
    state_bytes: int | None = None
    #: replica groups a quorum needs (the Lighthouse's and the job's): fewer than DP, the job
    #: trains on in a smaller quorum when a group is lost
    min_replicas: int = DP

    def job_args(self, base: Path, replica: int, lighthouse: str) -> list[str]:
        args = ["--replica", str(replica), "--dp", str(DP), "--lighthouse", lighthouse,
                "--steps", str(self.steps), "--step-sleep", str(self.step_sleep),
                "--seed", str(self.seed), "--step-log", str(base / "steps")]
        if self.drain_notice:
            args.append("--drain-notice")
        if self.state_bytes is not None:
            args += ["--state-size", str(self.state_bytes)]
        if self.min_replicas != DP:
            args += ["--min-replicas", str(self.min_replicas)]
        return args


@dataclass
class TorchftRun(BaselineRun):
    """One torchft job on this machine (see the module docstring)."""

    world = TP * DP
    error = TorchftError

    cfg: TorchftConfig
    base: Path
    agents: list[Agent] = field(default_factory=list)
    #: replica -> the agent running it now
    groups: dict[int, Agent] = field(default_factory=dict)
    lighthouse: subprocess.Popen[bytes] | None = None
    lighthouse_addr: str = ""
    tail: RecordTail | None = None
    #: what kill_node(freeze=True) froze
    frozen_procs: list[psutil.Process] = field(default_factory=list)

    def start(self, timeout: float = 60.0) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.tail = RecordTail(self.base / "steps")
        port = free_port()
        binary = Path(sys.executable).parent / "torchft_lighthouse"
        with open(self.base / "lighthouse.log", "wb") as log:
            self.lighthouse = subprocess.Popen(
                [str(binary), "--bind", f"127.0.0.1:{port}",
                 "--min_replicas", str(self.cfg.min_replicas),
                 "--heartbeat_timeout_ms", str(self.cfg.heartbeat_timeout_ms),
                 "--join_timeout_ms", str(self.cfg.join_timeout_ms)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "RUST_LOG": "info"})
        self.lighthouse_addr = f"http://127.0.0.1:{port}"
        wait("the Lighthouse to listen", lambda: listening(port), timeout, interval=0.05,
             error=TorchrunError)
        for replica in range(DP):
            self.add_group(replica)

    def add_group(self, replica: int) -> Agent:
        """Start an agent for ``replica``: one of the groups, or a spare that replaces one."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(TP), "--max-restarts", str(self.cfg.max_restarts),
                "--monitor-interval", "0.1", str(JOB_SCRIPT),
                *self.cfg.job_args(self.base, replica, self.lighthouse_addr)]
        agent = self.spawn(argv, f"agent{len(self.agents)}-replica{replica}.log", AGENT_ENV)
        self.groups[replica] = agent
        return agent

    # -- what the workers wrote -----------------------------------------------------------

    @staticmethod
    def ranks_of(replica: int) -> list[int]:
        return [replica * TP + i for i in range(TP)]

    # -- events -----------------------------------------------------------------------------

    def drain(self, replica: int, timeout: float = 120.0) -> tuple[float, float, Agent]:
        """SIGTERM to the group's agent; once it has exited, a replacement. Returns the
        SIGTERM's time, the agent's exit time and the replacement."""
        t, left = self.stop_agent(self.groups[replica], f"replica group {replica}'s agent",
                                  timeout)
        return t, left, self.add_group(replica)

    def kill_node(self, replica: int, freeze: bool = False) -> tuple[float, Agent]:
        """kill -9 of the group's agent and workers at once (``freeze``: SIGSTOP, a node gone
        silent: nothing dies, no connection closes; killed at the end), then a replacement."""
        return self.hit_node(self.groups[replica], freeze), self.add_group(replica)

    def kill_group(self, replica: int) -> float:
        """kill -9 of the group's agent and workers at once, no replacement (capacity
        reclaimed: :meth:`add_group` when it returns); returns when."""
        return self.hit_node(self.groups.pop(replica), freeze=False)

    # -- the end ----------------------------------------------------------------------------

    def wait_finished(self, timeout: float) -> dict[int, int | None]:
        """Wait for the current agent of each replica group to exit; returns every agent's
        exit code (None: killed by the benchmark).

        Raises:
            TorchftError: a current agent was still running after ``timeout``.
        """
        deadline = time.monotonic() + timeout
        for a in self.groups.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        running = [a.index for a in self.groups.values() if a.proc.poll() is None]
        if running:
            raise TorchftError(f"torchft agents {running} still running after {timeout:.0f}s "
                               f"(logs in {self.base})")
        return {a.index: a.proc.poll() for a in self.agents}

    def stop(self) -> None:
        """Kill every agent, worker and the Lighthouse still running."""
        self.kill_all((self.lighthouse,))

    def log_tail(self, chars: int = 3000) -> str:
        paths = [a.log_path for a in self.agents] + [self.base / "lighthouse.log"]
        return "\n".join(f"-- {p.name}:\n" + p.read_text(errors="replace")[-chars:]
                         for p in paths if p.exists())
