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
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from harness import PROCESS_ENV, REPO, RecordTail, wait

JOB_SCRIPT = Path(__file__).resolve().parent / "torchrun_job.py"
#: Workers get a store of their own each round (rank 0 hosts it), not the agent's shared one:
#: with the shared store (torch's default since 2.5) a restarted group can read the previous
#: round's keys and connect to ports that are gone (seen here with gloo; pytorch/pytorch#135712,
#: #167288). The documented workaround, which a team restarting on failures has to apply.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}
NPROC = 2  # workers per agent: one agent stands for a node with two slots
NODES = 2
#: How often an agent looks at its workers, in seconds (torchrun's default: 5).
MONITOR_INTERVAL_S = 0.1


def torchrun_setup(max_restarts: int) -> dict[str, Any]:
    """How a run with the drain handler starts torchrun, for a result's configuration."""
    return {"agents": NODES, "workers_per_agent": NPROC, "rdzv_backend": "c10d",
            "max_restarts": max_restarts, "monitor_interval_s": MONITOR_INTERVAL_S,
            "drain_notice": True,
            "env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}


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
    #: the fewest agents a round starts with (``--nnodes MIN:2``): below 2, a job that lost a
    #: node restarts on the one left, at half the data-parallel size
    min_nodes: int = NODES
    #: the rendezvous' ``last_call_timeout``: how long a round that has its minimum waits for
    #: more agents (torchrun's default: 30 s; None leaves it)
    last_call_s: float | None = None
    tp: int = 2
    seed: int = 0
    #: state per rank in bytes (None: the example's own size)
    state_bytes: int | None = None

    def job_args(self, base: Path) -> list[str]:
        args = ["--steps", str(self.steps), "--step-sleep", str(self.step_sleep),
                "--tp", str(self.tp), "--seed", str(self.seed),
                "--step-log", str(base / "steps")]
        if self.ckpt_every or self.drain_notice:
            args += ["--ckpt-dir", str(base / "ckpt"), "--ckpt-every", str(self.ckpt_every),
                     "--ckpt-mode", self.ckpt_mode]
        if self.drain_notice:
            args.append("--drain-notice")
        if self.state_bytes is not None:
            args += ["--state-size", str(self.state_bytes)]
        return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class BaselineRun:
    """What a baseline's run (:class:`ElasticRun`, ``torchft_run.TorchftRun``) does the same
    way: read its workers' step lines (``tail``, from ``start()`` on), wait on them, and hurt
    it. Its agents are ``agents``; what :meth:`hit_node` froze is ``frozen_procs``."""

    #: the job's ranks
    world = NODES * NPROC
    #: what this run raises when it does not do what the benchmark waited for
    error: type[TorchrunError] = TorchrunError
    base: Path
    agents: list[Agent]
    frozen_procs: list[psutil.Process]
    tail: RecordTail | None

    def spawn(self, argv: list[str], log_name: str, env: dict[str, str]) -> Agent:
        """Start an agent, ``argv`` in a session of its own with ``env`` on top of ours, its
        output to ``log_name`` in the run's directory."""
        log_path = self.base / log_name
        with open(log_path, "wb") as log:
            t = time.time()
            proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **PROCESS_ENV, **env})
        agent = Agent(len(self.agents), proc, t, log_path)
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

    def wait_step(self, step: int, timeout: float, ranks: range | None = None) -> None:
        """Wait until each of ``ranks`` (default: all) has committed ``step``."""
        ranks = range(self.world) if ranks is None else ranks

        def done() -> bool:
            c = self.committed()
            return all(c.get(r, -1) >= step for r in ranks)
        wait(f"ranks {list(ranks)} to commit step {step}", done, timeout, interval=0.02,
             error=self.error)

    def worker_pid(self, rank: int) -> int:
        """The live worker process of ``rank``."""
        for r in sorted(self.records(), key=lambda r: -r["t"]):
            if r.get("kind") == "start" and r["rank"] == rank and psutil.pid_exists(r["pid"]):
                return int(r["pid"])
        raise self.error(f"no live worker of rank {rank}")

    # -- events -----------------------------------------------------------------------------

    def kill_worker(self, rank: int) -> float:
        pid = self.worker_pid(rank)
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t

    def stop_agent(self, agent: Agent, what: str, timeout: float) -> tuple[float, float]:
        """SIGTERM to ``agent`` (``what``, for a message); returns the SIGTERM's time and the
        agent's exit time."""
        t = time.time()
        agent.proc.send_signal(signal.SIGTERM)
        try:
            agent.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise self.error(f"{what} did not stop within {timeout}s of SIGTERM") from exc
        return t, time.time()

    def hit_node(self, agent: Agent, freeze: bool) -> float:
        """kill -9 of ``agent`` and its workers at once (``freeze``: SIGSTOP, a node gone
        silent: nothing dies, no connection closes); returns when."""
        victims = [psutil.Process(agent.pid), *agent.workers()]
        t = time.time()
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.suspend() if freeze else p.kill()
        if freeze:
            self.frozen_procs += victims
        else:
            psutil.wait_procs(victims, timeout=10)
        return t

    def kill_frozen(self) -> None:
        """kill -9 of what kill_node froze (an operator powering the silent machine off)."""
        for p in self.frozen_procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(self.frozen_procs, timeout=10)

    # -- the end ----------------------------------------------------------------------------

    def kill_all(self, others: tuple[subprocess.Popen[bytes] | None, ...] = ()) -> None:
        """Kill every agent and worker still running, and ``others``."""
        procs: list[psutil.Process] = []
        for a in self.agents:
            with contextlib.suppress(psutil.Error):
                procs += [psutil.Process(a.pid), *a.workers()]
        for other in others:
            if other is not None:
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(other.pid))
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        for proc in [a.proc for a in self.agents] + [o for o in others if o is not None]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


