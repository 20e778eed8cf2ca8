"""One process of a pipeline-reshaped run of the plain example (``tests/integration/
test_restage.py``): the process is place ``--position`` of replica ``--replica``'s pipeline at
TP index ``--tp-index``; ``--phases`` lists the job's shapes, each as ``[the step it trains to,
its number of stages]``, every shape with ``--replicas`` replicas. The process trains in every
phase with more stages than its position (one unbroken run of phases), from the first (or, new
in a phase, from the units the old positions send it), moves its units at each boundary
(:func:`understudy.worker.restage.restage`) and leaves after the last phase it is in. A process
in the last phase saves its state as the example does (``rank<r>.pt`` in ``--save``).

Usage: ``restage_run.py --replica R --tp-index T --position K --replicas N --port P --phases
JSON -- TRAIN_ARGS...``, where ``TRAIN_ARGS`` are the example's (``--slots``, ``--tp``,
``--layers``, ``--microbatches`` and ``--rng-by-layer`` among them).
"""

from __future__ import annotations

import argparse
import json
import sys

from reshape_run import _example, phase_groups  # this folder: the script runs as a file

from understudy.common import logs
from understudy.groups.groupset import GroupSet
from understudy.worker.api import JobContext
from understudy.worker.migration import JobGroups
from understudy.worker.reshape import Shape, build_groups
from understudy.worker.restage import restage
from understudy.worker.runtime import Runtime


def member(replica: object, tp_index: int, position: int) -> str:
    return f"p{replica}.{tp_index}.{position}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--tp-index", type=int, required=True)
    p.add_argument("--position", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--phases", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    a, rest = p.parse_known_args()
    train = _example()
    args = train.parse_args([x for x in rest if x != "--"])
    logs.configure(stream=sys.stderr)
    replicas = tuple(range(a.replicas))
    phases = [(int(until), Shape(replicas, args.tp, int(pp)))
              for until, pp in json.loads(a.phases)]
    me, t, k_me = a.replica, a.tp_index, a.position
    mine = [i for i, (_, shape) in enumerate(phases) if k_me < shape.pp]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise SystemExit(f"position {k_me} is in phases {mine}: one unbroken run is needed")

    def group_set(k: int) -> GroupSet:
        return phase_groups("restage", member(me, t, k_me), k, a.port, a.timeout)

    k = mine[0]
    shape = phases[k][1]
    rank = shape.rank(me, t, k_me)
    groups = group_set(k)
    provider = JobGroups(groups, rank, shape.layout)
    ctx = JobContext(job="restage", rank=rank, world_size=shape.layout.world_size, tp=args.tp,
                     pp=shape.pp, groups=provider, seed=args.seed,
                     collective_timeout=a.timeout, slots=args.slots)
    runtime = Runtime(train.make_job(args), ctx)
    runtime.build()
    if k == 0:
        build_groups(groups, shape, rank, shape.members(member), k + 1)
    else:  # new in phase k: its units from the old positions
        restage(runtime, provider, None, groups, phases[k - 1][1], shape, me, t, k_me, member,
                k + 1)
    while True:
        runtime.run(phases[k][0])
        if k + 1 == len(phases):
            break
        before, k = shape, k + 1
        shape = phases[k][1]
        new = group_set(k)
        stays = restage(runtime, provider, groups, new, before, shape, me, t, k_me, member,
                        k + 1)
        groups = new
        if not stays:
            break
    if k == len(phases) - 1 and k_me < shape.pp and args.save is not None:
        train.save(runtime, args.save, runtime.ctx.rank)
    groups.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
