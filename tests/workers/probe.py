"""A tiny worker for control-plane tests: reports its coordinates (and the allocator's
huge-pages setting it was given) through the daemon's key-value service, then exits with the
code given in PROBE_EXIT_RANK (rank:code). With PROBE_FOREIGN set, it also tries that namespace
(another job's) and reports what the daemon answered as ``foreign<rank>``."""

import os
import sys
import time

from understudy.common.daemon_client import DaemonClient, DaemonError
from understudy.worker.errors import record


@record
def main() -> int:
    job, rank = os.environ["UNDERSTUDY_JOB"], int(os.environ["UNDERSTUDY_RANK"])
    with DaemonClient(f"{job}/probe", epoch=int(os.environ["UNDERSTUDY_EPOCH"])) as client:
        coords = ",".join(os.environ[f"UNDERSTUDY_{k}"] for k in
                          ("WORLD_SIZE", "TP", "DP", "TP_INDEX", "DP_INDEX", "NODE"))
        client.set(f"rank{rank}", coords.encode())
        client.set(f"pid{rank}", str(os.getpid()).encode())
        client.set(f"thp{rank}", os.environ.get("THP_MEM_ALLOC_ENABLE", "unset").encode())
        foreign = os.environ.get("PROBE_FOREIGN")  # another job's namespace, tried
        if foreign:
            try:
                with DaemonClient(foreign, epoch=1) as other:
                    other.set("from-another-job", b"1")
                answer = "admitted"
            except DaemonError as exc:
                answer = str(exc)
            client.set(f"foreign{rank}", answer.encode())
    time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
    fail = os.environ.get("PROBE_FAIL_RANK")
    if fail is not None and int(fail) == rank:
        raise RuntimeError(f"probe rank {rank} failed on purpose")
    return 0


if __name__ == "__main__":
    sys.exit(main())
