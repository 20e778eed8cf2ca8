"""Stopping a survivor's compute at its next autograd operation once its job is recovering.

A rank learns that a peer is gone at its next collective: :meth:`JobContext.wait` does not wait
for one issued once the job recovers. Between two collectives nothing asks. A survivor whose own
groups are intact (the other replica of a TP x DP job that lost a whole TP group) computes on to
its next collective first, and the recovery waits for it: at 1 GiB of state per rank here, the
survivors of a node loss took 2.6 s to stop, in the forward of the step they had just begun,
the largest part of its 4.4 s downtime
(``benchmarks/results/state_sizes.1GiB-failures-1073741824.json``).

A job that sets ``interruptible = True`` (:class:`~understudy.worker.api.TrainingJob`) is asked
at every tensor autograd saves, going forward, and at every one it unpacks, going back: its
compute runs inside ``torch.autograd.graph.saved_tensors_hooks`` whose hooks poll the context's
``should_abort`` (at most every ``poll_interval`` of the context, 50 ms by default) and raise
:class:`ComputeInterrupted` once it says yes. The exception leaves the torch operation that
saved or unpacked the tensor, like any error of that operation; the runtime rolls the step
back (``discard`` and the RNGs) as after an aborted collective, whatever the job made of the
exception on its way out.

Opt-in, because the job must bear an exception at any autograd operation of its compute (not
only at its collectives), and because saved-tensor hooks of the job's own (activation offload,
``torch.utils.checkpoint``) take precedence inside their regions, and ``torch.compile`` may not
trace through hooks it does not know. Nothing runs in a job that does not set it, nor where the
context has no ``should_abort`` (a standalone run).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from understudy.groups.errors import CollectiveAborted

#: how often the hooks ask ``should_abort`` at most (it is cheap, but it may ask the daemon)
POLL_S = 0.01


class ComputeInterrupted(CollectiveAborted):
    """The job's compute was stopped at an autograd operation: the job is recovering."""


class Tripwire:
    """The hooks' state: whether they tripped, and when ``should_abort`` was last asked."""

    def __init__(self, should_abort: Callable[[], bool], *, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._should_abort = should_abort
        self._poll_s = poll_s
        self._clock = clock
        self._asked = float("-inf")
        self._started = clock()
        #: the hooks raised (they raise again at every later call, until the compute ends)
        self.tripped = False
        #: how often the hooks were called
        self.calls = 0

    def check(self) -> None:
        """Raises: ComputeInterrupted: ``should_abort`` said yes, now or before."""
        self.calls += 1
        if not self.tripped:
            now = self._clock()
            if now - self._asked < self._poll_s:
                return
            self._asked = now
            if not self._should_abort():
                return
            self.tripped = True
        waited = self._clock() - self._started
        raise ComputeInterrupted(f"compute stopped after {waited:.2f} s: the job is recovering",
                                 what="the step's compute", waited=waited)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.check()
        return tensor

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.check()
        return tensor


@contextlib.contextmanager
def interruptible(should_abort: Callable[[], bool], *,
                  poll_s: float = POLL_S) -> Iterator[Tripwire]:
    """Run the body with hooks that raise :class:`ComputeInterrupted` at the next tensor
    autograd saves or unpacks once ``should_abort()`` is true (see the module docstring)."""
    wire = Tripwire(should_abort, poll_s=poll_s)
    with torch.autograd.graph.saved_tensors_hooks(wire.pack, wire.unpack):
        yield wire
