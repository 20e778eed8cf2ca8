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
        a, b = load_state(expected_dir, rank), load_state(actual_dir, rank)
        assert a.keys() == b.keys(), f"rank {rank}: {sorted(a.keys() ^ b.keys())}"
        for key, va in a.items():
            vb = b[key]
            if torch.is_tensor(va):
                assert va.dtype == vb.dtype and torch.equal(va, vb), f"rank {rank} {key} differs"
            elif key.endswith("redone"):
                continue
            else:
                assert va == vb, f"rank {rank} {key}: {va!r} != {vb!r}"
