"""A worker dies with the daemon that started it.

Under systemd the unit's cgroup is killed when ``understudyd`` stops or crashes
(``KillMode=mixed``), workers included. Without it (local clusters, containers, a daemon started
by hand) a worker leads its own session, so nothing would stop it: it would train on,
unsupervised, holding its accelerator, while its node's lease expires and the job replaces its
rank. The kernel does the same job here: ``PR_SET_PDEATHSIG`` sends SIGKILL to the worker the
moment its parent exits, however it exits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from understudy.common import env

#: prctl(2) option: the signal this process gets when its parent exits.
PR_SET_PDEATHSIG = 1


class LifelineError(RuntimeError):
    """The worker cannot tie itself to its daemon."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tie_to_daemon() -> bool:
    """Have the kernel SIGKILL this process when its parent (the daemon, or a wrapper the job's
    command runs the worker through) exits. Returns False, doing nothing, outside a daemon (no
    ``UNDERSTUDY_DAEMON_PID``) or off Linux.

    Raises:
        LifelineError: the daemon is already gone (it died while this process started), or the
            kernel refused the request.
    """
    raw = os.environ.get(env.DAEMON_PID)
    if not raw or not sys.platform.startswith("linux"):
        return False
    try:
        daemon = int(raw)
    except ValueError as exc:
        raise LifelineError(f"{env.DAEMON_PID} is not a pid: {raw!r}") from exc
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise LifelineError(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    # The parent may have exited before the request: then no signal comes. The worker was
    # reparented (its parent is no longer the daemon), and the daemon is gone.
    if os.getppid() != daemon and not _alive(daemon):
        raise LifelineError(f"the daemon (pid {daemon}) that started this worker is gone")
    return True
