"""A dependency-free client for systemd's notification protocol (``sd_notify(3)``).

understudyd runs as ``Type=notify``: systemd considers it started only after ``READY=1``, kills
and restarts it when ``WATCHDOG=1`` stops arriving, and lets a drain on stop run past
``TimeoutStopSec=`` when the daemon asks with ``EXTEND_TIMEOUT_USEC=``.

Every send is one non-blocking datagram on a fresh socket that is closed at once: notifying can
never stall the event loop, and no descriptor outlives the call. Without ``$NOTIFY_SOCKET`` (not
run by systemd, or run by a systemd without notify support) every method returns False and does
nothing; a failed send also returns False and never raises, because systemd being unreachable must
not take the node's daemon down with it.

Children must not inherit :data:`SYSTEMD_ENV`: with ``NotifyAccess=main`` systemd ignores their
messages anyway, and a worker that believed it owned the watchdog would be wrong.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from understudy.common import env

#: Variables systemd sets for the main process only; strip them from a child's environment.
SYSTEMD_ENV = (env.NOTIFY_SOCKET, env.WATCHDOG_USEC, env.WATCHDOG_PID)

#: A send that cannot complete at once is dropped; this bounds the rare case where the kernel
#: still blocks (it should not with MSG_DONTWAIT on a datagram socket).
SEND_TIMEOUT_S = 0.1


@dataclass(frozen=True)
class Notifier:
    """Sends state changes to systemd. Build it with :meth:`from_env`.

    ``address`` is what ``socket.sendto`` takes: a filesystem path, or ``"\\0name"`` for an
    abstract socket (``@name`` in ``$NOTIFY_SOCKET``); None disables notification.
    """

    address: str | None = None
    watchdog_usec: int | None = None
    #: The PID the watchdog is meant for (``$WATCHDOG_PID``); None means "the main process".
    watchdog_pid: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """Read ``$NOTIFY_SOCKET``, ``$WATCHDOG_USEC`` and ``$WATCHDOG_PID``.

        Values systemd would never set (an address that is neither absolute nor abstract, such as
        ``vsock:``; a non-numeric or zero watchdog) disable the feature instead of raising: a
        daemon must start even when its supervisor's environment is odd.
        """
        raw = environ.get(env.NOTIFY_SOCKET, "")
        address: str | None = None
        if raw.startswith("/"):
            address = raw
        elif raw.startswith("@") and len(raw) > 1:
            address = "\0" + raw[1:]
        return cls(
            address=address,
            watchdog_usec=_positive_int(environ.get(env.WATCHDOG_USEC)),
            watchdog_pid=_positive_int(environ.get(env.WATCHDOG_PID)),
        )

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between :meth:`watchdog` calls (half of ``WatchdogSec=``), or None.

        None when systemd set no watchdog, or set it for another process (``$WATCHDOG_PID`` is
        not this process: the variables were inherited, not meant for us).
        """
        if self.watchdog_usec is None:
            return None
        if self.watchdog_pid is not None and self.watchdog_pid != os.getpid():
            return None
        return self.watchdog_usec / 2_000_000

    def ready(self, status: str = "") -> bool:
        """Tell systemd start-up is complete (``READY=1``), with an optional status line."""
        return self._send("READY=1", *_status_field(status))

    def stopping(self, status: str = "") -> bool:
        """Tell systemd an orderly shutdown (a drain) has begun (``STOPPING=1``)."""
        return self._send("STOPPING=1", *_status_field(status))

    def status(self, text: str) -> bool:
        """Set the one-line status ``systemctl status`` shows; an empty text clears it."""
        return self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """Ping the watchdog (``WATCHDOG=1``): the event loop is alive."""
        return self._send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for ``seconds`` more before it gives up on the current start or stop.

        Send it again before it runs out to keep extending (a drain that is still making
        progress). Raises ValueError for a non-positive or non-finite ``seconds``.
        """
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"extend_timeout needs a positive number of seconds, got {seconds!r}")
        return self._send(f"EXTEND_TIMEOUT_USEC={math.ceil(seconds * 1_000_000)}")

    def _send(self, *fields: str) -> bool:
        if self.address is None or not fields:
            return False
        message = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sent = sock.sendto(message, socket.MSG_DONTWAIT, self.address)
        except (OSError, ValueError):
            # OSError: no listener, queue full (EAGAIN), permission, path too long.
            # ValueError (UnicodeEncodeError): an address the file system encoding cannot hold.
            return False
        return sent == len(message)


def _one_line(text: str) -> str:
    # The protocol is line-based: a newline in the text would start a bogus assignment.
    return " ".join(text.splitlines()).strip()


def _status_field(text: str) -> tuple[str, ...]:
    text = _one_line(text)
    return (f"STATUS={text}",) if text else ()


def _positive_int(value: str | None) -> int | None:
    if value is None or not value.strip().isascii() or not value.strip().isdigit():
        return None
    number = int(value)
    return number if number > 0 else None
