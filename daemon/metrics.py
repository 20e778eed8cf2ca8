"""Prometheus metrics of one daemon, served on ``metrics_listen`` (plain HTTP)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from understudy.common.errors import ConfigError
from understudy.common.states import NodeState


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lease_age = Gauge("understudy_lease_age_seconds",
                               "Seconds since the last acknowledged lease keep-alive.",
                               registry=r)
        self.node_state = Gauge("understudy_node_state", "1 for the node's current state.",
                                ["state"], registry=r)
        self.cordoned = Gauge("understudy_node_cordoned", "1 if the node is cordoned.",
                              registry=r)
        self.controller = Gauge("understudy_controller",
                                "1 while this daemon is the elected controller.", registry=r)
        self.workers = Gauge("understudy_workers", "Running child workers.", registry=r)
        self.standby_warm_since = Gauge(
            "understudy_standby_warm_since_timestamp_seconds",
            "When this node's standby worker for the job reported itself warm (absent: not "
            "warm).", ["job", "mode"], registry=r)
        self.drains = Counter("understudy_drains_total", "Drains started on this node.",
                              ["source"], registry=r)
        self.events = Counter("understudy_events_total", "Events this daemon wrote.", ["kind"],
                              registry=r)
        self.errors = Counter("understudy_errors_total", "Errors by kind.", ["kind"],
                              registry=r)
        self.bad_values = Counter("understudy_bad_values_total",
                                  "Garbage or foreign values found under the cluster prefix.",
                                  ["collection"], registry=r)
        self.fences = Counter("understudy_fences_total",
                              "Times this daemon fenced itself on evidence that its lease is "
                              "gone.", registry=r)
        self.etcd_reachable = Gauge("understudy_etcd_reachable",
                                    "0 while etcd has acknowledged no keep-alive for longer "
                                    "than the lease can be proven alive (an outage), else 1.",
                                    registry=r)
        self.etcd_reachable.set(1)
        self.etcd_outages = Counter("understudy_etcd_outages_total",
                                    "etcd outages this daemon noticed (workers kept training).",
                                    registry=r)
        self.etcd_requests = Counter("understudy_etcd_requests_total",
                                     "Requests this daemon sent to etcd.", ["op"], registry=r)
        self._server: Any = None
        self._thread: Any = None

    def set_state(self, state: NodeState) -> None:
        for s in NodeState:
            self.node_state.labels(state=s.value).set(1 if s == state else 0)

    def serve(self, listen: str) -> int:
        """Start the HTTP endpoint; returns the bound port (useful with port 0)."""
        host, _, port = listen.rpartition(":")
        try:
            self._server, self._thread = start_http_server(int(port), addr=host or "127.0.0.1",
                                                           registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {listen}: {exc.strerror or exc} (set "
                              "metrics_listen to a free HOST:PORT, HOST:0 for any free port, "
                              "or empty for no endpoint)") from exc
        bound: int = self._server.server_address[1]
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=2)
            self._server = None
