"""A test host in its own network namespace, joined to the root namespace by a veth pair,
and a real partition of it with nftables drop rules (packets vanish: no reset, no ICMP)."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def available() -> str | None:
    """None if namespaces can be used here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def _drop(table: str, incoming: str, outgoing: str) -> None:
    """An nftables table of its own that silently drops packets matching ``incoming`` (input
    hook) and ``outgoing`` (output hook): no reset, no ICMP."""
    rules = (
        f"add table inet {table}\n"
        f"add chain inet {table} in {{ type filter hook input priority -10; }}\n"
        f"add chain inet {table} out {{ type filter hook output priority -10; }}\n"
        f"add rule inet {table} in {incoming} drop\n"
        f"add rule inet {table} out {outgoing} drop\n"
    )
    subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True, capture_output=True,
                   timeout=10)


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=10)


#: Test hosts take their /30 links from this block.
_TEST_NETS = ipaddress.IPv4Network("10.213.0.0/16")


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Held while a test host picks its /30 and assigns it (one machine-wide lock)."""
    with open(Path(tempfile.gettempdir()) / "understudy-netns.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _free_slash30() -> ipaddress.IPv4Address:
    """The network address of the first /30 of ``_TEST_NETS`` that no interface is in."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], check=True, capture_output=True,
                         text=True, timeout=10).stdout
    used = {ipaddress.ip_interface(word).network.network_address
            for line in out.splitlines() for word in line.split()
            if "/" in word and word[0].isdigit()}
    for net in _TEST_NETS.subnets(new_prefix=30):
        if net.network_address not in used:
            return net.network_address
    raise RuntimeError(f"every /30 of {_TEST_NETS} is in use")


@dataclass
class TestHost:
    """Namespace ``name`` with address ``ns_ip``; the root side of the link has ``host_ip``."""

    name: str
    host_ip: str
    ns_ip: str
    table: str

    @classmethod
    def create(cls) -> TestHost:
        # The pid in every name: concurrent test workers and sessions never pick the same one,
        # and a leftover names the process that made it.
        tag = f"{os.getpid():x}{uuid.uuid4().hex[:4]}"
        veth_host, veth_ns = f"uh{tag}", f"un{tag}"  # at most 12 of IFNAMSIZ's 15 characters
        with _subnet_lock():
            # A /30 of our own (no interface has an address in it yet), on a link that exists
            # only between our two namespaces; the lock holds until the address is ours.
            net = _free_slash30()
            host = cls(name=f"ustest-{tag}", host_ip=str(net + 1), ns_ip=str(net + 2),
                       table=f"ustest_{tag}")
            _run("ip", "netns", "add", host.name)
            try:
                _run("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
                _run("ip", "link", "set", veth_ns, "netns", host.name)
                _run("ip", "addr", "add", f"{host.host_ip}/30", "dev", veth_host)
                _run("ip", "link", "set", veth_host, "up")
                _run("ip", "netns", "exec", host.name, "ip", "addr", "add",
                     f"{host.ns_ip}/30", "dev", veth_ns)
                _run("ip", "netns", "exec", host.name, "ip", "link", "set", veth_ns, "up")
                _run("ip", "netns", "exec", host.name, "ip", "link", "set", "lo", "up")
            except subprocess.CalledProcessError:
                host.destroy()
                raise
        host._veth = veth_host  # type: ignore[attr-defined]
        return host

    def wrap(self) -> list[str]:
        """Prefix for a command that must run inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def partition(self) -> None:
        """Silently drop everything between the namespace and the root namespace."""
        _drop(self.table, f"ip saddr {self.ns_ip}", f"ip daddr {self.ns_ip}")

    def heal(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("nft", "delete", "table", "inet", self.table)

    def destroy(self) -> None:
        self.heal()
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "netns", "pids", self.name)
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True,
                             text=True, timeout=10)
        for pid in out.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        veth = getattr(self, "_veth", None)
        if veth:
            with contextlib.suppress(subprocess.CalledProcessError):
                _run("ip", "link", "del", veth)
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "netns", "del", self.name)


@dataclass
class AddressCut:
    """A real partition of one TCP service address (``ip:port``) from every local client that
    dials it at that address: nftables drops the packets both ways, no reset, no ICMP. Clients
    that reach the same server at another address (127.0.0.1 for 127.0.0.2) are not touched,
    so one daemon can be cut off from etcd while its peers and the rest of the cluster are not."""

    ip: str
    port: int
    table: str = ""
    #: "tcp", or "udp" (a daemon's probe port)
    proto: str = "tcp"

    def cut(self) -> None:
        # The pid in the name: tables of concurrent test workers never clash.
        self.table = f"ustest_cut_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        _drop(self.table, f"ip saddr {self.ip} {self.proto} sport {self.port}",
              f"ip daddr {self.ip} {self.proto} dport {self.port}")

    def heal(self) -> None:
        if self.table:
            with contextlib.suppress(subprocess.CalledProcessError):
                _run("nft", "delete", "table", "inet", self.table)
            self.table = ""
