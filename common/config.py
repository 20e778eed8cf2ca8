"""Daemon and CLI configuration: TOML file < ``UNDERSTUDY_*`` environment < flags.

The result is immutable and validated once at start-up, relations between timeouts included.
Every problem is a :class:`ConfigError` whose message names the offending setting and value.
"""

from __future__ import annotations

import dataclasses
import grp
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from understudy.common import env
from understudy.common.errors import ConfigError

NODE_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
#: a DNS host name (labels of letters, digits and '-', joined by dots)
HOST_NAME_RE = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                          r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
PREFIX_RE = re.compile(r"^/[A-Za-z0-9._/-]*[A-Za-z0-9._-]$")
ROLES = ("active", "standby")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class EtcdConfig:
    endpoints: tuple[Endpoint, ...]
    prefix: str = "/understudy"
    #: Every etcd call is bounded by this many seconds.
    timeout: float = 1.0
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.ca is not None


@dataclass(frozen=True)
class LeaseConfig:
    #: etcd lease TTL in whole seconds: a dead node is declared failed this long after its last
    #: keep-alive.
    ttl: int = 3
    keepalive_interval: float = 0.5
    #: The daemon reports an etcd outage this many seconds before the lease can have expired at
    #: etcd, counted from the send time of the last acknowledged keep-alive. (It kills its
    #: workers only on evidence that the lease is gone: daemon/node.py.)
    fence_margin: float = 0.75


@dataclass(frozen=True)
class DrainConfig:
    #: Default deadline for a drain, also used for SIGTERM (match systemd's TimeoutStopSec).
    deadline: float = 60.0
    #: Grace between SIGTERM and SIGKILL when stopping a worker.
    stop_grace: float = 5.0
    #: A live migration that has not reached its switch this many seconds after it was planned
    #: is aborted (the leavers keep training) and planned again with other standbys while the
    #: drain's deadline allows. Read by the controller.
    migration_timeout: float = 120.0


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 10.0
    nvml: bool = True
    #: Consecutive unhealthy checks before a drain is requested.
    failures_before_drain: int = 3
    min_disk_free_gib: float = 1.0
    disk_paths: tuple[str, ...] = ("/",)
    min_memory_available_mib: float = 512.0
    #: None: use each GPU's own slowdown threshold reported by NVML.
    max_gpu_temperature_c: float | None = None


@dataclass(frozen=True)
class NoticesConfig:
    interval: float = 5.0
    aws: bool = False
    aws_url: str = "http://169.254.169.254"
    gce: bool = False
    gce_url: str = "http://metadata.google.internal"
    azure: bool = False
    azure_url: str = "http://169.254.169.254"
    #: Per-request timeout for the metadata services.
    timeout: float = 2.0


@dataclass(frozen=True)
class ProbeConfig:
    """Direct probes between daemons (``daemon/probe.py``): the controller finds a dead or
    silent node in under a second and revokes its lease, instead of waiting for the TTL."""

    #: answer probes and, as the controller, probe the other nodes
    enabled: bool = True
    #: UDP port of this daemon's probe responder (0: any free port); it binds the node's first
    #: address (127.0.0.1 without one) and is advertised in the node record
    port: int = 0
    #: seconds between two probes of the same node
    interval: float = 0.1
    #: the same while no job is pending or running (nothing loses time to a loss found later;
    #: the silence is stretched alike): an idle controller wakes ten times less for its probes
    idle_interval: float = 1.0
    #: a node that answered no probe for this long is a suspect
    silence: float = 0.6
    #: a suspect that still answers nothing this long after more probes is dead
    confirm: float = 0.3
    #: pings a second the controller sends at most (its CPU grows with them: 12-25 us of
    #: CPU a node a round on the development machine). With more than ``max_rate * interval``
    #: nodes, each is probed less often and its silence judged over as many times longer
    max_rate: float = 2000.0


@dataclass(frozen=True)
class MetricsConfig:
    """TLS of the Prometheus endpoint (``metrics_listen``); all empty: plain HTTP."""

    #: the endpoint's certificate and key (PEM), given together: HTTPS
    cert: str = ""
    key: str = ""
    #: a CA (PEM): only scrapers with a client certificate it signed are answered
    client_ca: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.cert)


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    #: auto: JSON when stderr is not a terminal, readable lines when it is.
    format: str = "auto"


