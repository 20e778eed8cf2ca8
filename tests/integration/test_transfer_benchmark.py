"""The state-transfer benchmark (``benchmarks/transfer.py``) runs end to end in its smoke mode.

Behaviour, not speed: the command exits 0 and writes plausible figures. The target (>= 70 % of
raw point-to-point bandwidth) is reported by the full run (docs/benchmarks.md), never asserted
here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KINDS = ("raw", "into", "state", "chunked")


@pytest.mark.timeout(60)
def test_transfer_smoke(tmp_path: Path) -> None:
    out_file = tmp_path / "transfer.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "transfer.py"), "--smoke",
                          "--out", str(out_file)],
                         cwd=REPO, capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "send_state -> receive_into" in res.stdout

    data = json.loads(out_file.read_text())
    assert {"benchmark", "command", "machine", "config", "summary", "samples"} <= set(data)
    assert "--smoke" in data["command"] and "torch" in data["machine"]
    cfg = data["config"]
    assert cfg["smoke"] is True and cfg["rounds"] >= 1
    assert set(data["summary"]) == {str(mib) for mib in cfg["sizes"]}
    previous = 0
    for mib in cfg["sizes"]:
        fig = data["summary"][str(mib)]
        # The state is about the size asked for, in many tensors (a model and its Adam state).
        assert 0.9 * mib * 2**20 < fig["bytes"] < 1.1 * mib * 2**20
        assert fig["bytes"] > previous and fig["tensors"] > 100
        previous = fig["bytes"]
        for kind in KINDS:
            f = fig[kind]
            assert f["seconds"]["n"] == cfg["rounds"]
            assert 0 < f["seconds"]["min"] <= f["seconds"]["median"] <= f["seconds"]["max"]
            assert f["mb_per_s"] > 0 and f["cpu_seconds_both_ends"]["median"] > 0
            for end in ("leaver", "joiner"):
                # Resident-set peaks: never negative by more than page noise, never the
                # state twice over.
                extra = f[f"{end}_extra_bytes"]
                assert -2**20 < extra["min"] <= extra["max"] < 2 * fig["bytes"] + 2**24
            if kind != "raw":
                assert f["ratio_to_raw"]["median"] > 0
        for end in ("leaver", "joiner"):
            stats = fig["stats"][end]["into"]
            assert stats["payload_bytes"] == fig["bytes"] and stats["chunks"] > 0
            assert 0 < stats["peak_staging_bytes"] <= data["chunk_bytes"]
        assert 0 < fig["small_bytes"] <= fig["bytes"]
        samples = data["samples"]["leaver"][str(mib)]
        assert len(samples["into"]["seconds"]) == cfg["rounds"]
