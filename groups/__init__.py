"""A job's logical process groups as stable objects whose communicator is replaced by version
(``docs/groups.md``). On the shared core only (:mod:`understudy.common`): never the worker,
never the daemon."""