@dataclass(frozen=True)
class RankLogsConfig:
    """Where each rank's own output goes (``daemon/ranklogs.py``): one file per process,
    ``<dir>/<job>/rank<R>.<epoch>-<pid>.log``, capped and rotated."""

    #: the directory; empty: ``<run_dir>/logs`` (systemd's example config puts it under the
    #: state directory, which outlives a reboot)
    dir: str = ""
    #: a file is rotated (``.1``, ``.2``...) once it holds this many bytes
    max_bytes: int = 64 * 1024 * 1024
    #: files kept per process, the one written included (``files - 1`` rotated ones)
    files: int = 3


@dataclass(frozen=True)
class Config:
    node: str
    etcd: EtcdConfig
    role: str = "active"
    slots: int = 1
    failure_domain: str = ""
    addresses: tuple[str, ...] = ()
    run_dir: Path = Path("/run/understudy")
    #: host:port for the Prometheus endpoint; empty disables it.
    metrics_listen: str = "127.0.0.1:9464"
    #: A group (name or number) whose members may use the workers' socket besides the daemon's
    #: own workers (its descendants); empty: none. The socket file gets this group.
    socket_group: str = ""
    #: Honour ``UNDERSTUDY_FAILPOINTS`` (fault injection, common/failpoints.py) in the daemon and
    #: its workers. Off in production: a stray variable then only logs a warning.
    failpoints_enabled: bool = False
    lease: LeaseConfig = LeaseConfig()
    drain: DrainConfig = DrainConfig()
    health: HealthConfig = HealthConfig()
    notices: NoticesConfig = NoticesConfig()
    probe: ProbeConfig = ProbeConfig()
    log: LogConfig = LogConfig()
    rank_logs: RankLogsConfig = RankLogsConfig()
    metrics: MetricsConfig = MetricsConfig()

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "understudyd.sock"

    @property
    def rank_log_dir(self) -> Path:
        """The directory of the ranks' own logs (``rank_logs.dir``, else ``<run_dir>/logs``)."""
        return Path(self.rank_logs.dir) if self.rank_logs.dir else self.run_dir / "logs"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """Parse ``HOST:PORT[,HOST:PORT...]``; raises ConfigError naming the bad entry."""
    out = []
    for raw in text.split(","):
        item = raw.strip()
        if item.startswith(("http://", "https://")):
            item = item.split("://", 1)[1]
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"etcd endpoint {raw.strip()!r} is not HOST:PORT")
        out.append(Endpoint(host.strip("[]"), int(port)))
    if not out:
        raise ConfigError("no etcd endpoint given")
    return tuple(out)


_SECTIONS: dict[str, type] = {
    "lease": LeaseConfig,
    "drain": DrainConfig,
    "health": HealthConfig,
    "notices": NoticesConfig,
    "probe": ProbeConfig,
    "log": LogConfig,
    "rank_logs": RankLogsConfig,
    "metrics": MetricsConfig,
}
_TOP_LEVEL = {"node", "etcd", "role", "slots", "failure_domain", "addresses", "run_dir",
              "metrics_listen", "socket_group", "failpoints_enabled"}
_ETCD_KEYS = {"endpoints", "prefix", "timeout", "ca", "cert", "key", "user", "password",
              "password_file", "insecure"}

# Environment variable -> dotted setting. Flags are given to load() as dotted settings too.
_ENV_SETTINGS = {
    env.NODE: "node",
    env.ETCD: "etcd.endpoints",
    env.PREFIX: "etcd.prefix",
    env.ROLE: "role",
    env.SLOTS: "slots",
    env.FAILURE_DOMAIN: "failure_domain",
    env.RUN_DIR: "run_dir",
    env.RANK_LOG_DIR: "rank_logs.dir",
    env.LEASE_TTL: "lease.ttl",
    env.METRICS_LISTEN: "metrics_listen",
    env.LOG_LEVEL: "log.level",
    env.LOG_FORMAT: "log.format",
    env.ETCD_CA: "etcd.ca",
    env.ETCD_CERT: "etcd.cert",
    env.ETCD_KEY: "etcd.key",
    env.ETCD_USER: "etcd.user",
    env.ETCD_PASSWORD: "etcd.password",
}


