"""Who may use the daemon's local socket: its own workers, and members of one configured group.

The socket serves a job's key-value store, its view and its migration reports
(``daemon/localsock.py``). So the daemon asks the kernel who is
at the other end of each connection, as it connects, and admits:

- the daemon itself, and every process descended from it: the workers the supervisor starts and
  their own children (data loaders, compile workers), which inherit ``$UNDERSTUDY_SOCKET``;
- a process whose effective group, or one of whose supplementary groups, is the configured
  ``socket_group`` (a monitoring agent, a job started through a container runtime).

A worker, and every process below it, acts for its own job only: the daemon maps the
connection to the child it descends from, and refuses a namespace of another job
(``daemon/localsock.py``; review H3). A member of the socket group is bound to no job.

Nothing else: not root, not the daemon's own user. A refused connection is answered with one
error line and closed; the daemon logs one warning per refused process. The credentials are
the kernel's (``SO_PEERCRED``: pid, uid, gid at ``connect``; ``SO_PEERGROUPS``: supplementary
groups), so the socket file's mode is only a first gate, and the check holds for root, which
passes any mode. Ancestry is read from ``/proc`` when the connection is accepted: a process
orphaned by its worker's death is re-parented and no longer admitted.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import psutil

from understudy.common import logs

#: ``SO_PEERGROUPS`` (Linux 4.13), which Python's socket module does not name
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_CRED = struct.Struct("3i")
#: Python's getsockopt returns at most this many bytes: 256 groups
_GROUPS_BYTES = 1024
#: refused pids remembered for "one warning per process"; forgotten all at once past this
_MAX_REMEMBERED = 4096


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel saw it at ``connect``."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]

    def __str__(self) -> str:
        return f"process {self.pid} (uid {self.uid}, gid {self.gid})"


def refusal(peer: Peer, ancestors: tuple[int, ...], daemon_pid: int,
            group: int | None) -> str | None:
    """Why ``peer`` may not use the socket, or None if it may. ``ancestors``: its parent, its
    parent's parent... as far as they could be read."""
    if peer.pid == daemon_pid or daemon_pid in ancestors:
        return None
    if group is not None and (peer.gid == group or group in peer.groups):
        return None
    admits = f"members of group {group}" if group is not None else "no other process " \
        "(socket_group is not set)"
    return (f"{peer} is not a worker of this daemon (pid {daemon_pid}); besides its workers it "
            f"admits {admits}")


def worker_of(peer: Peer, ancestors: tuple[int, ...], daemon_pid: int) -> int | None:
    """The daemon's child that ``peer`` is, or descends from (a worker, for its data loaders
    and other children): the pid whose parent is the daemon. None for the daemon itself and
    for a process that does not descend from it (a member of the socket group)."""
    chain = (peer.pid, *ancestors)
    for pid, parent in itertools.pairwise(chain):
        if parent == daemon_pid:
            return pid
    return None


def read_peer(sock: Any) -> Peer:
    """The credentials of the process connected to the Unix socket ``sock``.

    Raises:
        OSError: the kernel would not say (not a Unix socket).
    """
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _CRED.size))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BYTES)
        groups = struct.unpack(f"{len(raw) // 4}I", raw)
    except OSError:  # more groups than fit, or an old kernel: ask /proc instead
        groups = _proc_groups(pid)
    return Peer(pid, uid, gid, tuple(groups))


def ancestors(pid: int) -> tuple[int, ...]:
    """``pid``'s parent, grandparent... up to pid 1; empty if ``pid`` is gone."""
    try:
        return tuple(p.pid for p in psutil.Process(pid).parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ()


def _proc_groups(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


class PeerGate:
    """Decides, for each accepted connection, whether its process may use the socket; logs one
    warning per refused process."""

    def __init__(self, group: int | None = None, log: Any = None) -> None:
        self.group = group
        self.daemon_pid = os.getpid()
        self.log = log if log is not None else logs.get()
        self._warned: set[int] = set()

    def check(self, sock: Any) -> str | None:
        """Why the process at the other end of ``sock`` is refused, or None."""
        return self.admit(sock)[0]

    def admit(self, sock: Any) -> tuple[str | None, int | None]:
        """Why the process at the other end of ``sock`` is refused (or None), and the daemon's
        child it is or descends from (:func:`worker_of`)."""
        try:
            peer = read_peer(sock)
        except OSError as exc:
            return f"the daemon cannot tell who connected: {exc.strerror}", None
        chain = ancestors(peer.pid)
        why = refusal(peer, chain, self.daemon_pid, self.group)
        if why is not None and peer.pid not in self._warned:
            if len(self._warned) >= _MAX_REMEMBERED:
                self._warned.clear()
            self._warned.add(peer.pid)
            self.log.warning("Refused a connection to the workers' socket.", pid=peer.pid,
                             uid=peer.uid, gid=peer.gid, reason=why)
        return why, (worker_of(peer, chain, self.daemon_pid) if why is None else None)
