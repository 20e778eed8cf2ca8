"""The shared core: the vocabulary every understudy process uses (the daemon, the CLI, workers,
standbys). It imports nothing else of ours, and never torch.

- :mod:`~understudy.common.env`: the environment contract between a daemon and its workers.
- :mod:`~understudy.common.logs`: logging set-up (structlog, one JSON line per record).
- :mod:`~understudy.common.errors`: ``UnderstudyError`` and the daemon-side families.
- :mod:`~understudy.common.failpoints`: named fault injection, for tests.
- :mod:`~understudy.common.states`, :mod:`~understudy.common.records`,
  :mod:`~understudy.common.keys`: lifecycles, the typed records kept in etcd and their keys.
- :mod:`~understudy.common.snapshot_tiers`: the snapshot report's schema and rollback points.
- :mod:`~understudy.common.layout`: a job's rank layout (TP x PP x DP) and its groups.
- :mod:`~understudy.common.config`: the configuration file (the daemon's, read by the CLI too).
- :mod:`~understudy.common.store`: the etcd client (``EtcdStore``) the daemon and the CLI use.
- :mod:`~understudy.common.errorfile`: the error record a worker leaves for its daemon.
- :mod:`~understudy.common.sockproto`, :mod:`~understudy.common.daemon_client`: the local
  socket's protocol and the client workers use.
- :mod:`~understudy.common.version`: understudy's version.
"""
