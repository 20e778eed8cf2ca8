"""A test host in its own network namespace, joined to the root namespace by a veth pair,
and a real partition of it with nftables drop rules (packets vanish: no reset, no ICMP)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass


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


@dataclass
class TestHost:
    """Namespace ``name`` with address ``ns_ip``; the root side of the link has ``host_ip``."""

    name: str
    host_ip: str
    ns_ip: str
    table: str

    @classmethod
    def create(cls, index: int = 1) -> TestHost:
        tag = uuid.uuid4().hex[:6]
        # A /30 of our own, on a link that exists only between our two namespaces.
        net = f"10.213.{index}."
        host = cls(name=f"ustest-{tag}", host_ip=net + "1", ns_ip=net + "2",
                   table=f"ustest_{tag}")
        veth_host, veth_ns = f"uh{tag}", f"un{tag}"
        _run("ip", "netns", "add", host.name)
        try:
            _run("ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
            _run("ip", "link", "set", veth_ns, "netns", host.name)
            _run("ip", "addr", "add", f"{host.host_ip}/30", "dev", veth_host)
            _run("ip", "link", "set", veth_host, "up")
            _run("ip", "netns", "exec", host.name, "ip", "addr", "add", f"{host.ns_ip}/30",
                 "dev", veth_ns)
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
        self.table = f"ustest_cut_{uuid.uuid4().hex[:6]}"
        _drop(self.table, f"ip saddr {self.ip} {self.proto} sport {self.port}",
              f"ip daddr {self.ip} {self.proto} dport {self.port}")

    def heal(self) -> None:
        if self.table:
            with contextlib.suppress(subprocess.CalledProcessError):
                _run("nft", "delete", "table", "inet", self.table)
            self.table = ""
