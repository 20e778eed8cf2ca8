"""Live pipeline reshape (issue 16, item 6, the workers' side): a slotted job on two replicas
goes from one pipeline stage to two, then four, then back to two, its layers moving whole
between the stages (the embedding and the head too), new processes taking theirs from the old
stages and leaving ones handing theirs on, and ends bit for bit equal to an uninterrupted run of
the submitted shape. Real processes, real gloo groups (rebuilt at each boundary), real
point-to-point transfers; the shapes and their boundaries are given to every process by the
test (``restage_run.py``): no controller plans a pipeline reshape yet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_migration import standalone_run
from tests.integration.test_reshape import _free_port, run_places

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = str(Path(__file__).with_name("restage_run.py"))
DP, STEPS, LAYERS = 2, 24, 4
#: [the step each shape trains to, its stages]: PP 1 -> 2 -> 4 -> 2, every position's phases
#: one unbroken run (position 1 joins at 6, positions 2 and 3 at 12 and leave at 18). The
#: class Adam (a user's): its per-parameter state is what a restage rebuilds.
PHASES = [[6, 1], [12, 2], [18, 4], [STEPS, 2]]
JOB = ("--slots", str(DP), "--steps", str(STEPS), "--step-sleep", "0", "--layers", str(LAYERS),
       "--microbatches", "4", "--rng-by-layer", "--adam", "class")


def _by_name(directory: Path, ranks: list[int]) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """The parameters and Adam moments of ``ranks`` (one replica's stages) by parameter name,
    and each rank's state besides them (schedule, step, data position, learning rates)."""
    tensors: dict[str, torch.Tensor] = {}
    rest = []
    for rank in ranks:
        state = torch.load(directory / f"rank{rank}.pt", weights_only=False)
        job = state["job"]
        optimizer = job["optimizer"]
        for i, name in enumerate(job["params"]):
            tensors[name] = job["params"][name]
            for key, value in optimizer["state"][i].items():
                tensors[f"{name}/{key}"] = value
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in optimizer["param_groups"]]
        rest.append((job["schedule"], job["data"], job["step"], state["runtime"]["step"],
                     groups))
    return tensors, rest


def test_a_job_whose_stages_go_from_one_to_four_and_back_keeps_every_bit(tmp_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "out"
    most = max(pp for _, pp in PHASES)
    run_places(tmp_path, port, {
        f"p{replica}.{k}": [RUN, "--replica", str(replica), "--tp-index", "0", "--position",
                            str(k), "--replicas", str(DP), "--port", str(port), "--phases",
                            json.dumps(PHASES), "--", "--save", str(out), *JOB]
        for replica in range(DP) for k in range(most)})
    text = (tmp_path / "p0.0.log").read_text()
    assert text.count("Took a new place in the job.") == 3, text[-3000:]
    # The uninterrupted run of the submitted shape: one stage, two replicas.
    reference = standalone_run(tmp_path / "reference", world=DP, tp=1, pp=1, extra=JOB)
    final = PHASES[-1][1]
    for replica in range(DP):
        # Rank (stage s, replica d) of the last shape: s * DP + d (TP 1).
        want, want_rest = _by_name(reference, [replica])
        got, got_rest = _by_name(out, [s * DP + replica for s in range(final)])
        assert want.keys() == got.keys(), sorted(want.keys() ^ got.keys())
        differ = [k for k in want if not (want[k].dtype == got[k].dtype
                                          and torch.equal(want[k], got[k]))]
        assert not differ, f"replica {replica}: {differ}"
        assert all(r == want_rest[0] for r in got_rest), (want_rest, got_rest)
