"""The operator-facing command lines are an interface: changing them must be deliberate."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from understudy.cli.cluster import ClusterStatus, NodeView
from understudy.cli.main import _print_event, _print_status
from understudy.cli.main import build_parser as cli_parser
from understudy.common.records import Event
from understudy.common.version import VERSION
from understudy.daemon.main import build_parser as daemon_parser

CONNECTION = ["--ca", "--cert", "--config", "--etcd", "--key", "--prefix", "--timeout", "--user"]

CLI = {
    "": ["--help", "--version", *CONNECTION],
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
          "--prefix", "--role", "--run-dir", "--slots", "--socket-group", "--version"]


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


def test_strings_from_etcd_reach_the_terminal_with_their_control_characters_escaped(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A rank's first failure, a health message, an event's message: workers and other nodes
    write them, and the CLI prints them. An escape sequence among them is shown, not obeyed
    (the security review's L6); the columns still line up on what is shown."""
    clear = "\x1b[2J\x1b[H"  # clear the screen, cursor home
    node = NodeView(name="node-a", state="active", online=True, role="active",
                    first_failure=f"worker died{clear}", health=("disk\x07 full",))
    _print_status(ClusterStatus(nodes=[node, NodeView(name="node-b", state="active",
                                                      online=True)],
                                controller="node-a", revision=1, ignored=["/u/x\x1b"]))
    _print_event(Event(time=0.0, kind="rank-failed", node="node-a",
                       message=f"rank 1 said {clear}bye\x9b"), as_json=False)
    out = capsys.readouterr().out
    assert not [c for c in out if c != "\n" and (ord(c) < 32 or 127 <= ord(c) < 160)]
    assert "first failure: worker died\\x1b[2J\\x1b[H" in out and "disk\\x07 full" in out
    assert "rank 1 said \\x1b[2J\\x1b[Hbye\\x9b" in out and "/u/x\\x1b" in out
    lines = out.splitlines()
    assert lines[2].index("active") == lines[3].index("active")  # node-a and node-b aligned


def test_both_commands_say_their_version_and_it_is_the_packages(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--version`` on the CLI and the daemon; ``common/version.py`` and ``pyproject.toml``
    say the same version."""
    for parser, program in ((cli_parser(), "understudy"), (daemon_parser(), "understudyd")):
        with pytest.raises(SystemExit) as done:
            parser.parse_args(["--version"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"{program} {VERSION} (Python ")
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == VERSION
