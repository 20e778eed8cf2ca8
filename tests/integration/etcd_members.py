"""A real etcd cluster of several members (three by default) on loopback, for fault tests that
kill one member.

Every member needs the whole ``--initial-cluster`` before it starts, so all peer ports are picked
first (``free_port``: ports no other test worker is given), then every member is launched, then
each is waited for: a member is healthy only once a quorum runs and a leader is elected.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from understudy.testing.embedded_etcd import EmbeddedEtcd, EtcdStartError, free_port

# Raft timings with slack: a loaded 2-core machine must not miss heartbeats for a whole election
# timeout (a spurious election would be a fault the test did not inject), yet a lost leader is
# replaced within about a second.
HEARTBEAT_MS = 50
ELECTION_MS = 500


@dataclass
class EtcdMembers:
    """``size`` etcd members forming one cluster, under ``base`` (one data directory and log
    each: ``base/m0/etcd.log``...)."""

    base: Path
    size: int = 3
    host: str = "127.0.0.1"
    members: list[EmbeddedEtcd] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        """Every member's client endpoint, as the daemon's and the CLI's ``--etcd`` take them."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 30.0) -> EtcdMembers:
        """Start every member and wait until each is healthy. A picked port taken by another
        process before etcd binds it makes a member exit with "address already in use": the
        cluster is then started again from scratch on fresh picks (3 tries)."""
        for attempt in range(3):
            self._launch_all()
            try:
                for m in self.members:
                    m.wait_healthy(timeout)
                return self
            except EtcdStartError as exc:
                self.cleanup()
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
                # Each member's data records the peer URLs it was started with.
                for m in self.members:
                    assert m.data_dir is not None
                    shutil.rmtree(m.data_dir / "member-data", ignore_errors=True)
        raise AssertionError("unreachable")

    def _launch_all(self) -> None:
        ports: list[int] = []
        while len(ports) < 3 * self.size:
            if (port := free_port(self.host)) not in ports:
                ports.append(port)
        self.members = [
            EmbeddedEtcd(data_dir=self.base / f"m{i}", name=f"m{i}", host=self.host,
                         client_port=ports[3 * i], peer_port=ports[3 * i + 1],
                         metrics_port=ports[3 * i + 2], heartbeat_ms=HEARTBEAT_MS,
                         election_ms=ELECTION_MS)
            for i in range(self.size)
        ]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster
            m.launch()

    def running(self) -> list[EmbeddedEtcd]:
        return [m for m in self.members if m.proc is not None and m.proc.poll() is None]

    def status(self, member: EmbeddedEtcd) -> dict | None:
        """The member's ``Maintenance.Status`` (through etcd's JSON gateway), None if it does
        not answer. Ids are decimal strings: ``header.member_id``, ``leader``, ``raftTerm``."""
        req = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status",
                                     data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=1.0) as resp:
                status: dict = json.loads(resp.read())
                return status
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def leader(self) -> EmbeddedEtcd | None:
        """The member that leads, if every running member that answers agrees on it and it is
        one of them (followers name a dead leader until they elect another); else None."""
        ids: dict[str, EmbeddedEtcd] = {}
        leaders = set()
        for m in self.running():
            st = self.status(m)
            if st is None:
                return None
            ids[str(st["header"]["member_id"])] = m
            leaders.add(str(st.get("leader", "0")))
        if len(leaders) != 1:
            return None
        return ids.get(leaders.pop())

    def wait_leader(self, timeout: float = 15.0, other_than: EmbeddedEtcd | None = None
                    ) -> EmbeddedEtcd:
        """Wait until the running members agree on a leader (not ``other_than``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None and leader is not other_than:
                return leader
            time.sleep(0.05)
        raise AssertionError(f"no etcd leader (other than {other_than and other_than.name}) "
                             f"within {timeout}s among {[m.name for m in self.running()]}")

    def make_leader(self, member: EmbeddedEtcd, timeout: float = 15.0) -> None:
        """Hand the leadership to ``member`` (etcd's ``MoveLeader``, sent to the leader)."""
        target = self.status(member)
        assert target is not None, f"etcd member {member.name} does not answer"
        deadline = time.monotonic() + timeout
        while (leader := self.wait_leader(timeout)) is not member:
            assert time.monotonic() < deadline, f"{member.name} never became the etcd leader"
            body = json.dumps({"targetID": target["header"]["member_id"]}).encode()
            req = urllib.request.Request(
                f"http://{leader.endpoint}/v3/maintenance/transfer-leadership", data=body,
                method="POST")
            with contextlib.suppress(OSError, urllib.error.URLError):
                urllib.request.urlopen(req, timeout=5.0).close()

    def kill(self, member: EmbeddedEtcd) -> None:
        """SIGKILL one member (its data stays for ``restart``)."""
        member.stop()

    def restart(self, member: EmbeddedEtcd, timeout: float = 30.0) -> None:
        """Start a killed member again on its ports and data: it rejoins the cluster."""
        member.restart(timeout)

    def cleanup(self) -> None:
        """Kill every member and free its data (128 MiB of preallocated log each); the logs
        stay under ``base`` (the caller's)."""
        for m in self.members:
            m.cleanup()

    def __enter__(self) -> EtcdMembers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