def load(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    require_node: bool = True,
) -> Config:
    """Build the configuration from a TOML file, the environment and flag overrides.

    ``overrides`` maps dotted settings (``"lease.ttl"``) to values; ``None`` values are ignored.
    Raises ConfigError for an unreadable file, an unknown setting, a bad value or inconsistent
    timeouts.
    """
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    path = path or environ.get(env.CONFIG) or None
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc
    _check_keys(raw)
    for var, dotted in _ENV_SETTINGS.items():
        if environ.get(var):
            _set(raw, dotted, environ[var])
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set(raw, dotted, value)
    return _build(raw, require_node, environ.get("CREDENTIALS_DIRECTORY"))


def _check_address(address: str) -> None:
    """An ``addresses`` entry: an IP address or a host name that other nodes can reach this
    node at; a wildcard (0.0.0.0, ::) or multicast address names no host."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        if not HOST_NAME_RE.fullmatch(address):
            raise ConfigError(f"addresses: {address!r} is neither an IP address nor a host "
                              "name") from None
        return
    if ip.is_unspecified or ip.is_multicast:
        raise ConfigError(f"addresses: {address} names no host other nodes can reach: give "
                          "this node's own address on the network its peers use")


def _check_keys(raw: dict[str, Any]) -> None:
    for key, value in raw.items():
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"config section [{key}] must be a table")
            known = {f.name for f in dataclasses.fields(_SECTIONS[key])}
            for sub in value:
                if sub not in known:
                    raise ConfigError(f"unknown setting {key}.{sub} in the config file")
        elif key == "etcd":
            if isinstance(value, dict):
                for sub in value:
                    if sub not in _ETCD_KEYS:
                        raise ConfigError(f"unknown setting etcd.{sub} in the config file")
        elif key not in _TOP_LEVEL:
            raise ConfigError(f"unknown setting {key!r} in the config file")


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    head, _, tail = dotted.partition(".")
    if not tail:
        raw[head] = value
        return
    section = raw.setdefault(head, {})
    if head == "etcd" and not isinstance(section, dict):
        section = raw[head] = {"endpoints": section}
    section[tail] = value


def _build(raw: dict[str, Any], require_node: bool, credentials: str | None = None) -> Config:
    node = raw.get("node", "")
    if not isinstance(node, str):
        raise ConfigError(f"node must be a string, got {node!r}")
    if require_node and not node:
        raise ConfigError("no node name: pass --node NAME or set UNDERSTUDY_NODE")
    if node and not NODE_NAME_RE.match(node):
        raise ConfigError(
            f"node name {node!r} must be 1-63 lowercase letters, digits, '.' or '-'"
        )
    etcd_cfg = _build_etcd(raw.get("etcd"), credentials)
    role = raw.get("role", "active")
    if role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    slots = _int("slots", raw.get("slots", 1), minimum=1)
    addresses = raw.get("addresses", ())
    if isinstance(addresses, str):
        addresses = tuple(a for a in addresses.split(",") if a)
    if not isinstance(addresses, list | tuple) or not all(isinstance(a, str) for a in addresses):
        raise ConfigError(f"addresses must be a list of strings, got {addresses!r}")
    for address in addresses:
        _check_address(address)
    metrics_listen = str(raw.get("metrics_listen", "127.0.0.1:9464"))
    if metrics_listen:
        _, sep, port = metrics_listen.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"metrics_listen {metrics_listen!r} is not HOST:PORT or empty")
    socket_group = str(raw.get("socket_group", ""))
    if socket_group:
        group_id(socket_group)  # a group this machine does not know stops the daemon here
    failpoints_enabled = _bool("failpoints_enabled", raw.get("failpoints_enabled", False))
    sections = {name: _section(name, cls, raw.get(name, {})) for name, cls in _SECTIONS.items()}
    cfg = Config(
        node=node,
        etcd=etcd_cfg,
        role=role,
        slots=slots,
        failure_domain=str(raw.get("failure_domain", "")),
        addresses=tuple(addresses),
        run_dir=Path(str(raw.get("run_dir", "/run/understudy"))),
        metrics_listen=metrics_listen,
        socket_group=socket_group,
        failpoints_enabled=failpoints_enabled,
        **sections,
    )
    validate(cfg)
    return cfg


def _read_password_file(name: str, credentials: str | None) -> str:
    """The etcd password from ``name``: a path, or under systemd's ``LoadCredential=`` a
    relative name in ``$CREDENTIALS_DIRECTORY`` (``credentials``). A file that others than its
    owner may read is refused: the secret would not be one."""
    path = Path(name)
    if not path.is_absolute() and credentials:
        path = Path(credentials) / path
    try:
        mode = path.stat().st_mode
        if mode & 0o077:
            raise ConfigError(f"etcd.password_file {str(path)!r} may be read by others than its "
                              f"owner (mode {mode & 0o777:04o}): chmod 600 it, or hand it over "
                              "with systemd's LoadCredential=")
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read etcd.password_file {str(path)!r}: {exc.strerror}") from exc


def _build_etcd(value: Any, credentials: str | None = None) -> EtcdConfig:
    if value is None:
        raise ConfigError("no etcd endpoint: pass --etcd HOST:PORT or set UNDERSTUDY_ETCD")
    if isinstance(value, str | list):
        value = {"endpoints": value}
    endpoints = value.get("endpoints")
    if isinstance(endpoints, list):
        endpoints = ",".join(str(e) for e in endpoints)
    if not endpoints:
        raise ConfigError("no etcd endpoint: pass --etcd HOST:PORT or set UNDERSTUDY_ETCD")
    password = value.get("password")
    if value.get("password_file") and not password:
        password = _read_password_file(str(value["password_file"]), credentials)
    prefix = str(value.get("prefix", "/understudy"))
    if not PREFIX_RE.match(prefix):
        raise ConfigError(f"etcd prefix {prefix!r} must start with '/' and not end with '/'")
    paths = {k: Path(value[k]) if value.get(k) else None for k in ("ca", "cert", "key")}
    if (paths["cert"] is None) != (paths["key"] is None):
        raise ConfigError("etcd client certificate and key must be given together")
    if paths["cert"] is not None and paths["ca"] is None:
        raise ConfigError("an etcd client certificate needs the CA (etcd.ca) as well")
    for name, p in paths.items():
        if p is not None and not p.is_file():
            raise ConfigError(f"etcd.{name} file {str(p)!r} does not exist")
    user = value.get("user") or None
    if (user is None) != (password is None):
        raise ConfigError("etcd user and password must be given together")
    insecure = value.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ConfigError(f"etcd.insecure must be true or false, got {insecure!r}")
    asked_tls = [e.strip() for e in str(endpoints).split(",")
                 if e.strip().startswith("https://")]
    if asked_tls and paths["ca"] is None:
        raise ConfigError(f"etcd endpoint {asked_tls[0]!r} asks for TLS, but etcd.ca is not "
                          "set: give the CA that signed etcd's certificate (without it the "
                          "connection would be plaintext)")
    if password is not None and paths["ca"] is None and not insecure:
        raise ConfigError("etcd.user and its password would cross the network in clear: set "
                          "etcd.ca (TLS), or etcd.insecure = true to accept that")
    return EtcdConfig(
        endpoints=parse_endpoints(str(endpoints)),
        prefix=prefix,
        timeout=_float("etcd.timeout", value.get("timeout", 1.0)),
        user=user,
        password=password,
        **paths,
    )


def _section(name: str, cls: type, values: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        default = f.default
        label = f"{name}.{f.name}"
        if isinstance(default, bool):
            v = _bool(label, v)
        elif isinstance(default, int):
            v = _int(label, v)
        elif isinstance(default, float) or f.name.startswith("max_"):
            v = _float(label, v)
        elif isinstance(default, tuple):
            if isinstance(v, str):
                v = tuple(x for x in v.split(",") if x)
            if not isinstance(v, list | tuple):
                raise ConfigError(f"{label} must be a list, got {v!r}")
            v = tuple(str(x) for x in v)
        else:
            v = str(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def _bool(label: str, v: Any) -> bool:
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        v = v.lower() in ("true", "1")
    if not isinstance(v, bool):
        raise ConfigError(f"{label} must be true or false, got {v!r}")
    return v


def group_id(group: str) -> int:
    """The id of ``group``, a group name or a number (which need not be in the group database).

    Raises:
        ConfigError: no group of that name on this machine.
    """
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"socket_group {group!r} is not a group on this machine") from None


def _int(label: str, v: Any, minimum: int | None = None) -> int:
    try:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError
        out = int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{label} must be a whole number, got {v!r}") from None
    if minimum is not None and out < minimum:
        raise ConfigError(f"{label} must be at least {minimum}, got {out}")
    return out


def _float(label: str, v: Any) -> float:
    try:
        if isinstance(v, bool):
            raise ValueError
        out = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{label} must be a number, got {v!r}") from None
    if not math.isfinite(out):  # NaN passes every "<= 0" check and is never reached
        raise ConfigError(f"{label} must be a finite number, got {v!r}")
    return out


def validate(cfg: Config) -> None:
    """Check relations between settings. Raises ConfigError naming the violated relation."""
    lease = cfg.lease
    if lease.ttl < 1:
        raise ConfigError(f"lease.ttl must be at least 1 second, got {lease.ttl}")
    if not 0 < lease.keepalive_interval <= lease.ttl / 3:
        raise ConfigError(
            f"lease.keepalive_interval ({lease.keepalive_interval}) must be > 0 and at most "
            f"lease.ttl/3 ({lease.ttl / 3:.3g})"
        )
    if not 0 < cfg.etcd.timeout <= lease.ttl / 3:
        raise ConfigError(
            f"etcd.timeout ({cfg.etcd.timeout}) must be > 0 and at most lease.ttl/3 "
            f"({lease.ttl / 3:.3g}) so a hung call cannot outlive the lease"
        )
    if not 0 < lease.fence_margin < lease.ttl - lease.keepalive_interval:
        raise ConfigError(
            f"lease.fence_margin ({lease.fence_margin}) must be > 0 and below lease.ttl - "
            f"lease.keepalive_interval ({lease.ttl - lease.keepalive_interval:.3g})"
        )
    if cfg.drain.deadline <= 0 or cfg.drain.stop_grace <= 0:
        raise ConfigError("drain.deadline and drain.stop_grace must be positive")
    if cfg.drain.migration_timeout <= 0:
        raise ConfigError("drain.migration_timeout must be positive")
    if cfg.drain.stop_grace >= cfg.drain.deadline:
        raise ConfigError(
            f"drain.stop_grace ({cfg.drain.stop_grace}) must be below drain.deadline "
            f"({cfg.drain.deadline})"
        )
    m = cfg.metrics
    if bool(m.cert) != bool(m.key):
        raise ConfigError("metrics.cert and metrics.key must be given together")
    if m.client_ca and not m.cert:
        raise ConfigError("metrics.client_ca checks scrapers over TLS: give metrics.cert and "
                          "metrics.key as well")
    for name in ("cert", "key", "client_ca"):
        path = getattr(m, name)
        if path and not Path(path).is_file():
            raise ConfigError(f"metrics.{name} file {path!r} does not exist")
    if cfg.health.interval <= 0 or cfg.health.failures_before_drain < 1:
        raise ConfigError("health.interval must be positive and failures_before_drain >= 1")
    if cfg.health.min_disk_free_gib < 0:
        raise ConfigError(f"health.min_disk_free_gib ({cfg.health.min_disk_free_gib:g}) must "
                          "be at least 0")
    if cfg.notices.interval <= 0 or not 0 < cfg.notices.timeout < cfg.notices.interval + 30:
        raise ConfigError("notices.interval and notices.timeout must be positive")
    probe = cfg.probe
    if not 0 <= probe.port < 65536:
        raise ConfigError(f"probe.port must be 0 to 65535, got {probe.port}")
    if not 0 < probe.interval < probe.silence:
        raise ConfigError(f"probe.interval ({probe.interval}) must be > 0 and below "
                          f"probe.silence ({probe.silence})")
    if probe.confirm <= 0:
        raise ConfigError(f"probe.confirm must be positive, got {probe.confirm}")
    if not probe.max_rate > 0:
        raise ConfigError(f"probe.max_rate must be positive, got {probe.max_rate}")
    if not probe.idle_interval >= probe.interval:
        raise ConfigError(f"probe.idle_interval ({probe.idle_interval}) must be at least "
                          f"probe.interval ({probe.interval})")
    if cfg.rank_logs.max_bytes < 4096 or cfg.rank_logs.files < 1:
        raise ConfigError(f"rank_logs.max_bytes ({cfg.rank_logs.max_bytes}) must be at least "
                          f"4096 and rank_logs.files ({cfg.rank_logs.files}) at least 1")
    if cfg.log.level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log.level must be debug, info, warning or error, got {cfg.log.level!r}")
    if cfg.log.format not in ("auto", "json", "console"):
        raise ConfigError(f"log.format must be auto, json or console, got {cfg.log.format!r}")
