"""The daemon's log is JSON lines, one event per line, whoever writes it: our code, or the
libraries under it (asyncio, grpc, aetcd), a crashed thread, an exception nobody could catch."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import structlog


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_library_records_with_tracebacks_are_one_json_line_each() -> None:
    # In a child: configure() replaces process-wide hooks, which pytest relies on here.
    code = textwrap.dedent("""
        import asyncio, gc, logging, sys, threading
        from understudy.common import logs
        logs.configure("info", "json", stream=sys.stdout, node="node-x")
        try:
            1 / 0
        except ZeroDivisionError:
            logging.getLogger("aetcd.watcher").exception("watch callback failed")
        logging.getLogger("grpc").info("library chatter, below warning")
        t = threading.Thread(target=lambda: {}["missing"], name="reader")
        t.start()
        t.join()

        async def fails():
            raise ValueError("nobody awaited me")

        async def main():
            asyncio.get_running_loop().create_task(fails())
            await asyncio.sleep(0.01)
            gc.collect()

        asyncio.run(main())
        gc.collect()

        class Leaky:
            def __del__(self):
                raise OSError("closing a handle in a destructor")

        Leaky()
        logs.get(node="node-x").info("ours")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    lines = _lines(out.stdout)
    assert [(d.get("logger", "ours"), d["level"]) for d in lines] == [
        ("aetcd.watcher", "error"), ("understudy", "error"), ("asyncio", "error"),
        ("understudy", "warning"), ("ours", "info")]
    assert all(d["node"] == "node-x" for d in lines)
    assert "ZeroDivisionError" in lines[0]["exception"]
    assert lines[1]["event"] == "Thread reader crashed." and "KeyError" in lines[1]["exception"]
    assert "never retrieved" in lines[2]["event"] and "nobody awaited me" in lines[2]["exception"]
    assert "Leaky.__del__" in lines[3]["event"] and "OSError: closing" in lines[3]["exception"]


def test_the_level_filters_library_records_too() -> None:
    from understudy.common import logs

    root = logging.getLogger()
    saved = (root.handlers[:], root.level, sys.unraisablehook)
    saved_thread_hook = threading.excepthook
    buf = io.StringIO()
    try:
        logs.configure("error", "json", stream=buf)
        logging.getLogger("grpc").warning("a library warning")
        logging.getLogger("grpc").error("a library error")
    finally:
        root.handlers, root.level, sys.unraisablehook = saved
        threading.excepthook = saved_thread_hook
        structlog.reset_defaults()
    assert [d["event"] for d in _lines(buf.getvalue())] == ["a library error"]


def test_the_daemon_reports_what_asyncio_could_hand_to_nobody(tmp_path: Path) -> None:
    """A task's exception nobody retrieved is an error, counted, while the daemon runs; once it
    is stopping, library tasks failing on closed channels are only debug lines."""
    import asyncio
    import gc

    from structlog.testing import capture_logs

    from understudy.common import config
    from understudy.daemon.main import Daemon

    cfg = config.load(overrides={"node": "n1", "etcd.endpoints": "127.0.0.1:1",
                                 "run_dir": str(tmp_path)}, environ={})

    async def fails() -> None:
        raise ValueError("nobody awaited me")

    async def orphan_a_failure() -> None:
        asyncio.get_running_loop().create_task(fails())
        await asyncio.sleep(0.01)
        gc.collect()

    async def main() -> tuple[list[dict], list[dict], float]:
        d = Daemon(cfg)
        asyncio.get_running_loop().set_exception_handler(d._loop_error)
        with capture_logs() as running:
            await orphan_a_failure()
        d.stop.set()
        with capture_logs() as stopping:
            await orphan_a_failure()
        count = d.metrics.errors.labels(kind="event-loop")._value.get()
        d.metrics.close()
        return running, stopping, count

    running, stopping, count = asyncio.run(main())
    assert [(e["log_level"], e["event"][:49]) for e in running] == [
        ("error", "Unhandled error in the event loop: Task exception")]
    assert isinstance(running[0]["exc_info"], ValueError)
    assert [e["log_level"] for e in stopping] == ["debug"]
    assert "nobody awaited me" in stopping[0]["error"]
    assert count == 1
