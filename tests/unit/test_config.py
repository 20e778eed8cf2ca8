"""Configuration: file < environment < flags, validated relations, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from understudy.common import config
from understudy.common.errors import ConfigError

BASE = {"node": "n1", "etcd.endpoints": "127.0.0.1:2379"}


def test_flags_alone_are_enough() -> None:
    cfg = config.load(overrides=BASE, environ={})
    assert cfg.node == "n1" and str(cfg.etcd.endpoints[0]) == "127.0.0.1:2379"
    assert cfg.lease.keepalive_interval <= cfg.lease.ttl / 3


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('node = "from-file"\netcd = ["h1:1", "h2:2"]\nrole = "standby"\n'
                 '[lease]\nttl = 6\n')
    cfg = config.load(f, environ={"UNDERSTUDY_NODE": "from-env"})
    assert cfg.node == "from-env" and cfg.role == "standby" and cfg.lease.ttl == 6
    assert [str(e) for e in cfg.etcd.endpoints] == ["h1:1", "h2:2"]
    cfg = config.load(f, overrides={"node": "from-flag"}, environ={"UNDERSTUDY_NODE": "x"})
    assert cfg.node == "from-flag"


@pytest.mark.parametrize("override, message", [
    ({"lease.keepalive_interval": 2.0}, "keepalive_interval"),
    ({"lease.ttl": 0}, "ttl"),
    ({"lease.fence_margin": 3.0}, "fence_margin"),
    ({"etcd.timeout": 2.5}, "etcd.timeout"),
    ({"drain.stop_grace": 100.0}, "stop_grace"),
    ({"role": "boss"}, "role"),
    ({"slots": 0}, "slots"),
    ({"slots": "many"}, "whole number"),
    ({"node": "UPPER"}, "node name"),
    ({"etcd.endpoints": "nohost"}, "HOST:PORT"),
    ({"etcd.prefix": "noslash"}, "prefix"),
    ({"etcd.cert": "/nonexistent.pem", "etcd.key": "/k", "etcd.ca": "/c"}, "does not exist"),
    ({"etcd.cert": "/x"}, "together"),
    ({"etcd.user": "root"}, "together"),
    ({"metrics_listen": "nope"}, "metrics_listen"),
    ({"drain.deadline": "nan"}, "drain.deadline must be a finite number"),
    ({"health.interval": "inf"}, "health.interval must be a finite number"),
    ({"health.max_gpu_temperature_c": "nan"}, "must be a finite number"),
    ({"health.min_disk_free_gib": -1}, "min_disk_free_gib"),
    ({"addresses": "0.0.0.0"}, "names no host other nodes can reach"),
    ({"addresses": "10.0.0.7,::"}, "names no host other nodes can reach"),
    ({"addresses": "239.1.2.3"}, "names no host other nodes can reach"),
    ({"addresses": "node a"}, "neither an IP address nor a host name"),
    ({"log.level": "loud"}, "log.level"),
    ({"probe.interval": 0.7}, "probe.interval"),
    ({"probe.max_rate": 0}, "probe.max_rate must be positive"),
    ({"probe.idle_interval": 0.05}, "probe.idle_interval"),
    ({"probe.max_rate": "nan"}, "probe.max_rate must be a finite number"),
])
def test_bad_settings_name_the_problem(override: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.load(overrides={**BASE, **override}, environ={})


def test_unknown_setting_and_bad_toml(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('node = "n1"\netcd = "h:1"\n[lease]\nttll = 3\n')
    with pytest.raises(ConfigError, match=r"lease\.ttll"):
        config.load(f, environ={})
    f.write_text("= broken")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(f, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "missing.toml", environ={})


def test_missing_node_or_etcd() -> None:
    with pytest.raises(ConfigError, match="no node name"):
        config.load(overrides={"etcd.endpoints": "h:1"}, environ={})
    with pytest.raises(ConfigError, match="no etcd endpoint"):
        config.load(overrides={"node": "n1"}, environ={})


def test_trust_settings_are_off_by_default_and_checked(tmp_path: Path) -> None:
    cfg = config.load(overrides=BASE, environ={"UNDERSTUDY_FAILPOINTS": "x=raise"})
    assert cfg.failpoints_enabled is False and cfg.socket_group == ""
    f = tmp_path / "c.toml"
    f.write_text('failpoints_enabled = true\nsocket_group = "0"\n')
    cfg = config.load(f, overrides=BASE, environ={})
    assert cfg.failpoints_enabled is True and config.group_id(cfg.socket_group) == 0
    assert config.group_id("root") == 0
    with pytest.raises(ConfigError, match="socket_group 'no-such-group' is not a group"):
        config.load(overrides={**BASE, "socket_group": "no-such-group"}, environ={})
    with pytest.raises(ConfigError, match="failpoints_enabled must be true or false"):
        config.load(overrides={**BASE, "failpoints_enabled": "sometimes"}, environ={})


def test_etcd_credentials_are_refused_where_they_would_not_stay_secret(tmp_path: Path) -> None:
    """Review M6: an https:// endpoint without a CA was dialled in plaintext, a password was
    sent without TLS, and a password file anyone could read was taken."""
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    for override, message in (
            ({"etcd.endpoints": "https://127.0.0.1:2379"}, "asks for TLS, but etcd.ca is not set"),
            ({"etcd.user": "u", "etcd.password": "p"}, "would cross the network in clear"),
            ({"etcd.user": "u", "etcd.password": "p", "etcd.insecure": "yes"},
             "etcd.insecure must be true or false"),
            ({"etcd.user": "u", "etcd.password_file": str(secret), "etcd.insecure": True},
             r"may be read by others than its owner \(mode 0644\)")):
        with pytest.raises(ConfigError, match=message):
            config.load(overrides={**BASE, **override}, environ={})
    secret.chmod(0o600)
    cfg = config.load(overrides={**BASE, "etcd.user": "u", "etcd.password_file": str(secret),
                                 "etcd.insecure": True}, environ={})
    assert (cfg.etcd.user, cfg.etcd.password) == ("u", "s3cret")
    # systemd's LoadCredential=: a relative name is read from $CREDENTIALS_DIRECTORY.
    cfg = config.load(overrides={**BASE, "etcd.user": "u", "etcd.password_file": secret.name,
                                 "etcd.insecure": True},
                      environ={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert cfg.etcd.password == "s3cret"


def test_metrics_tls_settings_are_checked(tmp_path: Path) -> None:
    """Review L5: the metrics endpoint could only be plain HTTP. [metrics] cert and key come
    together, a client CA needs them, and every file must exist."""
    cert, key, ca = (tmp_path / n for n in ("m.crt", "m.key", "ca.crt"))
    for p in (cert, key, ca):
        p.write_text("x")
    for override, message in (
            ({"metrics.cert": str(cert)}, "metrics.cert and metrics.key must be given together"),
            ({"metrics.client_ca": str(ca)}, "give metrics.cert and metrics.key as well"),
            ({"metrics.cert": str(cert), "metrics.key": str(tmp_path / "gone")},
             "metrics.key file .* does not exist")):
        with pytest.raises(ConfigError, match=message):
            config.load(overrides={**BASE, **override}, environ={})
    cfg = config.load(overrides={**BASE, "metrics.cert": str(cert), "metrics.key": str(key),
                                 "metrics.client_ca": str(ca)}, environ={})
    assert cfg.metrics.tls and cfg.metrics.client_ca == str(ca)
    assert not config.load(overrides=BASE, environ={}).metrics.tls
