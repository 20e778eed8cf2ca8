"""Running ``torchrun_job.py`` under torchrun elastic agents on this machine, and hurting it.

Two agents (``python -m torch.distributed.run``, two workers each) on a c10d rendezvous on
loopback: one agent stands for one node. Agent 0 is started first and hosts the rendezvous store
(the first agent whose address matches the endpoint binds it; the others become clients), so the
events below always hit agent 1, as the understudy benchmarks hit ``node-b`` and never the
controller's node. Each agent leads a session of its own; its workers lead theirs (torchrun
starts them with ``start_new_session``), so a node loss kills both explicitly.

Events:

- ``kill_worker(rank)``: kill -9 of one worker. Its agent sees it exit within its monitor
  interval, stops its other worker and re-rendezvouses; the other agent's workers fail on the
  broken connections and it does the same; all four restart from the newest checkpoint.
- ``drain(agent)``: SIGTERM to the agent, which forwards it to its workers (and waits up to 30 s
  for them); with ``--drain-notice`` every rank saves at an agreed step and stops. Once the
  drained agent has exited, a replacement agent is started (the spare node that takes its slot)
  and rendezvouses with the survivor, which restarted its workers.
- ``kill_node(agent)``: kill -9 of the agent and its workers at once, and a replacement agent
  started at once (a spare node ready, the best case for the baseline). The survivor's workers
  fail on the broken connections; it re-rendezvouses once the rendezvous declares the lost agent
  dead (its keep-alives stopped: ``keep_alive_interval`` x ``keep_alive_max_attempt``, 5 s x 3
  by default).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

JOB_SCRIPT = Path(__file__).resolve().parent / "torchrun_job.py"
REPO = JOB_SCRIPT.parents[2]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: Workers get a store of their own each round (rank 0 hosts it), not the agent's shared one:
#: with the shared store (torch's default since 2.5) a restarted group can read the previous
#: round's keys and connect to ports that are gone (seen here with gloo; pytorch/pytorch#135712,
#: #167288). The documented workaround, which a team restarting on failures has to apply.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}
NPROC = 2  # workers per agent: one agent stands for a node with two slots
NODES = 2


class TorchrunError(RuntimeError):
    """A torchrun run did not do what the benchmark waited for."""


@dataclass(frozen=True)
class TorchrunConfig:
    steps: int
    step_sleep: float
    #: save every N steps (0: never)
    ckpt_every: int = 0
    ckpt_mode: str = "sync"
    #: on SIGTERM, save at an agreed step and stop (a careful team's drain)
    drain_notice: bool = False
    max_restarts: int = 10
    #: the rendezvous' ``keep_alive_interval`` and ``keep_alive_max_attempt`` (torchrun's
    #: defaults: 5 s, 3)
    keepalive_interval_s: int = 5
    keepalive_attempts: int = 3
    tp: int = 2
    seed: int = 0

    def job_args(self, base: Path) -> list[str]:
        args = ["--steps", str(self.steps), "--step-sleep", str(self.step_sleep),
                "--tp", str(self.tp), "--seed", str(self.seed),
                "--step-log", str(base / "steps")]
        if self.ckpt_every or self.drain_notice:
            args += ["--ckpt-dir", str(base / "ckpt"), "--ckpt-every", str(self.ckpt_every),
                     "--ckpt-mode", self.ckpt_mode]
        if self.drain_notice:
            args.append("--drain-notice")
        return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every JSON line of the ``*.jsonl`` files under ``directory``."""
    tail = RecordTail(directory)
    tail.poll()
    return tail.records