@dataclass
class ElasticRun(BaselineRun):
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
        wait("agent 0 to host the rendezvous store", lambda: listening(self.port), timeout,
             interval=0.05, error=TorchrunError)
        self.add_agent()

    def argv(self) -> list[str]:
        conf = (f"keep_alive_interval={self.cfg.keepalive_interval_s},"
                f"keep_alive_max_attempt={self.cfg.keepalive_attempts}")
        if self.cfg.last_call_s is not None:
            conf += f",last_call_timeout={self.cfg.last_call_s:g}"
        nnodes = (str(NODES) if self.cfg.min_nodes >= NODES
                  else f"{self.cfg.min_nodes}:{NODES}")
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
                "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id,
                "--rdzv-conf", conf, "--max-restarts", str(self.cfg.max_restarts),
                "--monitor-interval", str(MONITOR_INTERVAL_S), str(JOB_SCRIPT),
                *self.cfg.job_args(self.base)]

    def add_agent(self) -> Agent:
        """Start an agent: one of the two nodes, or the spare that replaces a lost one."""
        return self.spawn(self.argv(), f"agent{len(self.agents)}.log", TORCHRUN_ENV)

    # -- what the workers wrote -----------------------------------------------------------

    def ranks_of(self, agent: Agent) -> list[int]:
        pids = {p.pid for p in agent.workers()}
        live: dict[int, int] = {}
        for r in sorted(self.records(), key=lambda r: r["t"]):
            if r.get("kind") == "start" and r["pid"] in pids:
                live[r["rank"]] = r["pid"]
        return sorted(live)

    # -- events -----------------------------------------------------------------------------

    def drain(self, agent: Agent, timeout: float = 120.0) -> tuple[float, float, Agent]:
        """SIGTERM to ``agent``; once it has exited, a replacement agent. Returns the SIGTERM's
        time, the drained agent's exit time and the replacement."""
        t, left = self.stop_agent(agent, f"agent {agent.index}", timeout)
        return t, left, self.add_agent()

    def kill_node(self, agent: Agent, freeze: bool = False) -> tuple[float, Agent]:
        """kill -9 of ``agent`` and its workers at once (``freeze``: SIGSTOP, a node gone
        silent: nothing dies, no connection closes), then a replacement agent."""
        if freeze:
            self.frozen.add(agent.index)
        return self.hit_node(agent, freeze), self.add_agent()

    def reclaim_node(self) -> float:
        """kill -9 of the newest running agent other than agent 0 (which hosts the rendezvous)
        and its workers, no replacement (capacity reclaimed: :meth:`add_agent` when it comes
        back); returns when. With ``min_nodes`` 1 the survivor restarts its workers alone."""
        live = [a for a in self.agents[1:] if a.proc.poll() is None]
        if not live:
            raise TorchrunError("no running agent but agent 0 to reclaim")
        return self.hit_node(live[-1], freeze=False)

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
        self.kill_all()

    def agent_log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"-- agent {a.index}:\n" + a.log_path.read_text(errors="replace")[-chars:]
                         for a in self.agents if a.log_path.exists())


def listening(port: int) -> bool:
    """Something on this machine accepts connections on ``port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
