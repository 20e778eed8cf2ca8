"""Moving a rank's training state from the leaver to the joiner (phase 2 of a migration).

The state is a tree of dicts, lists and tuples whose leaves are dense tensors (parameters,
optimizer state, RNG states...) or plain picklable values (step, schedule, data position,
``random.getstate()``...). :func:`send_state` streams it over a :class:`StateTransport`;
:func:`receive_state` / :func:`receive_into` rebuild it on the other end, bit for bit.

Use (both ends hold a 2-rank group, the *transfer pair*; the caller owns the transport)::

    with PairGroupTransport(pair_pg, timeout_s=30) as t:          # the leaver
        stats = send_state(t, {"model": model.state_dict(), "optim": opt.state_dict(),
                               "rng": torch.get_rng_state(), "step": step},
                           should_abort=cancelled.is_set)
    log.info("state sent", transfer=str(stats))                   # MB/s, chunks, peak staging

    with PairGroupTransport(pair_pg, timeout_s=30) as t:          # the joiner
        state, stats = receive_into(t, {"model": model.state_dict(),
                                        "optim": opt.state_dict()})
    opt.load_state_dict(state["optim"])  # parameters and optimizer tensors already hold it

:func:`send_state` returns only after the joiner's final reply: success means the joiner holds
an exact copy. Any failure (corruption, a rejected manifest, peer death, timeout, abort) raises
:class:`TransferError` on both ends; an end that fails without having told its peer aborts the
transport, so that the peer fails at once instead of after its timeout. The joiner's
destination tensors are then partly written and must not be used.

Where things are:

* :mod:`.transports`: the seam (:class:`StateTransport` and its contract, :class:`Pending`,
  :class:`TransferError`) and :class:`PairGroupTransport`, over a 2-rank process group;
* :mod:`.wire`: the wire protocol, the manifest, the chunk plan and the chunk digests, and what
  a peer's manifest may hold ("Trust");
* :mod:`.ends`: what both ends share (the chunk-to-tensor mapping, the staging buffer,
  :class:`TransferStats`);
* :mod:`.sender` and :mod:`.receiver`: the leaver's end and the joiner's;
* :mod:`.landing`: the joiner's tensors as they land, for a job that applies a step's inputs
  while the rest of them is still on the wire.
"""

from __future__ import annotations

from understudy.worker.transfer.ends import TransferStats
from understudy.worker.transfer.landing import Landing
from understudy.worker.transfer.receiver import ChunkHook, receive_into, receive_state
from understudy.worker.transfer.sender import send_state
from understudy.worker.transfer.transports import (
    AbortCheck,
    PairGroupTransport,
    Pending,
    StateTransport,
    TransferError,
)
from understudy.worker.transfer.wire import (
    ALIGN,
    CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MANIFEST_BYTES,
    VERSION,
    Path,
)

# The wire format's internals, which tests/unit/test_transfer.py checks directly.
from understudy.worker.transfer.wire import _digest as _digest
from understudy.worker.transfer.wire import _dtype as _dtype
from understudy.worker.transfer.wire import _dtype_name as _dtype_name
from understudy.worker.transfer.wire import _dump_manifest as _dump_manifest
from understudy.worker.transfer.wire import _Entry as _Entry
from understudy.worker.transfer.wire import _flatten as _flatten
from understudy.worker.transfer.wire import _plan as _plan
from understudy.worker.transfer.wire import _tensors_by_path as _tensors_by_path

__all__ = [
    "ALIGN",
    "CHECKSUM",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_MANIFEST_BYTES",
    "VERSION",
    "AbortCheck",
    "ChunkHook",
    "Landing",
    "PairGroupTransport",
    "Path",
    "Pending",
    "StateTransport",
    "TransferError",
    "TransferStats",
    "receive_into",
    "receive_state",
    "send_state",
]