class RecordTail:
    """The JSON lines of the ``*.jsonl`` files under ``directory``, read incrementally (polling
    must not load the machine it measures). A line still being written is left for the next
    poll; one cut short by a kill is skipped."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.records: list[dict[str, Any]] = []
        #: per rank, (time, step) of the newest committed step
        self.newest: dict[int, tuple[float, int]] = {}
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        """Read what was appended since the last poll; returns the new records."""
        new: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for line in data[:end].splitlines():
                with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                    new.append(json.loads(line))
        for r in new:
            if r.get("kind", "step") == "step" and r["t"] >= self.newest.get(r["rank"], (0, 0))[0]:
                self.newest[r["rank"]] = (r["t"], r["step"])
        self.records += new
        return new


@dataclass
class Agent:
    index: int
    proc: subprocess.Popen[bytes]
    started_at: float
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def workers(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []


@dataclass
class ElasticRun:
    """One torchrun job on this machine (see the module docstring)."""

    cfg: TorchrunConfig
    base: Path
    agents: list[Agent] = field(default_factory=list)
    #: indices of agents frozen by kill_node(freeze=True): never waited for, killed by stop()
    frozen: set[int] = field(default_factory=set)
    frozen_procs: list[psutil.Process] = field(default_factory=list)
    port: int = 0
    run_id: str = ""
    tail: RecordTail | None = None

    def start(self, timeout: float = 120.0) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.tail = RecordTail(self.base / "steps")
        self.port = free_port()
        self.run_id = f"bench-{os.getpid()}-{self.port}"
        self.add_agent()
        # Agent 0 binds the rendezvous store before agent 1 looks for it.
        wait("agent 0 to host the rendezvous store", lambda: _listening(self.port), timeout,
             interval=0.05)
        self.add_agent()

    def argv(self) -> list[str]:
        conf = (f"keep_alive_interval={self.cfg.keepalive_interval_s},"
                f"keep_alive_max_attempt={self.cfg.keepalive_attempts}")
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id,
                "--rdzv-conf", conf, "--max-restarts", str(self.cfg.max_restarts),
                "--monitor-interval", "0.1", str(JOB_SCRIPT), *self.cfg.job_args(self.base)]

    def add_agent(self) -> Agent:
        """Start an agent: one of the two nodes, or the spare that replaces a lost one."""
        index = len(self.agents)
        log_path = self.base / f"agent{index}.log"
        with open(log_path, "wb") as log:
            t = time.time()
            proc = subprocess.Popen(self.argv(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **ONE_THREAD, **TORCHRUN_ENV})
        agent = Agent(index, proc, t, log_path)
        self.agents.append(agent)
        return agent

    # -- what the workers wrote -----------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        assert self.tail is not None, "start() first"
        self.tail.poll()
        return self.tail.records

    def committed(self) -> dict[int, int]:
        """Per rank, the newest step committed (by its newest process)."""
        assert self.tail is not None, "start() first"
        self.tail.poll()
        return {rank: s for rank, (_, s) in self.tail.newest.items()}

    def wait_step(self, step: int, timeout: float, ranks: range = range(NODES * NPROC)) -> None:
        """Wait until each of ``ranks`` has committed ``step``."""
        def done() -> bool:
            c = self.committed()
            return all(c.get(r, -1) >= step for r in ranks)
        wait(f"ranks {list(ranks)} to commit step {step}", done, timeout, interval=0.02)

    def worker_pid(self, rank: int) -> int:
        """The live worker process of ``rank``."""
        for r in sorted(self.records(), key=lambda r: -r["t"]):
            if r["kind"] == "start" and r["rank"] == rank and psutil.pid_exists(r["pid"]):
                return int(r["pid"])
        raise TorchrunError(f"no live worker of rank {rank}")

    def ranks_of(self, agent: Agent) -> list[int]:
        pids = {p.pid for p in agent.workers()}
        live: dict[int, int] = {}
        for r in sorted(self.records(), key=lambda r: r["t"]):
            if r.get("kind") == "start" and r["pid"] in pids:
                live[r["rank"]] = r["pid"]
        return sorted(live)

    # -- events -----------------------------------------------------------------------------

    def kill_worker(self, rank: int) -> float:
        pid = self.worker_pid(rank)
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t

    def drain(self, agent: Agent, timeout: float = 120.0) -> tuple[float, float, Agent]:
        """SIGTERM to ``agent``; once it has exited, a replacement agent. Returns the SIGTERM's
        time, the drained agent's exit time and the replacement."""
        t = time.time()
        agent.proc.send_signal(signal.SIGTERM)
        try:
            agent.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TorchrunError(f"agent {agent.index} did not stop within {timeout}s of "
                                "SIGTERM") from exc
        left = time.time()
        return t, left, self.add_agent()

    def kill_node(self, agent: Agent, freeze: bool = False) -> tuple[float, Agent]:
        """kill -9 of ``agent`` and its workers at once (``freeze``: SIGSTOP, a node gone
        silent: nothing dies, no connection closes), then a replacement agent."""
        victims = [psutil.Process(agent.pid), *agent.workers()]
        t = time.time()
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.suspend() if freeze else p.kill()
        if freeze:
            self.frozen.add(agent.index)
            self.frozen_procs += victims
        else:
            psutil.wait_procs(victims, timeout=10)
        return t, self.add_agent()

    def kill_frozen(self) -> None:
        """kill -9 of what kill_node froze (an operator powering the silent machine off)."""
        for p in self.frozen_procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(self.frozen_procs, timeout=10)

    # -- the end ----------------------------------------------------------------------------

    def wait_finished(self, timeout: float, fail_fast: bool = False) -> dict[int, int | None]:
        """Wait for every live agent to exit; returns each agent's exit code (None: killed by
        the benchmark, or still running past ``timeout``). With ``fail_fast`` (a run with no
        fault injected), the first agent that fails ends the wait: the others would only sit
        in torchrun's exit barrier (300 s) for it.

        Raises:
            TorchrunError: agents still running past ``timeout``.
        """
        deadline = time.monotonic() + timeout
        live = [a for a in self.agents if a.index not in self.frozen]
        codes = {a.index: a.proc.poll() for a in live}
        while time.monotonic() < deadline and any(c is None for c in codes.values()):
            if fail_fast and any(c not in (None, 0) for c in codes.values()):
                return codes
            time.sleep(0.1)
            codes = {a.index: a.proc.poll() for a in live}
        if any(c is None for c in codes.values()):
            raise TorchrunError(f"torchrun agents still running after {timeout:.0f}s: {codes} "
                                f"(logs in {self.base})")
        return codes

    def stop(self) -> None:
        """Kill every agent and worker still running."""
        procs: list[psutil.Process] = []
        for a in self.agents:
            with contextlib.suppress(psutil.Error):
                procs += [psutil.Process(a.pid), *a.workers()]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        for a in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.proc.wait(timeout=5)

    def agent_log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"-- agent {a.index}:\n" + a.log_path.read_text(errors="replace")[-chars:]
                         for a in self.agents if a.log_path.exists())


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.1) -> float:
    """Poll ``check`` until it holds; returns the seconds it took.

    Raises:
        TorchrunError: it did not within ``timeout`` seconds.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return time.monotonic() - t0
        time.sleep(interval)
    raise TorchrunError(f"timed out after {timeout:.0f}s waiting for {what}")
