"""The worker runtime: the training side of a rank (the step protocol, migration, recovery,
state transfer, snapshots). It imports the shared core (:mod:`understudy.common`) and the groups
(:mod:`understudy.groups`), never the daemon. :mod:`understudy.worker.launch` is a training
process's composition root, the one module that also wires in the sandbox."""
