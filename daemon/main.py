"""``understudyd``: the per-node daemon.

Start-up: config (exit 2 on a bad one) -> logs -> metrics endpoint -> local socket -> join the
cluster -> READY=1 to systemd. Signals only set flags. SIGTERM/SIGINT: drain this node within
``drain.deadline`` (systemd's TimeoutStopSec is set above it), leave the cluster cleanly, exit 0.
A second signal skips the drain. Every task is named and joined with a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import signal
import sys
import time
from typing import Any

from understudy.common import config as config_mod
from understudy.common import failpoints, logs, version
from understudy.common.config import Config
from understudy.common.errors import ConfigError, StoreError, UnderstudyError
from understudy.common.keys import Keys
from understudy.common.records import DrainSource
from understudy.common.store import EtcdStore, wait_any
from understudy.daemon.address import check_local, worker_address
from understudy.daemon.controller import Controller
from understudy.daemon.events import EventLog
from understudy.daemon.health import HealthMonitor
from understudy.daemon.jobs import JobRunner
from understudy.daemon.localsock import LocalServer
from understudy.daemon.logserver import LogServer
from understudy.daemon.metrics import Metrics, exposed_without_tls
from understudy.daemon.node import NodeAgent
from understudy.daemon.notices import Notice, NoticeWatcher, pollers_from_config
from understudy.daemon.probe import ProbeResponder
from understudy.daemon.ranklogs import RankLogs
from understudy.daemon.sdnotify import Notifier
from understudy.daemon.supervisor import ChildExit, Supervisor

EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="understudyd", description="understudy node daemon")
    p.add_argument("--version", action="version", version=version.describe("understudyd"))
    p.add_argument("--config", help="TOML config file (also UNDERSTUDY_CONFIG)")
    p.add_argument("--node", help="this node's name (also UNDERSTUDY_NODE)")
    p.add_argument("--etcd", help="HOST:PORT[,HOST:PORT...] (also UNDERSTUDY_ETCD)")
    p.add_argument("--prefix", help="cluster key prefix in etcd (default /understudy)")
    p.add_argument("--role", choices=config_mod.ROLES, help="active or standby")
    p.add_argument("--slots", type=int, help="worker slots (GPUs) on this node")
    p.add_argument("--failure-domain", help="rack, switch or zone of this node")
    p.add_argument("--address", action="append", help="an address workers are reachable at")
    p.add_argument("--run-dir", help="directory for the local socket and error records")
    p.add_argument("--metrics-listen", help="HOST:PORT of the Prometheus endpoint, '' disables")
    p.add_argument("--lease-ttl", type=int, help="lease TTL in seconds")
    p.add_argument("--keepalive-interval", type=float, help="seconds between keep-alives")
    p.add_argument("--fence-margin", type=float,
                   help="report an etcd outage this long before the lease could end")
    p.add_argument("--drain-deadline", type=float, help="default drain deadline in seconds")
    p.add_argument("--migration-timeout", type=float,
                   help="abort a live migration not switched this long after it was planned")
    p.add_argument("--socket-group",
                   help="a group whose members may use the workers' socket besides the workers")
    p.add_argument("--enable-failpoints", action="store_true", default=None,
                   help="honour UNDERSTUDY_FAILPOINTS (fault tests; never in production)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", choices=("auto", "json", "console"))
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration, print it and exit")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    return config_mod.load(args.config, overrides={
        "node": args.node, "etcd.endpoints": args.etcd, "etcd.prefix": args.prefix,
        "role": args.role, "slots": args.slots, "failure_domain": args.failure_domain,
        "addresses": args.address, "run_dir": args.run_dir,
        "metrics_listen": args.metrics_listen, "lease.ttl": args.lease_ttl,
        "lease.keepalive_interval": args.keepalive_interval,
        "lease.fence_margin": args.fence_margin, "drain.deadline": args.drain_deadline,
        "drain.migration_timeout": args.migration_timeout,
        "socket_group": args.socket_group, "failpoints_enabled": args.enable_failpoints,
        "log.level": args.log_level, "log.format": args.log_format,
    })


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stop = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.signals = 0
        self.exit_code = 0
        self.metrics = Metrics()
        self.store = EtcdStore(cfg.etcd, on_request=lambda op: self.metrics.etcd_requests
                               .labels(op=op).inc())
        self.events = EventLog(self.store, Keys(cfg.etcd.prefix), cfg.node, self.metrics)
        self.supervisor = Supervisor(cfg.run_dir, on_exit=self._on_child_exit,
                                     failpoints=cfg.failpoints_enabled)
        self.agent = NodeAgent(cfg, self.store, self.metrics, self.events, self.supervisor,
                               self.stop)
        self.controller = Controller(self.agent, self.store, self.metrics, self.events,
                                     self.stop)
        self.ranklogs = RankLogs(cfg, self.store, self.stop)
        self.logserver = LogServer(self.ranklogs, self.store, self.metrics, self.stop)
        self.jobs = JobRunner(self.agent, self.store, self.supervisor, self.stop,
                              ranklogs=self.ranklogs)
        self.agent.listeners.append(self.jobs.poke)
        self.agent.before_stop = self.jobs.ranks_moved
        self.agent.readopt = self.jobs.readopt
        self.local = LocalServer(cfg.socket_path, self.store, Keys(cfg.etcd.prefix), cfg.node,
                                 epoch_check=self.jobs.epoch_check,
                                 job_info=self.jobs.job_info, next_view=self.jobs.next_view,
                                 standby_report=self.jobs.standby_report,
                                 worker_report=self.metrics.worker_report,
                                 worker_job=self.jobs.worker_job,
                                 socket_group=config_mod.group_id(cfg.socket_group)
                                 if cfg.socket_group else None)
        self.probe = ProbeResponder(cfg.node, lambda: self.agent.incarnation)
        self.notifier = Notifier.from_env()
        self.log = logs.get(node=cfg.node)

    # Signal handlers only set flags.
    def _on_signal(self, signum: int) -> None:
        self.signals += 1
        self.shutdown_requested.set()
        if self.signals > 1:
            self.stop.set()

    def _dump_tasks(self) -> None:
        """SIGUSR1: log where every task is waiting (for a daemon that seems stuck)."""
        for task in asyncio.all_tasks():
            buf = io.StringIO()
            with contextlib.suppress(Exception):  # frames without line numbers
                task.print_stack(limit=8, file=buf)
            self.log.warning("Task stack (SIGUSR1).", task=task.get_name(), stack=buf.getvalue())

    async def _on_child_exit(self, child: ChildExit) -> None:
        self.metrics.workers.set(self.supervisor.running_count)
        if self.supervisor.first_failure is child:
            self.agent.first_failure = child.describe()
            with contextlib.suppress(StoreError):
                await self.agent.publish()
        self.log.info(child.describe())
        await self.jobs.on_exit(child)

    async def _on_notice(self, notice: Notice) -> None:
        deadline = self.cfg.drain.deadline
        if notice.deadline is not None:
            deadline = max(1.0, min(deadline, notice.deadline - time.time()))
        await self._request_drain(notice.source, notice.reason, deadline)

    async def _request_drain(self, source: str, reason: str, deadline: float) -> None:
        try:
            await self.agent.request_drain(source, reason, deadline)
        except StoreError as exc:
            self.log.error("Could not record a drain request; will retry.", source=source,
                           error=str(exc))
            raise

    async def _health_loop(self) -> None:
        monitor = await asyncio.to_thread(HealthMonitor.open, self.cfg.health)
        try:
            while not self.stop.is_set():
                findings, decision = await monitor.check(time.time())
                self.agent.health = tuple(f.problem for f in findings)
                if decision is not None:
                    with contextlib.suppress(StoreError):
                        await self._request_drain(DrainSource.HEALTH, decision.reason,
                                                  self.cfg.drain.deadline)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.cfg.health.interval)
        finally:
            await asyncio.to_thread(monitor.close)

    async def _notices_loop(self) -> None:
        pollers = pollers_from_config(self.cfg.notices, self.cfg.node)
        if not pollers:
            return
        watcher = NoticeWatcher(pollers, self.cfg.notices.interval, self._on_notice,
                                self._on_notice_error)
        await watcher.run(self.stop)

    def _on_notice_error(self, source: str, exc: Exception) -> None:
        self.metrics.errors.labels(kind=f"notice-{source}").inc()
        self.log.warning("Reclaim-notice poller failed.", source=source, error=str(exc))

    async def _watchdog_loop(self) -> None:
        interval = self.notifier.watchdog_interval()
        if interval is None:
            return
        while not self.stop.is_set():
            self.notifier.watchdog()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), interval)

    async def _shutdown_on_signal(self) -> None:
        await self.shutdown_requested.wait()
        if self.stop.is_set():
            return
        self.log.info("Stop requested: draining this node before exiting.")
        self.notifier.status("draining before stop")
        self.notifier.extend_timeout(self.cfg.drain.deadline + 10)
        await wait_any((self.agent.registered, self.stop), self.cfg.drain.deadline)
        if not self.agent.registered.is_set():
            self.stop.set()  # never joined: nothing to drain
            return
        with contextlib.suppress(StoreError):
            await self._request_drain(DrainSource.SIGTERM, "the daemon was asked to stop",
                                      self.cfg.drain.deadline)
        stop_wait = asyncio.create_task(self.stop.wait())
        drained = asyncio.create_task(self.agent.drained.wait())
        await asyncio.wait({stop_wait, drained}, timeout=self.cfg.drain.deadline + 2,
                           return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        drained.cancel()
        self.stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGUSR1, self._dump_tasks)
        loop.set_exception_handler(self._loop_error)
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.cfg.rank_log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create rank_logs.dir {str(self.cfg.rank_log_dir)!r}: "
                              f"{exc.strerror}") from exc
        if self.cfg.addresses:
            check_local(self.cfg.addresses[0])
        self.agent.worker_address, why = worker_address(
            self.cfg.addresses, [(ep.host, ep.port) for ep in self.cfg.etcd.endpoints])
        if why:
            self.log.warning(f"Workers' address: {why}.")
        if self.cfg.metrics_listen:
            port = self.metrics.serve(self.cfg.metrics_listen, self.cfg.metrics)
            self.log.info("Metrics endpoint is up.", port=port,
                          tls=self.cfg.metrics.tls, client_ca=bool(self.cfg.metrics.client_ca))
            if exposed_without_tls(self.cfg.metrics_listen, self.cfg.metrics):
                self.log.warning(f"Metrics are served on {self.cfg.metrics_listen} in plain "
                                 "HTTP, beyond this machine: anyone who reaches it reads the "
                                 "node's jobs and state. Set [metrics] cert and key (and "
                                 "client_ca), or listen on a loopback address.")
        await self.local.start()
        if self.cfg.probe.enabled:
            host = self.cfg.addresses[0] if self.cfg.addresses else "127.0.0.1"
            try:
                self.agent.probe_address = await self.probe.start(host, self.cfg.probe.port)
            except OSError as exc:
                raise ConfigError(f"cannot answer probes on {host}:{self.cfg.probe.port}: "
                                  f"{exc.strerror}") from exc
            self.log.info("Probe responder is up.", address=self.agent.probe_address)
        tasks = [
            asyncio.create_task(self._shutdown_on_signal(), name="shutdown-on-signal"),
        ]
        await self.agent.register()
        if not self.stop.is_set():
            self.notifier.ready(f"node {self.cfg.node} joined as {self.agent.state}")
            self.log.info("Daemon is ready.", state=str(self.agent.state))
        tasks += [
            asyncio.create_task(self.agent.keepalive_loop(), name="keepalive"),
            asyncio.create_task(self.agent.lease_watch(), name="lease-watch"),
            asyncio.create_task(self.agent.watch_own_keys(), name="own-keys"),
            asyncio.create_task(self.controller.run(), name="controller"),
            asyncio.create_task(self.jobs.run(), name="jobs"),
            asyncio.create_task(self.ranklogs.run(), name="rank-logs-index"),
            asyncio.create_task(self.logserver.run(), name="log-server"),
            asyncio.create_task(self._health_loop(), name="health"),
            asyncio.create_task(self._notices_loop(), name="notices"),
            asyncio.create_task(self._watchdog_loop(), name="watchdog"),
            asyncio.create_task(self._flush_events(), name="events-flush"),
        ]
        for t in tasks:
            t.add_done_callback(self._watch_task)
        await self.stop.wait()
        self.notifier.stopping()
        await self.supervisor.close(self.cfg.drain.stop_grace)
        await self.ranklogs.close()
        _, pending = await asyncio.wait(tasks, timeout=5)
        for t in pending:
            self.log.warning("Task did not stop in time; cancelling it.", task=t.get_name())
            t.cancel()
        await asyncio.wait(tasks, timeout=2)
        await self.agent.leave()
        await self.local.close()
        self.probe.close()
        await self.store.close()
        self.metrics.close()
        self.log.info("Daemon stopped.", exit_code=self.exit_code)
        return self.exit_code

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """What asyncio could hand to nobody: a task's exception never retrieved, a callback
        that raised, an async generator that failed to close."""
        exc = context.get("exception")
        message = context.get("message", "unhandled error in the event loop")
        if self.stop.is_set():
            # Stopping: grpc's calls and aetcd's watcher finish on channels already closed, and
            # asyncio.run cancels what is left. Their errors then are not news.
            self.log.debug("A background task failed while the daemon stopped.",
                           message=message, error=repr(exc))
            return
        self.metrics.errors.labels(kind="event-loop").inc()
        self.log.error(f"Unhandled error in the event loop: {message}.",
                       exc_info=exc if isinstance(exc, BaseException) else None)

    def _watch_task(self, task: asyncio.Task[None]) -> None:
        """A task that ends on its own before stop is a bug: log it, stop, exit non-zero."""
        if task.cancelled() or self.stop.is_set():
            return
        exc = task.exception()
        if exc is not None:
            self.log.error("Task crashed; stopping the daemon.", task=task.get_name(),
                           exc_info=exc)
            self.exit_code = 1
            self.stop.set()

    async def _flush_events(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 1.0)
            await self.events.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"understudyd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print(cfg)
        return 0
    logs.configure(cfg.log.level, cfg.log.format, node=cfg.node)
    try:
        failpoints.configure(cfg.failpoints_enabled,
                             "this daemon's configuration (failpoints_enabled)")
    except failpoints.FailpointError as exc:
        print(f"understudyd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return asyncio.run(Daemon(cfg).run())
    except ConfigError as exc:  # found only on use: a metrics address already taken
        print(f"understudyd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except UnderstudyError as exc:
        print(f"understudyd: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
