"""Communication-free warmup of standby workers (``docs/sandbox.md``).

- :mod:`understudy.sandbox.recording`: a rank records its collectives for the first
  iterations of the job (``Recorder``), once per role type.
- :mod:`understudy.sandbox.replay`: groups that answer collectives from a recording
  (``ReplayGroup``, ``ReplayGroups``, ``Recording``).
- :mod:`understudy.sandbox.warmup`: a standby builds the job on replay groups and runs shadow
  iterations (``warm_up``), or falls back to a plain warm start.
- :mod:`understudy.sandbox.manifest`: layouts, role types, code versions, the manifest and
  atomic writes. :mod:`understudy.sandbox.ops`: what one call is. :mod:`understudy.sandbox.errors`:
  the ``SandboxError`` family.

It imports the shared core, the groups and the worker's API; only ``worker/launch.py`` imports it.
"""
