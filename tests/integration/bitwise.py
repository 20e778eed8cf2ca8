"""Comparing saved training states bit for bit (``rank<r>.pt`` files from ``--save``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a nested state, with its path."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}/{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, tree


def load_state(directory: Path, rank: int) -> dict[str, Any]:
    return dict(leaves(torch.load(directory / f"rank{rank}.pt", weights_only=False)))


def assert_bitwise_equal(expected_dir: Path, actual_dir: Path, world: int = 4) -> None:
    """Parameters, optimizer state, schedule, RNG states and step of every rank are identical
    (dtype and bits). Only the count of redone attempts may differ: it is not training state."""
    for rank in range(world):
        assert_rank_equal(expected_dir, rank, actual_dir, rank)


def assert_rank_equal(expected_dir: Path, expected: int, actual_dir: Path, actual: int,
                      rng: bool = True) -> None:
    """Rank ``actual`` of one run holds what rank ``expected`` of another does, bit for bit.
    ``rng=False`` leaves out the process-global generators' states, which a slotted job
    reseeds for every slot (what they hold after a step depends on the replica's last slot)."""
    a, b = load_state(expected_dir, expected), load_state(actual_dir, actual)
    if not rng:
        a, b = ({k: v for k, v in d.items() if not k.startswith("/rng/")} for d in (a, b))
    what = f"rank {actual}" + (f" (against {expected})" if actual != expected else "")
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())}"
    for key, va in a.items():
        vb = b[key]
        if torch.is_tensor(va):
            assert va.dtype == vb.dtype and torch.equal(va, vb), f"{what} {key} differs"
        elif key.endswith("redone"):
            continue
        else:
            assert va == vb, f"{what} {key}: {va!r} != {vb!r}"
