"""The node daemon and the CLI never load torch (the daemon must not touch a GPU context)."""

from __future__ import annotations

import subprocess
import sys


def test_daemon_and_cli_do_not_import_torch() -> None:
    code = ("import sys, understudy.daemon.main, understudy.cli.main, "
            "understudy.common.daemon_client, understudy.common.errorfile\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'megatron', 'numpy'))\n"
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
