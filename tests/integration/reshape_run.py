"""One process of a reshaped run of the plain example (``tests/integration/test_reshape.py``):
the process is place ``--tp-index`` of replica ``--replica``; ``--phases`` lists the job's
shapes, each as ``[the step it trains to, [its replicas in data-parallel order]]``. The process
trains in every phase its replica is in, from the first (or, for a replica that is new there,
from the state of the same place in a replica that stays: :func:`understudy.worker.reshape.
donors`), re-forms its groups at each boundary (:func:`understudy.worker.reshape.reshape`),
and leaves after the last phase its replica is in. A process whose replica is in the last phase
saves its state as the example does (``rank<r>.pt`` in the example's ``--save`` folder).

Usage: ``reshape_run.py --replica R --tp-index T --port P --phases JSON -- TRAIN_ARGS...``,
where ``TRAIN_ARGS`` are the example's (``--slots`` and ``--tp`` among them).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from understudy.common import logs
from understudy.groups.groupset import GroupSet
from understudy.worker.api import JobContext
from understudy.worker.migration import JobGroups
from understudy.worker.reshape import Shape, build_groups, donors, reshape
from understudy.worker.runtime import Runtime
from understudy.worker.transfer import PairGroupTransport, receive_into, send_state

TRAIN = Path(__file__).parents[2] / "examples" / "plain_torch" / "train.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("plain_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def member(replica: Any, tp_index: int, stage: int) -> str:
    return f"p{replica}.{tp_index}.{stage}"


def pair(groups: GroupSet, donor: Any, joiner: Any, t: int, version: int,
         timeout: float) -> PairGroupTransport:
    """The transfer pair of ``joiner``'s place ``t`` and its donor's, built on both ends."""
    name = f"pair-{joiner}.{t}"
    groups.create(name, [member(donor, t, 0), member(joiner, t, 0)], version=version)
    return PairGroupTransport(groups.current(name), timeout_s=timeout)


def phase_groups(job: str, name: str, phase: int, port: int, timeout: float) -> GroupSet:
    """The group set of process ``name`` for ``phase`` (epoch ``phase + 1``) on the test's
    store at ``port``."""
    def store(namespace: str, cancel: object) -> dist.Store:
        # A client of its own for each group: a TCPStore client serialises its operations,
        # so two groups built at once through one would wait for each other's keys crosswise.
        client = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout))
        return dist.PrefixStore(f"e{phase + 1}/{namespace}", client)

    return GroupSet(job, name, epoch=phase + 1, timeout=timeout, backends={"cpu": "gloo"},
                    store_factory=store)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--tp-index", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--phases", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    a, rest = p.parse_known_args()
    train = _example()
    args = train.parse_args([x for x in rest if x != "--"])
    logs.configure(stream=sys.stderr)
    phases = [(int(until), Shape(tuple(reps), args.tp)) for until, reps in json.loads(a.phases)]
    me, t = a.replica, a.tp_index

    def group_set(k: int) -> GroupSet:
        return phase_groups("reshape", member(me, t, 0), k, a.port, a.timeout)

    k = next(i for i, (_, shape) in enumerate(phases) if me in shape.replicas)
    shape = phases[k][1]
    rank = shape.rank(me, t)
    groups = group_set(k)
    provider = JobGroups(groups, rank, shape.layout)
    ctx = JobContext(job="reshape", rank=rank, world_size=shape.layout.world_size, tp=args.tp,
                     groups=provider, seed=args.seed, collective_timeout=a.timeout,
                     slots=args.slots)
    runtime = Runtime(train.make_job(args), ctx)
    runtime.build()
    members = shape.members(member)
    build_groups(groups, shape, rank, members, k + 1)
    if k > 0:  # a new replica: the state of the same place in a replica that stays
        donor = donors(phases[k - 1][1], shape)[me]
        with pair(groups, donor, me, t, k + 1, a.timeout) as transport:
            state, _ = receive_into(transport, runtime.state())
        runtime.load_state(state)
    while True:
        runtime.run(phases[k][0])
        if k + 1 == len(phases) or me not in phases[k + 1][1].replicas:
            break
        before, k = shape, k + 1
        shape = phases[k][1]
        rank = shape.rank(me, t)
        new = group_set(k)
        reshape(runtime, provider, groups, new, shape, rank, shape.members(member), k + 1)
        groups = new
        for joiner, donor in sorted(donors(before, shape).items()):
            if donor != me:
                continue
            with pair(groups, me, joiner, t, k + 1, a.timeout) as transport:
                send_state(transport, runtime.state())
    if k == len(phases) - 1 and args.save is not None:
        train.save(runtime, args.save, runtime.ctx.rank)
    groups.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
