"""The operator-facing command lines are an interface: changing them must be deliberate."""

from __future__ import annotations

import argparse

import pytest

from understudy.cli.main import build_parser as cli_parser
from understudy.daemon.main import build_parser as daemon_parser

CONNECTION = ["--ca", "--cert", "--config", "--etcd", "--key", "--prefix", "--timeout", "--user"]

CLI = {
    "": ["--help", *CONNECTION],
    "status": ["--json"],
    "drain": ["--deadline", "--reason", "--wait", "node"],
    "undrain": ["node"],
    "cordon": ["node"],
    "uncordon": ["node"],
    "events": ["--follow", "--json", "--limit"],
    "logs": ["--follow", "--rank", "job"],
    "resize": ["--dp", "job"],
    "jobs": ["--output"],
    "stop": ["--grace", "--no-wait", "--output", "job"],
    "delete": ["--output", "job"],
    "run": ["--cwd", "--dp", "--env", "--job", "--max-restarts", "--no-wait", "--pp",
            "--reshape", "--restart-only", "--standby", "--tp", "argv"],
}

DAEMON = ["--address", "--check-config", "--config", "--drain-deadline", "--enable-failpoints",
          "--etcd", "--failure-domain", "--fence-margin", "--keepalive-interval", "--lease-ttl",
          "--log-format", "--log-level", "--metrics-listen", "--migration-timeout", "--node",
          "--prefix", "--role", "--run-dir", "--slots", "--socket-group"]


def _options(p: argparse.ArgumentParser) -> list[str]:
    out = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        out.append(max(a.option_strings, key=len) if a.option_strings else a.dest)
    return sorted(out)


def test_cli_surface_is_frozen() -> None:
    p = cli_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    surface = {"": _options(p)}
    for name, sp in sub.choices.items():
        surface[name] = [o for o in _options(sp) if o not in CONNECTION and o != "--help"]
    assert surface == {k: sorted(v) for k, v in CLI.items()}


def test_daemon_flags_are_frozen() -> None:
    assert [o for o in _options(daemon_parser()) if o != "--help"] == sorted(DAEMON)


@pytest.mark.parametrize("argv", [["drain"], ["status", "extra"], ["nope"], []])
def test_cli_misuse_is_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_parser().parse_args(argv)
    assert exc.value.code == 2
