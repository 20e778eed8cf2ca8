"""Every environment variable understudy reads or sets, in one place."""

import enum

# Read by understudyd and the CLI (they override the config file; flags override them).
CONFIG = "UNDERSTUDY_CONFIG"
NODE = "UNDERSTUDY_NODE"
ETCD = "UNDERSTUDY_ETCD"
PREFIX = "UNDERSTUDY_PREFIX"
ROLE = "UNDERSTUDY_ROLE"
SLOTS = "UNDERSTUDY_SLOTS"
FAILURE_DOMAIN = "UNDERSTUDY_FAILURE_DOMAIN"
RUN_DIR = "UNDERSTUDY_RUN_DIR"
#: where the ranks' own logs go (``rank_logs.dir``; default ``<run_dir>/logs``)
RANK_LOG_DIR = "UNDERSTUDY_RANK_LOG_DIR"
LEASE_TTL = "UNDERSTUDY_LEASE_TTL"
METRICS_LISTEN = "UNDERSTUDY_METRICS_LISTEN"
LOG_LEVEL = "UNDERSTUDY_LOG_LEVEL"
LOG_FORMAT = "UNDERSTUDY_LOG_FORMAT"
ETCD_CA = "UNDERSTUDY_ETCD_CA"
ETCD_CERT = "UNDERSTUDY_ETCD_CERT"
ETCD_KEY = "UNDERSTUDY_ETCD_KEY"
ETCD_USER = "UNDERSTUDY_ETCD_USER"
ETCD_PASSWORD = "UNDERSTUDY_ETCD_PASSWORD"

# Set by understudyd for its children (workers).
CHILD_SOCKET = "UNDERSTUDY_SOCKET"
CHILD_ERROR_FILE = "UNDERSTUDY_ERROR_FILE"
CHILD_NODE = "UNDERSTUDY_NODE"
CHILD_NAME = "UNDERSTUDY_CHILD"
#: the pid of the daemon that started the worker: the worker dies with it (worker.lifeline)
DAEMON_PID = "UNDERSTUDY_DAEMON_PID"
#: the node's first configured address (``addresses``), where a worker's servers bind
NODE_ADDRESS = "UNDERSTUDY_NODE_ADDRESS"
#: "1" where the daemon's configuration enables failpoints, else "0": a worker arms
#: ``UNDERSTUDY_FAILPOINTS`` only with "1" (common/failpoints.py); a job's env cannot set it
FAILPOINTS_ENABLED = "UNDERSTUDY_FAILPOINTS_ENABLED"

# A rank's coordinates, set by understudyd for each worker it starts.
JOB = "UNDERSTUDY_JOB"
RANK = "UNDERSTUDY_RANK"
WORLD_SIZE = "UNDERSTUDY_WORLD_SIZE"
TP = "UNDERSTUDY_TP"
DP = "UNDERSTUDY_DP"
PP = "UNDERSTUDY_PP"
TP_INDEX = "UNDERSTUDY_TP_INDEX"
DP_INDEX = "UNDERSTUDY_DP_INDEX"
PP_INDEX = "UNDERSTUDY_PP_INDEX"
EPOCH = "UNDERSTUDY_EPOCH"
#: a :class:`WorkerRole`: what the daemon started the worker as.
WORKER_ROLE = "UNDERSTUDY_WORKER_ROLE"

# What torchrun gives its workers (torch/distributed/elastic/agent/server/local_elastic_agent.py),
# set by understudyd for the ranks of a restart-only job (``understudy run --restart-only``), so
# an unmodified script's ``init_process_group(init_method="env://")`` works as under torchrun.
# LOCAL_RANK and LOCAL_WORLD_SIZE every worker gets (a live job's ranks and standbys too): the
# node's worker slot it holds and the node's slots (``daemon/supervisor.py``), its GPU.
TORCH_RANK = "RANK"
TORCH_WORLD_SIZE = "WORLD_SIZE"
TORCH_LOCAL_RANK = "LOCAL_RANK"
TORCH_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
#: the node's index among the job's nodes (torchrun's agent rank)
TORCH_GROUP_RANK = "GROUP_RANK"
TORCH_GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
TORCH_ROLE_RANK = "ROLE_RANK"
TORCH_ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
TORCH_ROLE_NAME = "ROLE_NAME"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
#: "False": rank 0's script hosts the env:// store (there is no agent store)
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
#: torch's CPU allocator puts each allocation of 2 MiB or more on transparent huge pages
#: ("1"): the daemon sets it for its workers unless the job's or its own environment does
THP_MEM_ALLOC_ENABLE = "THP_MEM_ALLOC_ENABLE"

# Set by systemd for Type=notify services.
NOTIFY_SOCKET = "NOTIFY_SOCKET"
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"

# Fault injection for tests (see common/failpoints.py); read by daemons and workers alike, and
# honoured only where the daemon's configuration enables failpoints.
FAILPOINTS = "UNDERSTUDY_FAILPOINTS"

# A job's own settings, from the job's environment (``understudy run --env K=V``).
#: the snapshot directory (every node must see it)
SNAPSHOTS = "UNDERSTUDY_SNAPSHOTS"
#: steps between snapshots
SNAPSHOT_EVERY = "UNDERSTUDY_SNAPSHOT_EVERY"
#: how many bytes a standby's snapshot holder may keep (default: half the machine's memory)
SNAPSHOT_HOLDER_BYTES = "UNDERSTUDY_SNAPSHOT_HOLDER_BYTES"
#: the recording directory for sandbox warmup (shared by every node)
RECORDINGS = "UNDERSTUDY_RECORDINGS"


class WorkerRole(enum.StrEnum):
    """The value of :data:`WORKER_ROLE`."""

    #: a worker holding a rank of the job
    RANK = "rank"
    #: a standby worker, warm and waiting to be chosen
    STANDBY = "standby"
