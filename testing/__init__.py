"""Local clusters for the demo, the tests and the benchmarks: an embedded etcd and daemons as
child processes (:mod:`~understudy.testing.localcluster`). Not the daemon: nothing in a
production process imports this package."""
