"""Live reshape of data parallelism (issue 16, items 2-4, the workers' side): a slotted TP=2 job
shrinks from four replicas to two, grows to three, then back to four, its survivors keeping
their state in memory and the new replicas taking theirs from a replica that stays, and ends
bit for bit equal to an uninterrupted run on four replicas. Real processes, real gloo groups
(rebuilt at each boundary), the real state transfer; the shapes and their boundaries are given
to every process by the test (``reshape_run.py``): the controller that would decide them is
not built."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.integration.bitwise import assert_rank_equal
from tests.integration.test_migration import ONE_THREAD, standalone_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = str(Path(__file__).with_name("reshape_run.py"))
TP, SLOTS, STEPS = 2, 4, 24
#: [the step each shape trains to, its replicas in data-parallel order]: DP 4 -> 2 -> 3 -> 4.
#: Replicas 1 and 3 leave at step 6; 4 joins at 12 (its state from replica 0), 5 at 18.
PHASES = [[6, [0, 1, 2, 3]], [12, [0, 2]], [18, [0, 2, 4]], [STEPS, [0, 2, 4, 5]]]
JOB = ("--slots", str(SLOTS), "--steps", str(STEPS), "--step-sleep", "0", "--adam",
       "functional")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_places(tmp_path: Path, port: int, argvs: dict[str, list[str]]) -> None:
    """Run one Python process per entry (name -> its arguments, its stderr in
    ``<name>.log``) with a store on ``port`` for their groups; each must exit 0."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    procs = {}
    try:
        for name, argv in argvs.items():
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed below)
            procs[name] = (log, subprocess.Popen(
                [sys.executable, *argv], env={**os.environ, **ONE_THREAD},
                stdout=subprocess.DEVNULL, stderr=log))
        for name, (_, proc) in procs.items():
            code = proc.wait(timeout=240)
            assert code == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for log, proc in procs.values():
            proc.kill()
            log.close()
        del store


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded-optimizer"])
def test_a_job_shrunk_from_four_replicas_to_two_and_grown_back_keeps_every_bit(
        tmp_path: Path, sharded: bool) -> None:
    # Sharded: the optimizer state cut by slot, each replica keeping its slots' and a copy of
    # the previous replica's (SlottedShardedJob); the slots' states move with the slots at each
    # reshape, a dropped replica's from their copies, a new replica's from their holders. At
    # 2 MiB a rank the gradients are past the sum's all-gather path (1 MiB over all slots):
    # the sum stops at each replica's slots' chunks (summed_slots). The replicated case runs
    # TP 2 (item 4); the sharded one TP 1, half the processes (the slots' states do not
    # depend on the TP split).
    sharding = ("--shard-optimizer", "--state-size", "2MiB") if sharded else ()
    tp = 1 if sharded else TP
    job = (*JOB, "--tp", str(tp), *sharding)
    port = _free_port()
    out = tmp_path / "out"
    replicas = sorted({r for _, reps in PHASES for r in reps})
    run_places(tmp_path, port, {
        f"p{replica}.{t}": [RUN, "--replica", str(replica), "--tp-index", str(t), "--port",
                            str(port), "--phases", json.dumps(PHASES), "--", "--save",
                            str(out), *job]
        for replica in replicas for t in range(tp)})
    text = (tmp_path / "p0.0.log").read_text()
    assert text.count("Took a new place in the job.") == 3, text[-3000:]
    # The uninterrupted run: four replicas, one slot each, the same job and steps.
    reference = standalone_run(tmp_path / "reference", world=4 * tp, tp=tp,
                               extra=("--slots", str(SLOTS), "--steps", str(STEPS),
                                      *sharding))
    for rank in range(4 * tp):
        assert_rank_equal(reference, rank, out, rank, rng=False)
