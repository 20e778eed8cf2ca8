"""What the side-by-side benchmarks (``downtime.py``, ``overhead.py``) share: running the
repeats with their processes and scratch directory cleaned up whatever happens, and writing
the results file."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from control_plane import rounded


def run_repeats(name: str, count: int, run: Callable[[int, Path], dict[str, Any]], base: Path,
                keep: bool, errors: tuple[type[BaseException], ...]) -> list[dict[str, Any]] | int:
    """``run(i, base / "repeat<i>")`` for each repeat; the repeats' results, or the exit code
    when one failed (with ``errors``: 1, the scratch directory kept for its logs) or the run was
    interrupted (130). ``base`` is removed afterwards unless ``keep``."""
    repeats: list[dict[str, Any]] = []
    try:
        for i in range(count):
            repeats.append(run(i, base / f"repeat{i}"))
    except errors as exc:
        print(f"{name} benchmark failed: {exc} (logs in {base})", file=sys.stderr)
        keep = True
        return 1
    except KeyboardInterrupt:
        print(f"{name} benchmark interrupted; its processes are stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return repeats


def write_results(result: dict[str, Any], out: Path) -> None:
    """``result`` as JSON at ``out``, written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")  # git-ignored should the run die mid-write
    tmp.write_text(json.dumps(rounded(result), indent=1) + "\n")
    tmp.replace(out)


def check_side_by_side(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options every side-by-side run shares (the baseline's checkpoint cadence and
    rendezvous keep-alive, the job's step sleep, understudy's lease TTL): exit 2 with a
    sentence on a bad one; ``args.keepalive`` becomes ``(interval, attempts)``. Without
    ``--rdzv-keepalive``: torchrun's own 5,3, or 1,2 with ``--smoke`` (a node gone from the
    rendezvous then costs the tests seconds, not 15)."""
    if args.rdzv_keepalive is None:
        args.rdzv_keepalive = "1,2" if args.smoke else "5,3"
    if args.ckpt_every < 1 or args.step_sleep < 0:
        p.error("--ckpt-every must be at least 1 and --step-sleep >= 0")
    if args.ttl < 3:
        p.error(f"--ttl must be at least 3, got {args.ttl}")
    try:
        interval, attempts = (int(x) for x in args.rdzv_keepalive.split(","))
    except ValueError:
        p.error(f"--rdzv-keepalive takes two integers, got {args.rdzv_keepalive!r}")
    if interval < 1 or attempts < 1:
        p.error(f"--rdzv-keepalive values must be at least 1, got {args.rdzv_keepalive!r}")
    args.keepalive = (interval, attempts)
