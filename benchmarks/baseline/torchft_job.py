"""The plain-PyTorch example's job under torchft: the second baseline.

One process per rank of one **replica group**, started by its own ``torchrun`` (one agent per
replica group, ``--nproc-per-node 2``). The job is ``PlainJob`` from
``examples/plain_torch/train.py`` with the same model, seed and data as under ``understudy run``
and ``torchrun_job.py``, TP=2 x DP=2:

- **A replica group is one DP replica**: its two processes are the two TP ranks of one
  data-parallel index (global rank = ``replica * tp + local rank``, the layout's order). TP
  inside the group goes through a plain gloo group: the torchrun default group of the two local
  ranks (``init_process_group``), which torchft does not manage. torchft's replica groups are
  DDP/HSDP replicas; it has no notion of TP, and a failure of either TP rank loses the group.
- **DP across replica groups goes through torchft**: a ``torchft.manager.Manager`` per process
  (its server in local rank 0, a client in both), a reconfigurable
  ``torchft.process_group.ProcessGroupGloo``, the gradient all-reduce through
  ``Manager.allreduce`` (a SUM; ``PlainJob`` divides by the DP degree as under the other
  systems), the optimizer stepped only when ``Manager.should_commit()`` says so. The quorum comes
  from a ``Lighthouse`` (``torchft_run.py`` starts one). ``min_replica_size`` is the DP degree:
  the job keeps its global batch, so a survivor waits for the lost replica's replacement instead
  of training on half the data (which would train another model, and whose steps no longer
  compare with the other systems'). Quorums are synchronous (``use_async_quorum=False``): a
  joining group heals, that is loads the state of a healthy replica with the same local rank
  through torchft's checkpoint transport (HTTP), before its first forward.
- **No checkpoints**: recovery is live, from the other replica group. A restarted group starts
  at step 0 and is healed to the quorum's step; no step is redone.

The loop per step: quorum (``start_quorum``, healing if behind), reseed, compute (forward,
backward, TP all-reduces on the gloo group, the DP all-reduce through the manager), then
``should_commit`` and apply or discard.

``--drain-notice``: on SIGTERM (the agent forwards it when told to stop) a rank writes
``stop_at = its next step + 1`` to its replica group's store; both ranks look for that key at
each step boundary (one store round trip a step, as in ``torchrun_job.py``) and stop there.
torchft has no planned-migration path: the other replica waits in its quorum until a
replacement group has joined and healed.

Each process appends JSON lines to ``--step-log/rank<r>-<pid>.jsonl`` (``r`` the global rank):
``start`` (before importing torch), ``init`` (group, manager and model up), ``healed`` (the
quorum loaded another replica's state), a ``step`` line per committed step (the fields of the
example's ``StepLog``), ``drain`` and ``exit``.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the imports: a restarted rank pays for them

import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from jobkit import Log, PlainContext, PlainJob  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from understudy.worker.api import Communicator  # noqa: E402


class ManagedDP:
    """The DP group as ``PlainJob`` calls it (``allreduce([flat], opts)``), answered by the
    torchft manager: a fault-tolerant all-reduce across the replica groups of the quorum."""

    def __init__(self, manager: Manager, dp: int, shrinks: bool = False) -> None:
        #: ``shrinks``: the quorum may hold fewer replica groups than ``dp`` (``--min-replicas``)
        self.manager, self.dp, self.shrinks = manager, dp, shrinks

    def rank(self) -> int:
        return self.manager.participating_rank() or 0

    def size(self) -> int:
        # On fewer replica groups the gradient is the mean over those in the quorum, torchft's
        # own averaging: the global batch shrinks with the quorum.
        return self.manager.num_participants() if self.shrinks else self.dp

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> Any:
        if len(tensors) != 1 or opts.reduceOp != dist.ReduceOp.SUM:
            raise ValueError(f"only a SUM of one tensor goes through the manager, got "
                             f"{len(tensors)} tensors, {opts.reduceOp}")
        return self.manager.allreduce(tensors[0], reduce_op=dist.ReduceOp.SUM)


class Groups:
    """``tp``: the replica group's gloo default group; ``dp``: the torchft manager."""

    def __init__(self, tp: Communicator, dp: ManagedDP) -> None:
        self._groups: dict[str, Any] = {"tp": tp, "dp": dp}

    def current(self, name: str) -> Communicator:
        try:
            return self._groups[name]  # type: ignore[no-any-return]
        except KeyError:
            raise ValueError(f"unknown group {name!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", type=int, required=True, help="this replica group's DP index")
    p.add_argument("--dp", type=int, default=2, help="replica groups in the job")
    p.add_argument("--lighthouse", required=True, help="the Lighthouse's address (http://...)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--state-size", type=int, help="state per rank in bytes, as the example's "
                   "--state-size (default: the example's own size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--step-log", type=Path, required=True)
    p.add_argument("--drain-notice", action="store_true",
                   help="on SIGTERM, both ranks of the group stop at an agreed step")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="gloo's and the manager's timeout for collectives, seconds")
    p.add_argument("--min-replicas", type=int,
                   help="replica groups a quorum needs (default --dp: a survivor waits for the "
                        "lost group's replacement); fewer: the job trains on in a smaller "
                        "quorum, its global batch shrunk (torchft's own way)")
    p.add_argument("--quorum-timeout", type=float, default=300.0,
                   help="how long a replica waits in a quorum for its peers (a replacement "
                        "group starting cold), seconds")
    args = p.parse_args(argv)
    if not 0 <= args.replica < args.dp:
        p.error(f"--replica must be in [0, {args.dp}), got {args.replica}")
    if args.min_replicas is None:
        args.min_replicas = args.dp
    if not 1 <= args.min_replicas <= args.dp:
        p.error(f"--min-replicas must be in [1, {args.dp}], got {args.min_replicas}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    local, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rank = args.replica * tp + local
    log = Log(args.step_log, rank)
    log("start", at=T_START, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        node=args.replica)
    notice: list[float] = []
    if args.drain_notice:
        signal.signal(signal.SIGTERM, lambda *_: notice.append(time.time()))

    timeout = timedelta(seconds=args.timeout)
    # The replica group's own gloo group (TP), on the store its local rank 0 hosts for this
    # incarnation (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: no keys of a previous one). The
    # manager keeps its keys in the same store.
    dist.init_process_group("gloo", timeout=timeout)
    job = PlainJob(step_sleep=args.step_sleep, state_bytes=args.state_size)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=args.min_replicas,
        load_state_dict=job.load_state, state_dict=job.state,
        use_async_quorum=False, init_sync=False,  # every replica builds the model from the seed
        timeout=timeout, quorum_timeout=timedelta(seconds=args.quorum_timeout),
        rank=local, world_size=tp, replica_id=f"replica_{args.replica}",
        lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
        store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]))
    ctx = PlainContext(job="torchft", rank=rank, world_size=tp * args.dp, tp=tp,
                       groups=Groups(dist.group.WORLD,
                                     ManagedDP(manager, args.dp, args.min_replicas < args.dp)),
                       seed=args.seed, collective_timeout=args.timeout)
    job.build(ctx)
    store = dist.distributed_c10d._get_default_store() if args.drain_notice else None
    stop_key = "understudy-bench/drain"
    log("init")

    announced = False
    while job.committed < args.steps:
        if store is not None:
            if notice and not announced:
                announced = True
                store.compare_set(stop_key, "", str(job.committed + 1))
                log("drain", notice_at=notice[0], stop_at=int(store.get(stop_key)))
            if store.check([stop_key]) and int(store.get(stop_key)) == job.committed:
                # Local rank 0 hosts the group's store and manager server: it leaves only once
                # its peer has read the key too.
                dist.barrier()
                log("exit", step=job.committed, code=0, reason="drain")
                manager.shutdown(wait=False)
                sys.stdout.flush()
                os._exit(0)  # the groups' teardown could wait on peers that left
        before = job.committed
        t = time.perf_counter()
        manager.start_quorum()  # synchronous: a group behind the quorum heals here
        step = manager.current_step()
        if step != job.committed:
            raise RuntimeError(f"the manager is at step {step}, the job at {job.committed}")
        if step != before:
            log("healed", step=step, from_step=before, quorum_s=time.perf_counter() - t)
        if step >= args.steps:
            break
        job.reseed(step)
        loss = job.compute(step)
        if manager.should_commit():
            job.apply(step)
            log("step", step=step, loss=None if loss is None else float(loss))
        else:
            job.discard(step)
            log("discarded", step=step, error=str(manager.errored())[:200])
    # As for the drain: local rank 0 hosts the group's store and manager server, so neither
    # rank leaves before its peer is past the last step's commit. Without this, rank 0 left
    # while rank 1 still asked the manager whether to commit; rank 1 failed, its agent
    # restarted the group into a quorum the finished group never joins, and the run waited
    # out its timeout (the downtime smoke's planned-drain hang, three times under load).
    with contextlib.suppress(RuntimeError):  # the peer is gone already: nothing to wait for
        dist.barrier()
    log("exit", step=job.committed, code=0, reason="done")
    sys.stdout.flush()
    manager.shutdown(wait=False)
    os._exit(0)  # the other replica may have left: no collective teardown


if __name__ == "__main__":
    sys.exit(main())
