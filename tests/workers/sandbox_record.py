"""One rank of the plain-torch example job, the way a launcher runs it with recording: the rank
that records its role type wraps its groups and boundary hook with a Recorder.

Writes ``OUT/rank<r>.json`` (the loss of every step; for the recording rank, what the recorder
did) and ``OUT/rank<r>-after<N>.pt`` (the job's state after the recorded iterations).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from sandbox_common import JOB, SCRIPT, SEED, plain_example

from understudy.sandbox.manifest import CodeVersion, Layout, read_manifest, role_directory
from understudy.sandbox.recording import Recorder, RecordingGroup, RecordState, should_record
from understudy.worker.api import GroupsProvider, JobContext, allreduce_options
from understudy.worker.runtime import Runtime, StaticGroups


class LossJob(plain_example().PlainJob):  # type: ignore[misc]
    """PlainJob keeping the loss of each step it computed, to compare with the shadow's."""

    losses: dict[int, float]

    def compute(self, step: int) -> float:
        loss = super().compute(step)
        self.losses = {**getattr(self, "losses", {}), step: loss}
        return loss


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--record", type=int, required=True, help="iterations to record")
    p.add_argument("--recordings", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    layout = Layout(args.world_size, args.tp)
    real = StaticGroups(dist.FileStore(args.store, args.world_size), rank=args.rank,
                        world_size=args.world_size, tp=args.tp, timeout=30)
    recorder = None
    groups: GroupsProvider = real
    if should_record(args.rank, layout):
        recorder = Recorder(args.recordings, job=JOB, layout=layout, rank=args.rank,
                            iterations=args.record, code=CodeVersion.of(SCRIPT))
        groups = recorder.provider(real)
    ctx = JobContext(job=JOB, rank=args.rank, world_size=args.world_size,
                     tp=args.tp, groups=groups, seed=SEED, collective_timeout=30)
    job = LossJob()
    runtime = Runtime(job, ctx)
    runtime.build()
    if recorder is not None:
        runtime.hook = recorder.hook(runtime.hook)
    summary: dict[str, object] = {}
    kept = ctx.group("world")  # a job that keeps its group object past the recording
    summary["wrapped_while_recording"] = isinstance(kept, RecordingGroup)
    runtime.run(args.record)
    torch.save(job.state(), args.out / f"rank{args.rank}-after{args.record}.pt")
    runtime.run(args.steps)
    summary["losses"] = {str(k): v for k, v in job.losses.items()}
    if recorder is not None:
        state = recorder.wait(timeout=30)
        assert recorder.manifest is not None, recorder.reason
        summary.update(
            state=state.value, manifest_calls=recorder.manifest.calls,
            segments=recorder.manifest.segments,
            real_group_after=all(ctx.group(n) is real.current(n) for n in ("tp", "dp", "world")))
    # The kept wrapper still works after the recording, and records nothing more.
    t = torch.ones(2)
    work = kept.allreduce([t], allreduce_options(dist.ReduceOp.SUM))
    ctx.wait(work, "an all-reduce through the kept group object")
    summary["kept_result"] = t.tolist()
    if recorder is not None:
        summary["state_at_close"] = recorder.close(timeout=30).value
        summary["calls_on_disk_at_close"] = read_manifest(
            role_directory(args.recordings, recorder.role_type)).calls
        summary["still_recording"] = recorder.state is RecordState.RECORDING
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every collective is done (both ranks waited on the last): skip the interpreter's teardown,
    # whose destruction of the gloo groups sometimes aborts the process ("terminate called
    # without an active exception", exit -6) after its work was written.
    os._exit(code)
