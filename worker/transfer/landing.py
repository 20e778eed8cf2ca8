"""The tensors of a transfer as they land, for a joiner that uses them before the whole state is
through.

A joiner following its leaver (:class:`~understudy.worker.migration.SendAhead`) applies each
step the leaver forwards. It need not wait for the last byte: the runtime hands the job the
step's inputs as soon as the manifest is read, with a :class:`Landing`, and the job applies each
piece as it lands (:meth:`~understudy.worker.api.TrainingJob.apply_landing`), so that the
apply runs alongside the transfer rather than after it::

    landing = Landing(on_begin=start_applying)      # called with the tree, nothing landed yet
    tree, stats = receive_into(transport, into, landing=landing)

    # on the applying thread
    for lo, hi in landing.pieces(grad):             # flat element ranges of ``grad``, in order
        update(param.view(-1)[lo:hi], grad.view(-1)[lo:hi])

A piece is a range of one tensor that one chunk carried: a tensor of its own chunks lands in
pieces of ``chunk_bytes``, a small one whole. The chunks' checksums are compared only once
every chunk is through, so a job works on bytes not yet verified: a transfer that then fails
(:class:`~understudy.worker.transfer.TransferError` from :func:`receive_into`, and from
:meth:`Landing.pieces` on the applying thread) leaves what was applied meaningless, and the
joiner cannot take the rank (the migration is called off, as for any failed transfer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from understudy.worker.transfer.transports import TransferError


class Landing:
    """Which parts of a receive's tensors have landed; see the module docstring.

    ``on_begin(tree)`` is called once the manifest is read, with the sender's tree whose tensors
    are allocated (or are the target's) but hold nothing of the sender's yet, on the receiving
    thread: start the consumer there, and return quickly (the bytes wait meanwhile).
    """

    def __init__(self, on_begin: Callable[[Any], None] | None = None) -> None:
        self._on_begin = on_begin
        self._cond = threading.Condition()
        self._entry: dict[int, int] = {}     # id(tensor) -> entry index
        self._itemsize: list[int] = []
        self._numel: list[int] = []
        self._upto: list[int] = []           # elements landed, from the start, per entry
        self._error: BaseException | None = None
        self._done = False

    # -- the receiver's side ---------------------------------------------------------------

    def begin(self, tree: Any, tensors: list[torch.Tensor]) -> None:
        """The manifest is read: ``tensors`` are the entries, in order, as ``tree`` holds
        them (nothing landed)."""
        with self._cond:
            self._entry = {id(t): k for k, t in enumerate(tensors)}
            self._itemsize = [t.element_size() for t in tensors]
            self._numel = [t.numel() for t in tensors]
            self._upto = [0] * len(tensors)
        if self._on_begin is not None:
            self._on_begin(tree)

    def landed(self, entry: int, end_byte: int) -> None:
        """Entry ``entry``'s bytes up to ``end_byte`` are in place (its chunks land in order)."""
        with self._cond:
            self._upto[entry] = max(self._upto[entry], end_byte // self._itemsize[entry])
            self._cond.notify_all()

    def finish(self) -> None:
        """Every byte is in place and verified."""
        with self._cond:
            self._upto = list(self._numel)
            self._done = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The transfer failed: every wait ends with a TransferError."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # -- the consumer's side ---------------------------------------------------------------

    def pieces(self, tensor: torch.Tensor) -> Iterator[tuple[int, int]]:
        """The flat element ranges ``[lo, hi)`` of ``tensor`` (one of the tree's), in order and
        covering it, each once it has landed.

        Raises:
            TransferError: the transfer failed before the range landed.
            ValueError: ``tensor`` is not one of the transfer's.
        """
        entry = self._lookup(tensor)
        lo, numel = 0, self._numel[entry]
        while lo < numel:
            with self._cond:
                while self._upto[entry] <= lo and self._error is None:
                    self._cond.wait()
                if self._upto[entry] <= lo:
                    raise _failed(self._error)
                hi = self._upto[entry]
            yield lo, hi
            lo = hi

    def wait(self, tensor: torch.Tensor) -> None:
        """Until the whole of ``tensor`` (one of the tree's) has landed; raises as
        :meth:`pieces`."""
        for _ in self.pieces(tensor):
            pass

    def _lookup(self, tensor: torch.Tensor) -> int:
        with self._cond:
            entry = self._entry.get(id(tensor))
        if entry is None:
            raise ValueError(f"a tensor of shape {tuple(tensor.shape)} is not one of this "
                             "transfer's")
        return entry


def _failed(error: BaseException | None) -> TransferError:
    if isinstance(error, TransferError):
        return TransferError(f"the transfer failed: {error}")
    return TransferError(f"the transfer failed: {type(error).__name__}: {error}")
