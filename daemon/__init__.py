"""understudyd: the per-node daemon and the cluster control plane on etcd.

It imports the shared core (:mod:`understudy.common`) and nothing else of ours; nothing imports
it. Nothing in this package imports torch: the daemon never touches a GPU context itself.
"""

import os as _os

# grpc's C core prints its own error lines to stderr (TLS failures, reconnects); the daemon and
# the CLI report those failures themselves, in one sentence. Must be set before grpc loads.
_os.environ.setdefault("GRPC_VERBOSITY", "NONE")
