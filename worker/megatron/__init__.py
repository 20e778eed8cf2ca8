"""The megatron-core (0.16.1) adapter: a Megatron GPT model on the job's versioned groups.

- :mod:`understudy.worker.megatron.adapter`: wiring ``megatron.core.parallel_state`` to the
  job's stable group objects, a FileStore-backed groups provider for standalone runs, and
  :class:`~understudy.worker.megatron.adapter.MegatronJob`, a TP x DP GPT training job (CPU).
- :mod:`understudy.worker.megatron.distributed`:
  :class:`~understudy.worker.megatron.distributed.ShardedMegatronJob`, the same model with
  Megatron's DDP and ``DistributedOptimizer`` (CUDA only), each rank's optimizer part copied
  on the next DP rank.
- :mod:`understudy.worker.megatron.cpu`: the CPU-only substitutes for Megatron's CUDA RNG
  tracker and global memory buffer, used only where there is no GPU.

Importing this package does not import megatron-core; its modules do, best inside
:func:`quiet_imports`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Import megatron-core (or a module of this package) inside this block to silence exactly
    the warnings megatron-core 0.16.1 gives at import: what the machine lacks (Apex,
    Transformer Engine), its own deprecated modules, and torch 2.13's deprecation of the
    ``torch.jit.script_method`` decorators it uses. None of them concerns a job; any other
    warning still shows (a test that turns warnings into errors still sees it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(Apex|Transformer Engine).* not installed",
                                category=UserWarning)
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r"The (following imports|'megatron\.core\.)",
                                category=DeprecationWarning)
        yield


__all__ = ["quiet_imports"]
