"""The megatron-core (0.16.1) adapter: a Megatron GPT model on the job's versioned groups.

- :mod:`understudy.worker.megatron.adapter`: wiring ``megatron.core.parallel_state`` to the
  job's stable group objects, a FileStore-backed groups provider for standalone runs, and
  :class:`~understudy.worker.megatron.adapter.MegatronJob`, a TP x DP GPT training job.
- :mod:`understudy.worker.megatron.cpu`: the CPU-only substitutes for Megatron's CUDA RNG
  tracker and global memory buffer, used only where there is no GPU.

Importing this package does not import megatron-core; its modules do.
"""
