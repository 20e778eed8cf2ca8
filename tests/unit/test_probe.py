"""The daemons' direct probes over real UDP sockets on loopback: a closed probe port is found
at once, a silent one after the silence and the confirmation, a node that answers is never
condemned, and mass silence is left to the leases."""

from __future__ import annotations

import asyncio
import socket
import time

from understudy.common.config import ProbeConfig
from understudy.common.records import NodeRecord
from understudy.common.states import NodeState
from understudy.daemon.probe import Prober, ProbeResponder, parse_address

FAST = ProbeConfig(interval=0.02, silence=0.2, confirm=0.1)


def _record(name: str, probe: str, lease: int = 1) -> NodeRecord:
    return NodeRecord(name=name, incarnation=f"{name}-i", lease=lease, state=NodeState.ACTIVE,
                      role="active", slots=1, probe=probe)


class _Fleet:
    """Probe targets: responders that answer, and bound sockets that never do (a node whose
    packets are dropped)."""

    def __init__(self) -> None:
        self.records: dict[str, NodeRecord] = {}
        self.responders: dict[str, ProbeResponder] = {}
        self.mute: list[socket.socket] = []
        self.dead: dict[str, tuple[float, str]] = {}
        #: every report, in order: a node is reported once
        self.reports: list[str] = []

    async def answering(self, name: str) -> None:
        r = ProbeResponder(name, lambda: f"{name}-i")
        self.responders[name] = r
        self.records[name] = _record(name, await r.start("127.0.0.1"))

    def silent(self, name: str) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        self.mute.append(s)
        self.records[name] = _record(name, f"127.0.0.1:{s.getsockname()[1]}")

    async def on_dead(self, rec: NodeRecord, why: str) -> None:
        self.reports.append(rec.name)
        self.dead.setdefault(rec.name, (time.monotonic(), why))

    def close(self) -> None:
        for r in self.responders.values():
            r.close()
        for s in self.mute:
            s.close()


async def _probe(fleet: _Fleet, seconds: float, during=None) -> None:  # type: ignore[no-untyped-def]
    stop = asyncio.Event()
    prober = Prober(FAST, "ctl", lambda: fleet.records, fleet.on_dead)
    task = asyncio.create_task(prober.run(stop))
    if during is not None:
        await asyncio.sleep(0.2)
        await during()
    await asyncio.sleep(seconds)
    stop.set()
    await task


def test_a_closed_probe_port_is_found_at_once_and_answering_nodes_never() -> None:
    async def main() -> None:
        fleet = _Fleet()
        for n in ("a", "b", "c"):
            await fleet.answering(n)
        killed: list[float] = []

        async def kill_b() -> None:
            killed.append(time.monotonic())
            fleet.responders["b"].close()  # as its process dying closes it

        try:
            await _probe(fleet, 0.5, during=kill_b)
        finally:
            fleet.close()
        assert fleet.reports == ["b"]
        at, why = fleet.dead["b"]
        assert "refuses" in why
        # Refused on the next probe, and refused again: well inside the silence.
        assert at - killed[0] < FAST.silence
    asyncio.run(main())


class _CountingResponder(ProbeResponder):
    """A responder that notes when each ping reached it: the prober's rounds, seen from a
    node."""

    def __init__(self, node: str) -> None:
        super().__init__(node, lambda: f"{node}-i")
        self.pings: list[float] = []

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.pings.append(time.monotonic())
        super().datagram_received(data, addr)


async def _finish(stop: asyncio.Event, prober: asyncio.Task[None], fleet: _Fleet) -> None:
    """Stop the prober, wait for it, close the fleet's sockets."""
    stop.set()
    await prober
    fleet.close()


async def _witnessed_fleet() -> tuple[_Fleet, _CountingResponder]:
    """Three answering nodes, a (which notes each ping's arrival), b and c."""
    fleet = _Fleet()
    witness = _CountingResponder("a")
    fleet.responders["a"] = witness
    fleet.records["a"] = _record("a", await witness.start("127.0.0.1"))
    for n in ("b", "c"):
        await fleet.answering(n)
    return fleet, witness


def test_a_refusal_is_judged_when_it_arrives_not_at_the_next_round() -> None:
    """Rounds half a second apart: the node whose port closed is condemned between the round
    whose ping it refused and the next one (the refusal and the confirming refusal are acted
    on as they arrive, not at the next round nor at a fixed poll)."""
    async def main() -> None:
        fleet, witness = await _witnessed_fleet()
        slow = ProbeConfig(interval=0.5, silence=5.0, confirm=1.0)
        stop = asyncio.Event()
        task = asyncio.create_task(
            Prober(slow, "ctl", lambda: fleet.records, fleet.on_dead).run(stop))
        try:
            await asyncio.sleep(0.7)  # two rounds: everyone answered
            fleet.responders["b"].close()
            killed = time.monotonic()
            await asyncio.sleep(1.6)
        finally:
            await _finish(stop, task, fleet)
        assert fleet.reports == ["b"]
        at, why = fleet.dead["b"]
        assert "refuses" in why
        rounds = [t for t in witness.pings if killed < t < at]
        # Only the round that found the closed port came between: not a second one.
        assert len(rounds) == 1, (rounds, killed, at)
    asyncio.run(main())


