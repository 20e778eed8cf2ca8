"""The address this node's workers bind to, for other nodes to reach them: their process
groups' gloo devices, the transfers over them, and a standby's snapshot holder. The daemon
passes it as ``UNDERSTUDY_NODE_ADDRESS``.

The first of the node's ``addresses``, when configured. Else the workers are left to gloo's own
choice, the address the host name resolves to, except where that is a loopback address (a stock
Debian ``/etc/hosts`` maps the host name to 127.0.1.1) while etcd is reached over a network:
no other node could reach a worker there, so the address the route to etcd leaves from is
taken instead, and the daemon says so.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Callable, Sequence

from understudy.common.errors import ConfigError


def resolve_host_name() -> str | None:
    """What this host's name resolves to (gloo's default address), None if nothing."""
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return None


def route_source(host: str, port: int) -> str | None:
    """The local address a datagram to ``host:port`` would leave from (no packet is sent),
    None without a route."""
    with contextlib.suppress(OSError):
        for family, kind, proto, _, target in socket.getaddrinfo(host, port,
                                                                 type=socket.SOCK_DGRAM):
            with socket.socket(family, kind, proto) as s:
                s.connect(target)
                return str(s.getsockname()[0])
    return None


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def worker_address(addresses: Sequence[str], etcd: Sequence[tuple[str, int]], *,
                   resolve: Callable[[], str | None] = resolve_host_name,
                   route: Callable[[str, int], str | None] = route_source
                   ) -> tuple[str | None, str]:
    """The address for ``UNDERSTUDY_NODE_ADDRESS`` (None: leave it to gloo) and, when it was
    not configured, why it was chosen (empty otherwise)."""
    if addresses:
        return addresses[0], ""
    resolved = resolve()
    if resolved is not None and not _loopback(resolved):
        return None, ""
    for host, port in etcd:
        source = route(host, port)
        if source is not None and not _loopback(source):
            return source, (f"the host name resolves to {resolved or 'nothing'}, which no "
                            f"other node can reach: the workers bind {source}, where the route "
                            f"to etcd at {host}:{port} leaves from (set `addresses` to choose)")
    return None, ""


def check_local(address: str) -> None:
    """Raises ConfigError unless ``address`` is one of this host's (something can bind it)."""
    try:
        infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"addresses: {address!r} does not resolve: {exc.strerror}") from exc
    family, kind, proto, _, target = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.bind(target)
    except OSError as exc:
        raise ConfigError(f"addresses: {address!r} is not an address of this host (cannot "
                          f"bind it: {exc.strerror})") from exc
