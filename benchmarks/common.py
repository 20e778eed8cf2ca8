"""What the side-by-side benchmarks (``downtime.py``, ``overhead.py``) share: running the
repeats with their processes and scratch directory cleaned up whatever happens, and writing
the results file."""

from __future__ import annotations

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
