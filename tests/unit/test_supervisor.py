"""The supervisor against real child processes, and the worker's error records."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import pytest

from understudy.common import env
from understudy.common.errorfile import (
    MAX_RECORD_BYTES,
    ErrorRecord,
    read_error,
    record_error,
)
from understudy.daemon.supervisor import ChildExit, ChildState, Supervisor
from understudy.worker.errors import record

pytestmark = pytest.mark.timeout(30)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


class Exits:
    """Collects exits through the ``on_exit`` callback (awaitable, as the daemon's is)."""

    def __init__(self) -> None:
        self.seen: list[ChildExit] = []
        self.event = asyncio.Event()

    async def __call__(self, exit_: ChildExit) -> None:
        self.seen.append(exit_)
        self.event.set()

    async def next(self, timeout: float = 10.0) -> ChildExit:
        await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()
        return self.seen[-1]


def run(tmp_path: Path, body: Callable[[Supervisor, Exits], Awaitable[None]]) -> None:
    async def main() -> None:
        exits = Exits()
        sup = Supervisor(tmp_path / "run", exits)
        try:
            await body(sup, exits)
        finally:
            await sup.close(grace=0.5)

    asyncio.run(main())


async def wait_for_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        await asyncio.sleep(0.01)
    return path.read_text()


def test_clean_exit_is_seen_with_the_child_environment(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        run_dir = str(tmp_path / "run" / "errors")
        pid = await sup.spawn("ok", py(f"""
            import os, sys
            good = (os.environ[{env.CHILD_NAME!r}] == "ok"
                    and os.environ[{env.CHILD_ERROR_FILE!r}].startswith({run_dir!r})
                    and os.environ["EXTRA"] == "1")
            sys.exit(0 if good else 5)
            """), env={"EXTRA": "1"})
        exit_ = await exits.next()
        assert (exit_.name, exit_.pid, exit_.returncode, exit_.signal) == ("ok", pid, 0, None)
        assert exit_.state == ChildState.EXITED and not exit_.stopped_by_us
        assert exit_.error is None and exit_.ended_at >= exit_.started_at
        assert exit_.describe() == f"worker ok (pid {pid}) exited cleanly"
        assert sup.first_failure is None
        assert sup.children == {"ok": (pid, ChildState.EXITED)}
        assert sup.running_count == 0

    run(tmp_path, body)


@pytest.mark.parametrize("enabled", [False, True])
def test_children_inherit_the_daemons_failpoint_decision(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    """The daemon's own UNDERSTUDY_FAILPOINTS reaches its workers only where its configuration
    enables failpoints; a job's env may set the spec but not the decision."""
    monkeypatch.setenv(env.FAILPOINTS, "joiner.switch=exit(3)")  # the daemon's environment
    out = tmp_path / "env.json"
    dump = py(f"""
        import json, os
        keys = ({env.FAILPOINTS!r}, {env.FAILPOINTS_ENABLED!r})
        json.dump({{k: os.environ.get(k) for k in keys}}, open({str(out)!r}, "w"))
        """)

    async def main() -> None:
        exits = Exits()
        sup = Supervisor(tmp_path / "run", exits, failpoints=enabled)
        try:
            await sup.spawn("w", dump)
            assert (await exits.next()).returncode == 0
            seen = json.loads(out.read_text())
            assert seen == {env.FAILPOINTS: "joiner.switch=exit(3)" if enabled else None,
                            env.FAILPOINTS_ENABLED: "1" if enabled else "0"}
            await sup.spawn("job", dump, env={env.FAILPOINTS: "leaver.send=exit(9)"})
            assert (await exits.next()).returncode == 0
            assert json.loads(out.read_text()) == {env.FAILPOINTS: "leaver.send=exit(9)",
                                                   env.FAILPOINTS_ENABLED: seen[
                                                       env.FAILPOINTS_ENABLED]}
            with pytest.raises(ValueError, match=env.FAILPOINTS_ENABLED):
                await sup.spawn("forged", dump, env={env.FAILPOINTS_ENABLED: "1"})
        finally:
            await sup.close(grace=0.5)

    asyncio.run(main())


def test_recorded_exception_is_the_root_cause(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        pid = await sup.spawn("rank-3", py("""
            from understudy.worker.errors import record

            @record
            def main():
                raise ValueError("bad batch")

            main()
            """))
        exit_ = await exits.next()
        assert exit_.returncode == 1 and exit_.state == ChildState.FAILED
        assert exit_.error is not None
        assert (exit_.error.exc_type, exit_.error.message, exit_.error.pid) == (
            "ValueError", "bad batch", pid)
        assert "in main" in exit_.error.where and "ValueError" in exit_.error.traceback
        assert exit_.describe().startswith(
            f"worker rank-3 (pid {pid}) failed with exit code 1: ValueError: bad batch (at ")
        assert sup.first_failure is exit_

    run(tmp_path, body)


def test_kill_9_from_outside_is_seen_at_once_and_is_a_failure(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        ready = tmp_path / "ready"
        pid = await sup.spawn("victim", py(f"""
            import pathlib, time
            pathlib.Path({str(ready)!r}).touch()
            time.sleep(30)
            """))
        await wait_for_file(ready)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        exit_ = await exits.next()
        assert time.monotonic() - killed < 0.5
        assert exit_.signal == signal.SIGKILL and exit_.returncode is None
        assert exit_.state == ChildState.FAILED and not exit_.stopped_by_us
        assert exit_.describe() == f"worker victim (pid {pid}) was killed by SIGKILL"
        assert sup.first_failure is exit_

    run(tmp_path, body)


def test_stop_escalates_to_sigkill_and_is_not_a_failure(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        ready = tmp_path / "ready"
        pid = await sup.spawn("stubborn", py(f"""
            import pathlib, signal, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            pathlib.Path({str(ready)!r}).touch()
            time.sleep(30)
            """))
        await wait_for_file(ready)
        started = time.monotonic()
        exit_ = await sup.stop("stubborn", grace=0.3)
        elapsed = time.monotonic() - started
        assert exit_ is not None and 0.3 <= elapsed < 2.0
        assert exit_.signal == signal.SIGKILL and exit_.stopped_by_us
        assert exit_.state == ChildState.KILLED and not exit_.failed
        assert exit_.describe() == (
            f"worker stubborn (pid {pid}) was stopped by the daemon with SIGKILL")
        assert sup.first_failure is None
        assert await sup.stop("stubborn", grace=0.3) is exit_  # already ended
        assert await sup.stop("nobody", grace=0.3) is None

    run(tmp_path, body)


def test_kill_all_now_kills_the_whole_tree(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        pid_file = tmp_path / "grandchild.pid"
        await sup.spawn("parent", py(f"""
            import os, subprocess, time
            p = subprocess.Popen(["sleep", "30"])
            with open({str(pid_file)!r} + ".tmp", "w") as f:
                f.write(str(p.pid))
            os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
            time.sleep(30)
            """))
        grandchild = psutil.Process(int(await wait_for_file(pid_file)))
        assert grandchild.is_running()
        sup.kill_all_now()
        assert await sup.wait_all(timeout=2.0)
        assert sup.running_count == 0
        exit_ = await sup.stop("parent", grace=0.0)  # already ended: returns its exit
        assert exit_ is not None and exit_.signal == signal.SIGKILL
        assert exit_.state == ChildState.KILLED and sup.first_failure is None
        # Reparented to whoever reaps orphans here; it may linger as a zombie until reaped.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                if grandchild.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, "the grandchild survived kill_all_now"
            await asyncio.sleep(0.01)

    run(tmp_path, body)


def test_garbage_error_file_leaves_no_error_but_a_description(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        pid = await sup.spawn("garbage", py(f"""
            import os, sys
            with open(os.environ[{env.CHILD_ERROR_FILE!r}], "wb") as f:
                f.write(b"\\x00 not json {{")
            sys.exit(3)
            """))
        exit_ = await exits.next()
        assert exit_.error is None and exit_.returncode == 3
        assert exit_.describe() == f"worker garbage (pid {pid}) failed with exit code 3"
        assert sup.first_failure is exit_

    run(tmp_path, body)


def test_duplicate_live_name_is_refused_and_close_stops_children(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        sleeper = py("import time; time.sleep(30)")
        pid = await sup.spawn("twin", sleeper)
        with pytest.raises(ValueError, match="already running"):
            await sup.spawn("twin", sleeper)
        with pytest.raises(ValueError, match="name"):
            await sup.spawn("../escape", sleeper)
        assert sup.children == {"twin": (pid, ChildState.RUNNING)}
        assert sup.running_count == 1
        await sup.close(grace=1.0)
        assert sup.children["twin"].state == ChildState.KILLED
        assert [e.signal for e in exits.seen] == [signal.SIGTERM]
        with pytest.raises(ValueError, match="closed"):
            await sup.spawn("late", sleeper)

    run(tmp_path, body)


def _local(pid: int) -> tuple[str | None, str | None]:
    """The child's LOCAL_RANK and LOCAL_WORLD_SIZE, from its environment as the kernel holds it
    once its program runs: ``spawn`` may return while the kernel is still setting the new
    program up, when /proc shows no arguments and no environment yet (a suite run once read
    (None, None) there)."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + 10
    while "time.sleep" not in " ".join(proc.cmdline()):
        assert time.monotonic() < deadline, f"child {pid} never ran its program"
        time.sleep(0.01)
    environ = proc.environ()
    return environ.get(env.TORCH_LOCAL_RANK), environ.get(env.TORCH_LOCAL_WORLD_SIZE)


def test_workers_take_the_nodes_free_slots_as_local_rank(tmp_path: Path) -> None:
    """Each worker started with the node's slots gets the lowest slot no live child holds, as
    torchrun's LOCAL_RANK: a promoted standby (renamed) keeps its own, an exited child's is
    taken again, and a restart-only rank keeps the LOCAL_RANK its caller gave it."""
    async def body(sup: Supervisor, exits: Exits) -> None:
        sleeper = py("import time; time.sleep(30)")
        # Started at once: each reserves its slot before the other's start completes.
        p0, p1 = await asyncio.gather(sup.spawn("job.r0", sleeper, local_slots=2),
                                      sup.spawn("job.r1", sleeper, local_slots=2))
        assert {_local(p0), _local(p1)} == {("0", "2"), ("1", "2")}
        assert {n: str(v) for n, v in sup.slots_held.items()} == {
            "job.r0": _local(p0)[0], "job.r1": _local(p1)[0]}
        plain = await sup.spawn("helper", sleeper)  # no slot asked for: none taken or given
        assert _local(plain) == (None, None) and "helper" not in sup.slots_held
        over = await sup.spawn("job.standby", sleeper, local_slots=2)
        assert _local(over) == ("2", "2")  # every slot held: the next index, with a warning
        sup.rename("job.standby", "job.r2")
        assert sup.slots_held["job.r2"] == 2
        freed = sup.slots_held["job.r0"]
        os.kill(p0, signal.SIGKILL)
        assert (await exits.next()).name == "job.r0"
        again = await sup.spawn("job.r0", sleeper, local_slots=2)
        assert _local(again) == (str(freed), "2")
        given = await sup.spawn("restart.r5", sleeper, local_slots=2,
                                env={env.TORCH_LOCAL_RANK: "3", env.TORCH_LOCAL_WORLD_SIZE: "4"})
        assert _local(given) == ("3", "4") and sup.slots_held["restart.r5"] == 3
        assert sorted(sup.slots_held.values()) == [0, 1, 2, 3]

    run(tmp_path, body)


# -- error records, in process ------------------------------------------------------------


def test_error_file_keeps_only_the_first_error(tmp_path: Path) -> None:
    path = tmp_path / "errors" / "w.json"
    record_error(ValueError("first"), path)
    record_error(KeyError("second"), path)
    rec = read_error(path)
    assert rec is not None and (rec.exc_type, rec.message) == ("ValueError", "first")
    assert [p.name for p in path.parent.iterdir()] == ["w.json"]  # no temporary left


def test_record_decorator_records_and_reraises(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "e.json"
    monkeypatch.setenv(env.CHILD_ERROR_FILE, str(path))

    @record
    def fails() -> None:
        raise RuntimeError("boom\nsecond line")

    with pytest.raises(RuntimeError):
        fails()
    rec = read_error(path)
    assert rec is not None and rec.pid == os.getpid()
    assert rec.summary().startswith("RuntimeError: boom (at test_supervisor.py:")


def test_record_error_without_a_path_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.CHILD_ERROR_FILE, raising=False)
    record_error(ValueError("nowhere"))


def test_error_record_round_trip_and_size_cap() -> None:
    rec = ErrorRecord(message="m", exc_type="pkg.Err", traceback="tb", time=1.5, pid=7,
                      where="x.py:1 in f")
    assert ErrorRecord.from_json(rec.to_json()) == rec
    huge = ErrorRecord(message="é" * 100_000, exc_type="E", traceback="line\n" * 100_000,
                       time=0.0, pid=1, where="")
    data = huge.to_json()
    assert len(data) <= MAX_RECORD_BYTES
    back = ErrorRecord.from_json(data)
    assert back.traceback.endswith("line\n") and back.message.startswith("é")


@pytest.mark.parametrize("data, reason", [
    (b"", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "JSON list"),
    (json.dumps({"message": "m"}).encode(), "exc_type"),
    (json.dumps({"message": "m", "exc_type": "E", "traceback": "", "time": True, "pid": 1,
                 "where": ""}).encode(), "time"),
    (b" " * (MAX_RECORD_BYTES + 1), "more than"),
])
def test_garbage_records_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        ErrorRecord.from_json(data)


def test_an_error_file_that_is_no_plain_file_is_refused_at_once(tmp_path: Path) -> None:
    """The worker controls its error file's path and the daemon reads it on its event loop: a
    FIFO there (whose read would block until a writer came) and a symbolic link (to a file of
    someone else's) are refused without waiting; a missing file is no record."""
    rec = ErrorRecord(message="m", exc_type="E", traceback="", time=1.0, pid=1, where="")
    plain = tmp_path / "plain.json"
    plain.write_bytes(rec.to_json())
    assert read_error(plain) == rec
    assert read_error(tmp_path / "missing.json") is None
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_error(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(plain)
    with pytest.raises(OSError):
        read_error(link)


def test_excepthook_records_an_uncaught_exception(tmp_path: Path) -> None:
    async def body(sup: Supervisor, exits: Exits) -> None:
        await sup.spawn("hooked", py("""
            from understudy.worker.errors import install_excepthook
            install_excepthook()
            install_excepthook()
            raise KeyError("missing shard")
            """), log_path=tmp_path / "hooked.log")
        exit_ = await exits.next()
        assert exit_.error is not None and exit_.error.exc_type == "KeyError"
        assert "'missing shard'" in exit_.describe()
        assert "Traceback" in (tmp_path / "hooked.log").read_text()  # the usual hook still ran

    run(tmp_path, body)
