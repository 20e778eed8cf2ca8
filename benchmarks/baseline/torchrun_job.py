"""The plain-PyTorch example's job under ``torchrun``, the way most teams run today: the baseline.

One process per rank, started by ``torch.distributed.run`` (torchrun, elastic agents on a c10d
rendezvous). It trains ``PlainJob`` from ``examples/plain_torch/train.py`` (same model, seed,
data and TP x DP layout as under ``understudy run``) with a plain loop: reseed, compute (forward,
backward, the TP and DP all-reduces, each waited on with ``work.wait()``), apply. No vote, no
abortable waits, no daemon. Every ``--ckpt-every`` steps it saves with
``torch.distributed.checkpoint`` (``--ckpt-mode sync``: ``dcp.save``, training waits for it;
``async``: ``dcp.async_save`` on a gloo group of its own, the previous save waited for first). On
start it resumes from the newest complete checkpoint (one with ``.metadata``, which DCP writes
last). A failed rank raises; its agent restarts the group (``--max-restarts``).

``--drain-notice`` is what a careful team adds for planned drains: SIGTERM (the agent forwards
it to its workers when it is told to stop) makes a rank write ``stop_at = its next step + 1`` to
the rendezvous store; every rank looks for that key at each step boundary (one store round trip a
step) and at that boundary all ranks save at once, then exit: the notified ranks with 0, the
others with :data:`EXIT_DRAINED` so that their agent restarts them and re-rendezvouses with the
node that replaces the drained one. ``stop_at`` one step ahead is always in time: no rank can
finish step ``s`` before the writer has started it (the TP and DP all-reduces chain every rank),
so every rank is at most at the boundary of ``s`` when the writer wrote before computing ``s``.

Each process appends JSON lines to ``--step-log/rank<r>-<pid>.jsonl``: ``start`` (before
importing torch), ``init`` (process group up), ``restored``, a ``step`` line per committed step
(the same fields as the example's ``StepLog``), ``saved``, ``drain`` and ``exit``.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the imports: a restarted rank pays for them

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from jobkit import Log, PlainContext, PlainJob  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from understudy.common.layout import Layout  # noqa: E402
from understudy.worker.api import Communicator, JobContext  # noqa: E402

#: The exit code of a rank that stopped for another node's drain: its agent restarts it.
EXIT_DRAINED = 75
METADATA = ".metadata"


class TorchGroups:
    """The job's TP, DP and world groups as ``torch.distributed`` process groups of the default
    group that torchrun's rendezvous set up."""

    def __init__(self, layout: Layout, rank: int) -> None:
        self._groups: dict[str, Communicator] = {}
        # Every rank creates every group, in one order (new_group is collective).
        for name in ("tp", "dp"):
            seen: set[tuple[int, ...]] = set()
            for r in range(layout.world_size):
                ranks = layout.group_ranks(name, r)
                if ranks in seen:
                    continue
                seen.add(ranks)
                pg = dist.new_group(list(ranks), backend="gloo")
                if rank in ranks:
                    self._groups[name] = pg
        self._groups["world"] = dist.group.WORLD

    def current(self, name: str) -> Communicator:
        try:
            return self._groups[name]
        except KeyError:
            raise ValueError(f"unknown group {name!r}") from None


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` (``step<N>/.metadata``), if any."""
    found = []
    for d in root.glob("step*"):
        if (d / METADATA).exists() and d.name[4:].isdigit():
            found.append((int(d.name[4:]), d))
    return max(found) if found else None


def dcp_state(job: PlainJob, ctx: JobContext) -> dict[str, Any]:
    """What DCP saves and loads. Parameters and optimizer state are keyed by TP index: the two
    TP ranks hold different slices under the same names, and the DP replicas of one slice are
    identical, so DCP's de-duplication writes each slice once (as DTensor sharding would)."""
    model_sd, optim_sd = get_state_dict(job.params, job.optimizer)
    return {f"tp{ctx.tp_index}": {"model": model_sd, "optim": optim_sd},
            "schedule": job.schedule.state_dict(), "step": job.committed}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--state-size", type=int, help="state per rank in bytes, as the example's "
                   "--state-size (default: the example's own size)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--step-log", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, help="checkpoints (step<N>/); resumed from on start")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--ckpt-mode", choices=("sync", "async"), default="sync")
    p.add_argument("--drain-notice", action="store_true",
                   help="on SIGTERM, all ranks save at an agreed step and stop")
    p.add_argument("--timeout", type=float, default=60.0, help="gloo's timeout, seconds")
    args = p.parse_args(argv)
    if (args.ckpt_every or args.drain_notice) and args.ckpt_dir is None:
        p.error("--ckpt-every and --drain-notice need --ckpt-dir")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = Log(args.step_log, rank)
    log("start", at=T_START, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        node=int(os.environ.get("GROUP_RANK", "-1")))
    notice: list[float] = []
    if args.drain_notice:
        signal.signal(signal.SIGTERM, lambda *_: notice.append(time.time()))

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    layout = Layout(world, args.tp)
    ctx = PlainContext(job="torchrun", rank=rank, world_size=world, tp=args.tp,
                       groups=TorchGroups(layout, rank), seed=args.seed,
                       collective_timeout=args.timeout)
    # One generation id for this incarnation of the group, to scope the store keys it writes.
    gen = torch.tensor([T_START], dtype=torch.float64)
    dist.all_reduce(gen, op=dist.ReduceOp.MAX)
    generation = f"{gen.item():.6f}"
    ckpt_pg = (dist.new_group(backend="gloo") if args.ckpt_mode == "async" and args.ckpt_every
               else None)
    log("init", generation=generation)

    job = PlainJob(step_sleep=args.step_sleep, state_bytes=args.state_size)
    job.build(ctx)
    newest = newest_checkpoint(args.ckpt_dir) if args.ckpt_dir is not None else None
    if newest is not None:
        t = time.perf_counter()
        sd = dcp_state(job, ctx)
        dcp.load(sd, checkpoint_id=newest[1])
        part = sd[f"tp{ctx.tp_index}"]
        set_state_dict(job.params, job.optimizer, model_state_dict=part["model"],
                       optim_state_dict=part["optim"])
        job.schedule.load_state_dict(sd["schedule"])
        job.committed = int(sd["step"])
        if job.committed != newest[0]:
            raise RuntimeError(f"checkpoint {newest[1]} holds step {job.committed}")
        log("restored", step=job.committed, load_s=time.perf_counter() - t)

    store = dist.distributed_c10d._get_default_store() if args.drain_notice else None
    stop_key = f"understudy-bench/drain/{generation}"
    pending: Any = None  # the async save in flight

    def save(step: int, mode: str) -> None:
        nonlocal pending
        assert args.ckpt_dir is not None
        path = args.ckpt_dir / f"step{step}"
        t = time.perf_counter()
        if pending is not None:
            pending.result()
            pending = None
        waited = time.perf_counter() - t
        if mode == "async":
            pending = dcp.async_save(dcp_state(job, ctx), checkpoint_id=path,
                                     process_group=ckpt_pg)
        else:
            dcp.save(dcp_state(job, ctx), checkpoint_id=path)
        log("saved", step=step, mode=mode, save_s=time.perf_counter() - t,
            waited_previous_s=waited)

    step = job.committed
    announced = False
    while step < args.steps:
        if store is not None:
            if notice and not announced:
                announced = True
                store.compare_set(stop_key, "", str(step + 1))
                log("drain", notice_at=notice[0], stop_at=int(store.get(stop_key)))
            if store.check([stop_key]) and int(store.get(stop_key)) == step:
                save(step, "sync")
                code = 0 if notice else EXIT_DRAINED
                log("exit", step=step, code=code, reason="drain")
                sys.stdout.flush()
                os._exit(code)  # the groups' teardown could wait on peers that left
        job.reseed(step)
        loss = job.compute(step)
        job.apply(step)
        step += 1
        log("step", step=step - 1, loss=None if loss is None else float(loss))
        if args.ckpt_every and step % args.ckpt_every == 0 and step < args.steps:
            save(step, args.ckpt_mode)
    if pending is not None:
        pending.result()
    log("exit", step=step, code=0, reason="done")
    # Every rank is done once the barrier passes; the gloo teardown after it sometimes aborts
    # a rank ("terminate called without an active exception"), which fails its agent and
    # leaves the other one in torchrun's exit barrier for 300 s. Nothing is left to tear down.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