def test_a_silent_node_is_condemned_after_the_silence_and_the_confirmation() -> None:
    async def main() -> None:
        fleet = _Fleet()
        for n in ("a", "b", "c"):
            await fleet.answering(n)
        fleet.silent("d")
        try:
            await _probe(fleet, 0.8)
        finally:
            fleet.close()
        assert fleet.reports == ["d"]
        assert "answered no probe" in fleet.dead["d"][1]
    asyncio.run(main())


def test_most_nodes_silent_at_once_is_left_to_the_leases() -> None:
    async def main() -> None:
        fleet = _Fleet()
        await fleet.answering("a")
        fleet.silent("b")
        fleet.silent("c")
        try:
            await _probe(fleet, 0.8)
        finally:
            fleet.close()
        assert fleet.reports == []
    asyncio.run(main())


def test_a_reply_must_come_from_the_node_itself() -> None:
    async def main() -> None:
        fleet = _Fleet()
        await fleet.answering("a")
        await fleet.answering("b")
        await fleet.answering("c")
        # c's port is answered by another node's responder (a port reused after a restart):
        # no answer of c's, so c is silent.
        impostor = ProbeResponder("x", lambda: "x-i")
        fleet.records["c"] = _record("c", await impostor.start("127.0.0.1"))
        try:
            await _probe(fleet, 0.8)
        finally:
            impostor.close()
            fleet.close()
        assert fleet.reports == ["c"]
    asyncio.run(main())


def test_garbage_probe_addresses_and_pings_are_ignored() -> None:
    assert parse_address("127.0.0.1:9") == ("127.0.0.1", 9)
    assert parse_address("[::1]:9") == ("::1", 9)
    for bad in ("", "host", "host:0", "host:70000", ":9", "h:x"):
        assert parse_address(bad) is None

    async def main() -> None:
        r = ProbeResponder("a", lambda: "a-i")
        host, port = parse_address(await r.start("127.0.0.1"))  # type: ignore[misc]
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(0.3)
        try:
            for junk in (b"", b"ping", b"pong x", b"ping " + b"x" * 100, b"ping a b"):
                s.sendto(junk, (host, port))
            s.sendto(b"ping tok", (host, port))
            await asyncio.sleep(0.05)
            assert s.recv(100) == b"pong tok a a-i"  # the one well-formed ping, answered
        finally:
            s.close()
            r.close()
    asyncio.run(main())


def test_more_nodes_than_the_ping_rate_allows_are_probed_less_often_and_judged_alike() -> None:
    """``probe.max_rate`` 10 pings/s over three nodes: a round every 0.3 s instead of 0.02 s,
    and the silence stretched alike (0.2 s to 3 s). Nodes that answer each round are never
    suspects although rounds are now longer than the configured silence, and a closed port is
    still found at the next round."""
    async def main() -> None:
        fleet, witness = await _witnessed_fleet()
        capped = ProbeConfig(interval=0.02, silence=0.2, confirm=0.1, max_rate=10.0)
        stop = asyncio.Event()
        prober = Prober(capped, "ctl", lambda: fleet.records, fleet.on_dead)
        task = asyncio.create_task(prober.run(stop))
        try:
            await asyncio.sleep(1.5)
            assert (prober.round_s, prober.silence) == (0.3, 3.0)
            assert fleet.reports == []
            # 1.5 s at one round per 0.3 s: 5 or 6 pings, not the 75 of the 0.02 s interval.
            assert 4 <= len(witness.pings) <= 7, witness.pings
            gaps = [b - a for a, b in zip(witness.pings, witness.pings[1:], strict=False)]
            assert min(gaps) > 0.2, gaps
            fleet.responders["b"].close()
            await asyncio.sleep(0.6)
        finally:
            await _finish(stop, task, fleet)
        assert fleet.reports == ["b"] and "refuses" in fleet.dead["b"][1]
    asyncio.run(main())


def test_with_no_job_running_nodes_are_probed_at_the_idle_pace_until_one_starts() -> None:
    """No job: a round every ``idle_interval`` (0.25 s), the silence stretched alike, and no
    node that answers is a suspect. A job starts: a round every ``interval`` again at once,
    the silence back to its own, and a port that closes is found within a round or two."""
    async def main() -> None:
        fleet, witness = await _witnessed_fleet()
        paced = ProbeConfig(interval=0.02, idle_interval=0.25, silence=0.2, confirm=0.1)
        busy = False
        stop = asyncio.Event()
        prober = Prober(paced, "ctl", lambda: fleet.records, fleet.on_dead, busy=lambda: busy)
        task = asyncio.create_task(prober.run(stop))
        try:
            await asyncio.sleep(1.0)
            assert (prober.round_s, prober.silence) == (0.25, 2.5)
            idle_pings = len(witness.pings)
            assert 3 <= idle_pings <= 6, witness.pings  # not the 50 of the busy pace
            busy = True
            await asyncio.sleep(0.5)
            assert (prober.round_s, prober.silence) == (0.02, 0.2)
            assert len(witness.pings) - idle_pings >= 10
            assert fleet.reports == []
            fleet.responders["b"].close()
            closed = time.monotonic()
            await asyncio.sleep(0.4)
        finally:
            await _finish(stop, task, fleet)
        assert fleet.reports == ["b"] and "refuses" in fleet.dead["b"][1]
        assert fleet.dead["b"][0] - closed < 0.2
    asyncio.run(main())
