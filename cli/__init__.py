"""The operator CLI, ``understudy``. It talks to etcd like the daemons do, through the shared
core (:mod:`understudy.common`), and imports nothing else of ours."""
