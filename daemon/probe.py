"""Direct liveness probes between daemons: a node that died or went silent is found in well
under a second, not after its lease's TTL.

Every daemon answers probes on a UDP port it advertises in its node record (``probe``,
``HOST:PORT``): ``ping <token>`` is answered ``pong <token> <node> <incarnation>``. The
controller (:class:`Prober`) pings every other node each ``probe.interval`` seconds over a
connected socket per node, so a dead daemon's port answers with an ICMP "port unreachable"
(the socket reports ``ECONNREFUSED``) within one round trip, and a node whose packets are
dropped (power loss, a dead switch port) simply stops answering.

A node is suspected when its port refuses (judged the moment the refusal arrives, not at the
next round), or when nothing came back from it for ``probe.silence`` seconds. The controller
then confirms with more pings: an answer clears the suspect; a second refusal condemns it as
soon as it arrives, and so does silence through ``probe.confirm`` seconds. A condemned node is
reported to ``on_dead``, which revokes the node's lease (``controller.py``). etcd stays the
authority: a node that was only cut off finds its lease revoked when it reaches etcd again and
fences itself, exactly as after an expired lease, so a wrong verdict costs a migration, never a
split brain.

While no job is pending or running, the controller probes each ``probe.idle_interval``
(1 s) instead: a loss found later costs no job anything, and the controller wakes ten times
less. The silence is stretched alike, and when the pace quickens every node's silence starts
over (it was pinged at the slower pace until then).

The controller also sends at most ``probe.max_rate`` pings a second: with more nodes than
``max_rate * interval``, a round takes ``nodes / max_rate`` seconds and the silence that makes
a suspect is stretched by the same factor (rounds further apart must not read as silence). Its
CPU then stays bounded however large the cluster; detection there slows toward the lease TTL.

Two guards keep a busy or cut-off controller from condemning healthy nodes:

- **Its own stalls do not count.** A probe round that starts late (the controller's event
  loop was starved) restarts every node's silence: nobody could have been heard meanwhile.
- **Mass silence is not evidence.** When more than half of the probed nodes (two at least)
  are suspects at once, the likelier cause is the controller's own network: it does nothing
  and leaves those nodes to their leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping

from understudy.common import logs
from understudy.common.config import ProbeConfig
from understudy.common.records import NodeRecord


class ProbeResponder(asyncio.DatagramProtocol):
    """The daemon's side: answers every well-formed ping, ignores anything else."""

    def __init__(self, node: str, incarnation: Callable[[], str]) -> None:
        self.node, self.incarnation = node, incarnation
        self.transport: asyncio.DatagramTransport | None = None
        self.address = ""

    async def start(self, host: str, port: int = 0) -> str:
        """Bind ``host:port`` (0: any free port); returns the ``HOST:PORT`` to advertise."""
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: self,
                                                           local_addr=(host, port))
        self.transport = transport
        bound = transport.get_extra_info("sockname")
        self.address = f"{bound[0]}:{bound[1]}"
        return self.address

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        parts = data.split(b" ")
        if len(parts) != 2 or parts[0] != b"ping" or len(parts[1]) > 64 or \
                self.transport is None:
            return
        reply = b"pong " + parts[1] + f" {self.node} {self.incarnation()}".encode()
        with contextlib.suppress(OSError):
            self.transport.sendto(reply, addr)


