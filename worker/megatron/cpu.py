"""CPU-only substitutes for the two CUDA-only pieces of megatron-core 0.16.1 that a TP/DP GPT
model touches: the tensor-parallel RNG tracker and the global memory buffer.

**Used only when there is no GPU.** :func:`install` refuses to run where CUDA is available: there
Megatron's own ``CudaRNGStatesTracker`` and ``GlobalMemoryBuffer`` are the right ones, and
swapping them would silently move dropout masks and attention scratch space to the CPU.

- :class:`CPURNGStatesTracker` has the interface of Megatron's ``CudaRNGStatesTracker``
  (``add``, ``fork``, ``get_states``, ``set_states``, ``reset``, ``is_initialized``) over torch's
  default **CPU** generator, which is where dropout draws on CPU. ``fork(name)`` swaps that
  generator to the named stream for the duration of the block, exactly as Megatron's tracker
  swaps the CUDA generator. Megatron uses it for dropout inside tensor-parallel regions (the
  attention dropout in ``DotProductAttention``), where each TP rank needs its own stream.
- :class:`CPUGlobalMemoryBuffer` is Megatron's ``GlobalMemoryBuffer`` allocating on the CPU
  instead of ``torch.cuda.current_device()``; ``DotProductAttention`` takes its ``baddbmm``
  input from it on every forward.

:func:`install` puts both where Megatron looks them up: ``tensor_parallel.random.
_CUDA_RNG_STATE_TRACKER`` (with ``_CUDA_RNG_STATE_TRACKER_INITIALIZED``, so that
``get_cuda_rng_tracker()`` does not replace it) and ``parallel_state._GLOBAL_MEMORY_BUFFER``.
:func:`model_parallel_cpu_manual_seed` is ``model_parallel_cuda_manual_seed`` for it: the same
stream names and the same seed offsets.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from functools import reduce
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers as mlayers
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.utils import GlobalMemoryBuffer

#: Megatron's stream names (``megatron.core.tensor_parallel.random``).
MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


class CPURNGStatesTracker:
    """Megatron's RNG tracker over the default CPU generator (see the module docstring).

    States are CPU generator states (``torch.ByteTensor``), so ``get_states()`` round-trips
    through ``set_states()`` and :func:`understudy.worker.rng.capture` bitwise.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current = "default-rng"

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        """The streams by name (the dictionary is a copy; the tensors are not)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed``; the default generator is left as it was.

        Raises:
            ValueError: the seed or the name is taken already (Megatron raises ``Exception``).
        """
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator is restored
        afterwards and the stream keeps its advance. Nested forks behave as Megatron's.

        Raises:
            ValueError: no stream ``name`` (Megatron raises ``Exception``).
        """
        if name not in self.states_:
            raise ValueError(f"RNG stream {name!r} was not added")
        outer_state = torch.get_rng_state()
        outer_name = self._current
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current = name
        try:
            yield
        finally:
            assert self._current == name, f"RNG stream {self._current} left open inside {name}"
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current = outer_name


class CPUGlobalMemoryBuffer(GlobalMemoryBuffer):
    """Megatron's ``GlobalMemoryBuffer`` on the CPU. Buffers start zeroed, so that nothing a run
    computes can depend on leftover memory (Megatron's callers overwrite them anyway)."""

    def get_tensor(self, tensor_shape: Sequence[int], dtype: torch.dtype, name: str,
                   mem_alloc_context: Callable[[], Any] | None = None) -> torch.Tensor:
        required = reduce(operator.mul, tensor_shape, 1)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < required:
            held = self.buffer[(name, dtype)] = torch.zeros(required, dtype=dtype)
        return held[0:required].view(*tensor_shape)


def install() -> CPURNGStatesTracker:
    """Put the CPU tracker and buffer where Megatron looks them up; returns the tracker.

    Raises:
        RuntimeError: CUDA is available: use Megatron's own tracker and buffer there.
    """
    if torch.cuda.is_available():
        raise RuntimeError("the CPU substitutes for Megatron's RNG tracker and memory buffer "
                           "are for machines without a GPU; CUDA is available here")
    tracker = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    parallel_state._GLOBAL_MEMORY_BUFFER = CPUGlobalMemoryBuffer()
    # Megatron's TP linear layers warn once that CUDA_DEVICE_MAX_CONNECTIONS should be 1, a
    # CUDA stream setting with no meaning on CPU; mark that warning as given.
    mlayers.linear_with_grad_accumulation_and_async_allreduce.warned = True
    return tracker


def model_parallel_cpu_manual_seed(tracker: CPURNGStatesTracker, seed: int, *, tp_rank: int,
                                   ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Megatron's ``model_parallel_cuda_manual_seed`` for the CPU tracker: the same three
    streams with the same seeds (``seed`` for data-parallel, ``seed + 2718 + tp_rank`` for
    tensor-parallel, ``seed + 1024 + 100 * ep_rank + etp_rank`` for expert-parallel). Unlike
    the CUDA version it does not reseed the default generator: on CPU that is the
    process-global one, which the job seeds itself."""
    tracker.reset()
    tracker.add(DATA_PARALLEL_RNG, seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_rank + etp_rank)
