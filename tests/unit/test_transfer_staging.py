"""The state transfer's staging ring and its packed chunks, without processes.

Every end stages what cannot move straight between tensors (small tensors packed together,
pieces of non-contiguous ones) in one buffer of at most ``chunk_bytes``, used as a ring so that
several staged chunks are in flight at once (wire protocol version 2). These tests hold the
ring to its contract: regions in use never overlap, stay inside the buffer and aligned, and are
given back oldest first, after which the space they held serves again; and the plan's packed
chunks are small enough for four of them to share the ring.
"""

from __future__ import annotations

import random

import pytest
import torch

from understudy.worker.transfer import ALIGN, _Entry, _plan
from understudy.worker.transfer.ends import TransferStats, _Staging
from understudy.worker.transfer.wire import _Chunk, _pack_bytes


def _ring(capacity: int) -> _Staging:
    ring = _Staging(torch.device("cpu"), TransferStats("send"))
    ring.size_for([_Chunk(0, capacity)], capacity)
    return ring


def _span(ring: _Staging, region: torch.Tensor) -> tuple[int, int]:
    base = ring._buf
    assert base is not None
    start = region.data_ptr() - base.data_ptr()
    return start, start + region.numel()


@pytest.mark.parametrize("seed", range(20))
def test_regions_in_use_never_overlap_and_come_back_oldest_first(seed: int) -> None:
    rng = random.Random(seed)
    capacity = ALIGN * rng.randint(1, 64)
    ring = _ring(capacity)
    live: list[tuple[int, int]] = []
    handed = 0
    for _ in range(400):
        nbytes = rng.randint(1, capacity)
        region = ring.take(nbytes)
        if region is None:
            assert live, "an empty ring always has room for a chunk that fits it"
            ring.release()
            live.pop(0)
            continue
        start, end = _span(ring, region)
        assert region.numel() == nbytes and start % ALIGN == 0
        assert start >= 0 and end <= capacity
        for a, b in live:
            assert end <= a or b <= start, f"{(start, end)} overlaps {(a, b)}"
        live.append((start, end))
        handed += 1
        if rng.random() < 0.4:
            ring.release()
            live.pop(0)
    assert handed > 100
    assert ring._stats.peak_staging_bytes == capacity


def test_a_full_ring_waits_for_its_oldest_region_then_wraps_around() -> None:
    ring = _ring(4 * ALIGN)
    first, second = ring.take(ALIGN), ring.take(2 * ALIGN)
    assert first is not None and second is not None
    assert ring.take(2 * ALIGN) is None, "one slot left, two asked for"
    ring.release()  # the first: one slot at the front, one at the back, never joined
    assert ring.take(2 * ALIGN) is None
    ring.release()
    wrapped = ring.take(3 * ALIGN)
    assert wrapped is not None and _span(ring, wrapped) == (0, 3 * ALIGN)


def test_the_ring_is_as_small_as_its_staged_chunks_need() -> None:
    ring = _Staging(torch.device("cpu"), TransferStats("send"))
    ring.size_for([_Chunk(0, 5), _Chunk(1, 100)], 4096)
    assert ring.capacity == ALIGN + 112, "room for both, aligned"
    ring.size_for([_Chunk(0, 4000), _Chunk(1, 4096), _Chunk(2, 300)], 4096)
    assert ring.capacity == 4096, "never more than chunk_bytes"
    ring.size_for([], 4096)
    assert ring.capacity == 0


@pytest.mark.parametrize("chunk_bytes", [16, 48, 4096, 8 * 2**20])
def test_packed_chunks_fit_four_to_a_ring_and_hold_every_small_entry(chunk_bytes: int) -> None:
    pack = _pack_bytes(chunk_bytes)
    large = max(ALIGN, chunk_bytes // 8)
    assert large <= pack <= chunk_bytes and pack % ALIGN == 0
    if chunk_bytes >= 4 * ALIGN * 8:
        assert 4 * pack <= chunk_bytes
    sizes = [1, 3, large - 1, large, 2 * chunk_bytes + 5, 7, large // 2 + 1] * 5
    entries = [_Entry((i,), "uint8", (n,), "cpu") for i, n in enumerate(sizes) if n > 0]
    for c in _plan(entries, chunk_bytes):
        if len(c.segments) > 1 or entries[c.segments[0][0]].nbytes < large:
            assert c.nbytes <= pack, c
        else:
            assert c.nbytes <= chunk_bytes