class _Peer(asyncio.DatagramProtocol):
    """The controller's connected socket to one node's probe port."""

    def __init__(self, record: NodeRecord, now: float,
                 on_refused: Callable[[], None] = lambda: None) -> None:
        self.record = record
        self.on_refused = on_refused
        self.transport: asyncio.DatagramTransport | None = None
        self.token = secrets.token_hex(8).encode()
        #: monotonic times: the last answer, the last refusal (0: none since the start)
        self.heard = now
        self.refused = 0.0
        #: set at each answer or refusal: a confirmation waits on it instead of polling
        self.news = asyncio.Event()
        #: set while the suspicion is being confirmed, and once it was (reported once)
        self.confirming = False
        self.condemned = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        parts = data.split(b" ")
        # Only the node itself: a port reused by another process is no answer.
        if len(parts) == 4 and parts[0] == b"pong" and parts[1] == self.token and \
                parts[2] == self.record.name.encode() and \
                parts[3] == self.record.incarnation.encode():
            self.heard = time.monotonic()
            self.news.set()

    def error_received(self, exc: Exception) -> None:
        if isinstance(exc, ConnectionRefusedError):
            self.refused = time.monotonic()
            self.news.set()
            self.on_refused()

    def ping(self) -> None:
        if self.transport is not None:
            with contextlib.suppress(OSError):
                self.transport.sendto(b"ping " + self.token)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def parse_address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` from a node record, or None if it is not one (records are untrusted)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


OnDead = Callable[[NodeRecord, str], Awaitable[None]]


class Prober:
    """The controller's side: pings the nodes ``targets()`` returns and reports to ``on_dead``
    each one that refuses or stays silent through a confirmation (see the module docstring)."""

    def __init__(self, settings: ProbeConfig, me: str,
                 targets: Callable[[], Mapping[str, NodeRecord]], on_dead: OnDead,
                 busy: Callable[[], bool] = lambda: True) -> None:
        self.settings, self.me, self.targets, self.on_dead = settings, me, targets, on_dead
        #: whether a job is pending or running (else the idle pace)
        self.busy = busy
        self.log = logs.get(node=me)
        self._peers: dict[str, _Peer] = {}
        self._confirms: set[asyncio.Task[None]] = set()
        self._mass_warned = False
        self._stopped = False
        #: seconds between two rounds, and the silence that makes a suspect: the settings'
        #: own, stretched at the idle pace and while the nodes outnumber ``max_rate *
        #: interval`` (:meth:`_pace`)
        self.round_s, self.silence = settings.interval, settings.silence

    async def run(self, stop: asyncio.Event) -> None:
        expected = time.monotonic()
        # One waiter for the whole run: a round's wait is a timer on it, no task of its own.
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now - expected > max(0.25, self.silence / 2):
                    # This loop was starved: nobody could be heard meanwhile.
                    for p in self._peers.values():
                        p.heard = max(p.heard, now)
                await self._sync(now)
                self._pace(now)
                expected = now + self.round_s
                for p in self._peers.values():
                    p.ping()
                self._judge(time.monotonic())
                await asyncio.wait({stopped}, timeout=max(0.0, expected - time.monotonic()))
        finally:
            stopped.cancel()
            self._stopped = True
            for t in self._confirms:
                t.cancel()
            for p in self._peers.values():
                p.close()
            self._peers.clear()

    async def _sync(self, now: float) -> None:
        """One peer per node record that advertises a probe port; a new incarnation (a new
        lease) gets a fresh peer, with a fresh silence."""
        want = {name: rec for name, rec in self.targets().items()
                if name != self.me and parse_address(rec.probe) is not None}
        for name in list(self._peers):
            p = self._peers[name]
            rec = want.get(name)
            if rec is None or rec.lease != p.record.lease or rec.probe != p.record.probe:
                p.close()
                del self._peers[name]
            else:
                p.record = rec  # the same incarnation; its state may have changed
        loop = asyncio.get_running_loop()
        for name, rec in want.items():
            if name in self._peers:
                continue
            address = parse_address(rec.probe)
            assert address is not None
            peer = _Peer(rec, now, on_refused=self._refused)
            try:
                await loop.create_datagram_endpoint(lambda p=peer: p,  # type: ignore[misc]
                                                    remote_addr=address)
            except OSError as exc:
                self.log.debug("Cannot probe a node.", peer=name, address=rec.probe,
                               error=str(exc))
                continue
            self._peers[name] = peer

    def last_heard(self) -> dict[str, float]:
        """When each probed node last answered (monotonic seconds; its start if never)."""
        return {name: p.heard for name, p in self._peers.items()}

    def _pace(self, now: float) -> None:
        """This round's length and silence: ``interval`` (``idle_interval`` while no job is
        pending or running), and no more than ``max_rate`` pings a second (past ``max_rate *
        interval`` nodes, one ping per node in ``nodes / max_rate`` seconds); the silence
        stretched alike. A quicker pace starts every node's silence over. Logged when it
        changes."""
        s = self.settings
        busy = self.busy()
        round_s = max(s.interval if busy else s.idle_interval, len(self._peers) / s.max_rate)
        if round_s == self.round_s:
            return
        if round_s < self.round_s:
            for p in self._peers.values():  # pinged at the slower pace until now
                p.heard = max(p.heard, now)
        self.round_s, self.silence = round_s, s.silence * round_s / s.interval
        self.log.info(f"Probing {len(self._peers)} nodes every {round_s:.3g} s, a node silent "
                      f"for {self.silence:.3g} s a suspect "
                      f"({'a job is running' if busy else 'no job is running'}; at most "
                      f"{s.max_rate:g} pings/s).", nodes=len(self._peers))

    def _refused(self) -> None:
        """A port refused a ping: judge now, not a round later (a dead daemon is found within
        one probe interval and a round trip, rather than up to two intervals)."""
        if not self._stopped:
            self._judge(time.monotonic())

    def _suspects(self, now: float) -> dict[str, str]:
        out = {}
        for name, p in self._peers.items():
            if p.refused > p.heard:
                out[name] = "its daemon's probe port refuses (the daemon is gone)"
            elif now - p.heard > self.silence:
                out[name] = f"it answered no probe for {now - p.heard:.2f} s"
        return out

    def _judge(self, now: float) -> None:
        suspects = self._suspects(now)
        if len(suspects) >= 2 and len(suspects) * 2 > len(self._peers):
            if not self._mass_warned:
                self._mass_warned = True
                self.log.warning(f"{len(suspects)} of {len(self._peers)} nodes answer no "
                                 "probe at once: more likely this controller's network than "
                                 "theirs; leaving them to their leases.",
                                 nodes=sorted(suspects))
            return
        self._mass_warned = False
        for name, why in suspects.items():
            p = self._peers[name]
            if not p.confirming and not p.condemned:
                p.confirming = True
                task = asyncio.create_task(self._confirm(p, why), name=f"probe-{name}")
                self._confirms.add(task)
                task.add_done_callback(self._confirms.discard)

    async def _confirm(self, p: _Peer, why: str) -> None:
        """A few more pings: an answer clears the suspect; a refusal condemns it as soon as it
        arrives, and silence until ``probe.confirm`` has passed."""
        start = time.monotonic()
        refused_before = p.refused
        deadline = start + self.settings.confirm
        try:
            while (left := deadline - time.monotonic()) > 0:
                p.news.clear()
                p.ping()
                # Woken by the answer or the refusal; else pinged again (a datagram may be lost).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(p.news.wait(),
                                           min(left, 0.05, self.settings.confirm / 4))
                if p.heard >= start:
                    self.log.info(f"Node {p.record.name} answered its probe again.",
                                  peer=p.record.name, suspected=why)
                    return
                if p.refused > refused_before and p.refused > start:
                    break  # refused again: the port is closed, nothing is listening
            if self._peers.get(p.record.name) is not p:
                return  # its record changed or went meanwhile
            p.condemned = True  # once: its lease is revoked, or else left to expire
            await self.on_dead(p.record, why)
        finally:
            p.confirming = False
