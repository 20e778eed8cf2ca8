"""Preemption notices: pure parsers, pollers against real local fake metadata servers, watcher.

The fake servers speak each provider's documented format on 127.0.0.1 and enforce its headers,
so a poller that forgets the IMDSv2 token or a Metadata header fails here as it would in a cloud.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import random
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest

from tests.cloud_metadata import (
    SPOT,
    AwsHandler,
    AwsState,
    AzureHandler,
    AzureState,
    GceHandler,
    GceState,
    Handler,
    serve,
)
from understudy.common.config import NoticesConfig
from understudy.common.errors import StoreError, UnderstudyError
from understudy.daemon.notices import (
    AWS_TOKEN_TTL,
    AwsPoller,
    AzurePoller,
    GcePoller,
    Notice,
    NoticeError,
    NoticeFormatError,
    NoticeWatcher,
    parse_aws_rebalance,
    parse_aws_spot_action,
    parse_azure_events,
    parse_gce_maintenance,
    parse_gce_preempted,
    pollers_from_config,
)
from understudy.testing.embedded_etcd import free_port

pytestmark = pytest.mark.timeout(10)

AZURE_WHEN = "Mon, 19 Sep 2016 18:29:47 GMT"
AZURE_DEADLINE = datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC).timestamp()


T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------
# Fake metadata servers


@pytest.fixture
def aws() -> Iterator[tuple[str, AwsState]]:
    state = AwsState()
    with serve(AwsHandler, state) as url:
        yield url, state


@pytest.fixture
def gce() -> Iterator[tuple[str, GceState]]:
    state = GceState()
    with serve(GceHandler, state) as url:
        yield url, state


@pytest.fixture
def azure() -> Iterator[tuple[str, AzureState]]:
    state = AzureState()
    with serve(AzureHandler, state) as url:
        yield url, state


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL nothing listens on: connections are refused at once (a port of
    free_port's pool, which no other process is given meanwhile)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A loopback URL that accepts connections (kernel backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def raw_request(base: str, method: str, path: str, headers: dict[str, str]) -> int:
    """Status of one request sent without any poller logic, to check the fakes themselves."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=2)
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def azure_event(
    event_id: str = "E1",
    kind: str = "Preempt",
    resources: tuple[str, ...] = ("vm-1",),
    status: str = "Scheduled",
    not_before: str = AZURE_WHEN,
    duration: int = -1,
) -> dict[str, Any]:
    return {
        "EventId": event_id,
        "EventStatus": status,
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": list(resources),
        "NotBefore": not_before,
        "Description": "Spot eviction",
        "EventSource": "Platform",
        "DurationInSeconds": duration,
    }


# ---------------------------------------------------------------------------------------------
# The fakes enforce the providers' headers


def test_fakes_refuse_requests_without_the_provider_headers(
    aws: tuple[str, AwsState], gce: tuple[str, GceState], azure: tuple[str, AzureState]
) -> None:
    assert raw_request(aws[0], "GET", SPOT, {}) == 401
    assert raw_request(aws[0], "GET", SPOT, {"X-aws-ec2-metadata-token": "forged"}) == 401
    assert raw_request(aws[0], "PUT", "/latest/api/token", {}) == 400
    assert raw_request(gce[0], "GET", "/computeMetadata/v1/instance/preempted", {}) == 403
    assert raw_request(azure[0], "GET", "/metadata/scheduledevents?api-version=2020-07-01",
                       {}) == 400


# ---------------------------------------------------------------------------------------------
# AWS


def test_aws_reports_nothing_then_the_spot_action_then_the_rebalance(
    aws: tuple[str, AwsState],
) -> None:
    url, state = aws
    poller = AwsPoller(url, 1.0)
    assert run(poller.poll()) == []

    state.spot = b'{"action": "terminate", "time": "2026-11-22T10:00:00Z"}'
    (notice,) = run(poller.poll())
    assert notice.source == "aws-spot"
    assert notice.deadline == datetime(2026, 11, 22, 10, tzinfo=UTC).timestamp()
    assert notice.reason == "AWS spot instance-action: terminate at 2026-11-22T10:00:00Z"

    state.rebalance = b'{"noticeTime": "2026-11-22T09:50:00Z"}'
    spot, rebalance = run(poller.poll())
    assert spot == notice
    assert (rebalance.source, rebalance.deadline) == ("aws-rebalance", None)
    assert state.puts == 1, "the session token is reused"


def test_aws_fetches_a_new_token_after_a_401(aws: tuple[str, AwsState]) -> None:
    url, state = aws
    poller = AwsPoller(url, 1.0)
    run(poller.poll())
    state.tokens.clear()  # the service forgot or revoked the token
    state.spot = b'{"action": "stop", "time": "2026-11-22T10:00:00Z"}'
    assert [n.source for n in run(poller.poll())] == ["aws-spot"]
    assert state.puts == 2


def test_aws_renews_the_token_after_half_its_ttl(aws: tuple[str, AwsState]) -> None:
    url, state = aws
    now = [1000.0]
    poller = AwsPoller(url, 1.0, clock=lambda: now[0])
    run(poller.poll())
    now[0] += AWS_TOKEN_TTL / 2 - 1
    run(poller.poll())
    assert state.puts == 1
    now[0] += 1
    run(poller.poll())
    assert state.puts == 2


def test_aws_garbage_body_and_refused_token_are_notice_errors(aws: tuple[str, AwsState]) -> None:
    url, state = aws
    state.spot = b"<html>captive portal</html>"
    with pytest.raises(NoticeFormatError, match="not JSON"):
        run(AwsPoller(url, 1.0).poll())
    state.put_status = 403  # IMDS turned off for this instance
    with pytest.raises(NoticeError, match=r"PUT .*/latest/api/token answered HTTP 403"):
        run(AwsPoller(url, 1.0).poll())


# ---------------------------------------------------------------------------------------------
# GCE


def test_gce_reports_preemption_and_terminating_maintenance(gce: tuple[str, GceState]) -> None:
    url, state = gce
    poller = GcePoller(url, 1.0)
    assert run(poller.poll()) == []
    state.maintenance = b"MIGRATE_ON_HOST_MAINTENANCE"
    assert run(poller.poll()) == []  # live migration keeps the VM
    state.preempted = b"TRUE"
    (notice,) = run(poller.poll())
    assert (notice.source, notice.deadline, notice.key) == ("gce-preemption", None,
                                                            "gce-preemption")
    state.maintenance = b"TERMINATE_ON_HOST_MAINTENANCE"
    assert [n.source for n in run(poller.poll())] == ["gce-preemption", "gce-maintenance"]


def test_gce_refuses_a_server_without_the_flavor_header(gce: tuple[str, GceState]) -> None:
    url, state = gce
    state.flavor_header = False
    with pytest.raises(NoticeError, match="not the GCE metadata server"):
        run(GcePoller(url, 1.0).poll())


def test_gce_garbage_body_is_a_notice_error(gce: tuple[str, GceState]) -> None:
    url, state = gce
    state.preempted = b"MAYBE"
    with pytest.raises(NoticeFormatError, match="neither TRUE nor FALSE"):
        run(GcePoller(url, 1.0).poll())


# ---------------------------------------------------------------------------------------------
# Azure


def test_azure_reports_only_events_that_take_this_vm_away(azure: tuple[str, AzureState]) -> None:
    url, state = azure
    poller = AzurePoller(url, 1.0, "vm-1")
    assert run(poller.poll()) == []
    state.events = [azure_event("other", resources=("vm-2",)),
                    azure_event("short-freeze", kind="Freeze", duration=5)]
    assert run(poller.poll()) == []
    state.events.append(azure_event("E9", resources=("VM-1", "vm-3")))
    (notice,) = run(poller.poll())
    assert (notice.source, notice.deadline, notice.key) == (
        "azure-scheduled-event", AZURE_DEADLINE, "azure:E9")
    assert "Preempt E9" in notice.reason
    assert len(run(AzurePoller(url, 1.0, "").poll())) == 2  # empty name: every VM's events


def test_azure_garbage_body_is_a_notice_error(azure: tuple[str, AzureState]) -> None:
    url, state = azure
    state.raw = b'{"DocumentIncarnation": 1, "Events": "none"}'
    with pytest.raises(NoticeFormatError, match="no Events list"):
        run(AzurePoller(url, 1.0, "vm-1").poll())


# ---------------------------------------------------------------------------------------------
# Unreachable services fail within the timeout


POLLERS: dict[str, Callable[[str, float], Any]] = {
    "aws": AwsPoller,
    "gce": GcePoller,
    "azure": lambda url, timeout: AzurePoller(url, timeout, "vm-1"),
}


@pytest.mark.parametrize("provider", sorted(POLLERS))
def test_server_down_is_a_notice_error(provider: str, closed_port_url: str) -> None:
    started = time.monotonic()
    with pytest.raises(NoticeError, match=r"failed: .*refused"):
        run(POLLERS[provider](closed_port_url, 1.0).poll())
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("provider", sorted(POLLERS))
def test_silent_server_is_a_notice_error_within_the_timeout(provider: str,
                                                            silent_url: str) -> None:
    started = time.monotonic()
    with pytest.raises(NoticeError, match=r"did not answer within 0\.2 s"):
        run(POLLERS[provider](silent_url, 0.2).poll())
    assert time.monotonic() - started < 0.2 + 0.5


class RedirectHandler(Handler):
    def do_GET(self) -> None:
        self.reply(302, headers={"Location": "http://127.0.0.1:1/elsewhere"})


def test_redirects_are_not_followed() -> None:
    with serve(RedirectHandler, None) as url, pytest.raises(NoticeError, match="HTTP 302"):
        run(AzurePoller(url, 1.0, "vm-1").poll())


def test_poller_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="must start with http"):
        GcePoller("metadata.google.internal", 1.0)
    with pytest.raises(ValueError, match="timeout must be positive"):
        AwsPoller("http://127.0.0.1:1", 0)


def test_pollers_from_config_builds_the_enabled_ones() -> None:
    assert pollers_from_config(NoticesConfig(), "n1") == []
    pollers = pollers_from_config(NoticesConfig(aws=True, azure=True, timeout=0.5), "n1")
    assert [p.name for p in pollers] == ["aws", "azure"]
    assert isinstance(pollers[1], AzurePoller) and pollers[1].vm_name == "n1"


# ---------------------------------------------------------------------------------------------
# Watcher


@dataclass
class Recorder:
    notices: list[Notice] = field(default_factory=list)
    errors: list[tuple[str, Exception]] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    fail_next: list[Exception] = field(default_factory=list)

    async def on_notice(self, notice: Notice) -> None:
        if self.fail_next:
            raise self.fail_next.pop(0)
        self.notices.append(notice)

    def on_error(self, source: str, exc: Exception) -> None:
        self.errors.append((source, exc))

    def on_recover(self, source: str) -> None:
        self.recovered.append(source)

    def watcher(self, pollers: list[Any], interval: float, **kwargs: Any) -> NoticeWatcher:
        return NoticeWatcher(pollers, interval, self.on_notice, self.on_error, self.on_recover,
                             **kwargs)


async def wait_until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def running(watcher: NoticeWatcher) -> AsyncIterator[asyncio.Event]:
    """Run the watcher in a task; on exit set the stop event and require a prompt return."""
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop), name="notice-watcher")
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 0.5)


class Scripted:
    """A poller that plays a script of results; the last one repeats."""

    name = "fake"

    def __init__(self, *script: list[Notice] | Exception) -> None:
        self.script = list(script)
        self.polls = 0

    async def poll(self) -> list[Notice]:
        self.polls += 1
        item = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(item, Exception):
            raise item
        return item


def notice(key: str) -> Notice:
    return Notice("aws-spot", f"test notice {key}", None, key)


def test_watcher_reports_a_notice_once_across_polls(aws: tuple[str, AwsState]) -> None:
    url, state = aws
    rec = Recorder()

    async def scenario() -> None:
        async with running(rec.watcher([AwsPoller(url, 1.0)], 0.01)):
            await wait_until(lambda: state.gets >= 4)
            assert rec.notices == []
            state.spot = b'{"action": "terminate", "time": "2026-11-22T10:00:00Z"}'
            await wait_until(lambda: len(rec.notices) == 1)
            seen = state.gets
            await wait_until(lambda: state.gets >= seen + 6)  # three more rounds
        assert [n.source for n in rec.notices] == ["aws-spot"]
        assert rec.errors == []

    run(scenario())


def test_watcher_keeps_polling_after_errors_and_logs_once_per_change(
    azure: tuple[str, AzureState],
) -> None:
    url, state = azure
    state.raw = b"garbage"
    rec = Recorder()
    watcher = rec.watcher([AzurePoller(url, 1.0, "vm-1")], 0.01)

    async def scenario() -> None:
        async with running(watcher):
            await wait_until(lambda: state.gets >= 4)
            assert [(s, type(e)) for s, e in rec.errors] == [("azure", NoticeFormatError)]
            state.raw = None
            state.events = [azure_event("E1")]
            await wait_until(lambda: len(rec.notices) == 1)
        assert rec.recovered == ["azure"]
        assert watcher.error_counts["azure"] >= 3
        assert [n.key for n in rec.notices] == ["azure:E1"]

    run(scenario())


def test_watcher_stops_promptly_while_a_poll_hangs(silent_url: str) -> None:
    rec = Recorder()
    watcher = rec.watcher([GcePoller(silent_url, 0.3)], 60)

    async def scenario() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.run(stop))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, 1)
        return time.monotonic() - started

    assert run(scenario()) < 0.1
    assert rec.errors == []  # the abandoned round reports nothing


def test_watcher_stops_promptly_between_rounds() -> None:
    poller = Scripted([])
    watcher = Recorder().watcher([poller], 60)

    async def scenario() -> None:
        async with running(watcher):
            await wait_until(lambda: poller.polls == 1)

    run(scenario())


def test_watcher_offers_a_notice_again_when_delivery_failed() -> None:
    rec = Recorder(fail_next=[StoreError("etcd did not answer within 1 s")])
    watcher = rec.watcher([Scripted([notice("k1")])], 1)
    run(watcher.poll_once())
    assert rec.notices == [] and [s for s, _ in rec.errors] == ["fake"]
    run(watcher.poll_once())
    run(watcher.poll_once())
    assert [n.key for n in rec.notices] == ["k1"]
    assert rec.recovered == ["fake"]


def test_watcher_reports_a_different_error_again() -> None:
    rec = Recorder()
    poller = Scripted(NoticeError("a"), NoticeError("a"), NoticeError("b"), [], NoticeError("b"))
    watcher = rec.watcher([poller], 1)
    for _ in range(5):
        run(watcher.poll_once())
    assert [str(e) for _, e in rec.errors] == ["a", "b", "b"]
    assert rec.recovered == ["fake"]
    assert watcher.error_counts["fake"] == 4


def test_watcher_forgets_the_oldest_key_past_its_bound() -> None:
    rec = Recorder()
    poller = Scripted([notice("a")], [notice("b")], [notice("c")], [notice("a"), notice("c")])
    watcher = rec.watcher([poller], 1, max_keys=2)
    for _ in range(4):
        run(watcher.poll_once())
    assert [n.key for n in rec.notices] == ["a", "b", "c", "a"]


def test_watcher_does_not_swallow_bugs() -> None:
    watcher = Recorder().watcher([Scripted(RuntimeError("bug"))], 1)
    with pytest.raises(RuntimeError, match="bug"):
        run(watcher.run(asyncio.Event()))


def test_watcher_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval must be positive"):
        Recorder().watcher([], 0)


# ---------------------------------------------------------------------------------------------
# Pure parsers: edge cases


def test_aws_spot_action_edge_cases() -> None:
    naive = parse_aws_spot_action(b'{"action": "hibernate", "time": "2026-11-22T10:00:00"}')
    assert naive.deadline == datetime(2026, 11, 22, 10, tzinfo=UTC).timestamp()
    odd_time = parse_aws_spot_action(b'{"action": "terminate", "time": "soon"}')
    assert odd_time.deadline is None and odd_time.key == "aws-spot:terminate:soon"
    no_time = parse_aws_spot_action(b'{"action": "terminate"}')
    assert no_time.deadline is None and "unknown time" in no_time.reason
    for body in (b'{"time": "2026-11-22T10:00:00Z"}', b'{"action": ""}', b'{"action": 3}',
                 b"[]", b"", b"\xff\xfe", b"[" * 100_000):
        with pytest.raises(NoticeFormatError):
            parse_aws_spot_action(body)


def test_aws_rebalance_edge_cases() -> None:
    assert parse_aws_rebalance(b'{"noticeTime": "x"}').key == "aws-rebalance:x"
    for body in (b"{}", b'{"noticeTime": null}', b"null"):
        with pytest.raises(NoticeFormatError):
            parse_aws_rebalance(body)


def test_gce_value_edge_cases() -> None:
    assert parse_gce_preempted(b"TRUE\n") is not None
    assert parse_gce_preempted(b"FALSE") is None
    assert parse_gce_maintenance(b"NONE") is None
    terminate = parse_gce_maintenance(b"TERMINATE_ON_HOST_MAINTENANCE")
    assert terminate is not None and terminate.source == "gce-maintenance"
    for body in (b"", b"true", b"\xff"):
        with pytest.raises(NoticeFormatError):
            parse_gce_preempted(body)
    with pytest.raises(NoticeFormatError, match="unknown"):
        parse_gce_maintenance(b"EXPLODE_ON_HOST_MAINTENANCE")


def azure_doc(*events: Any) -> bytes:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)}).encode()


def test_azure_event_edge_cases() -> None:
    started = parse_azure_events(azure_doc(azure_event(status="Started", not_before="")), "vm-1")
    assert started[0].deadline is None and "not before now" in started[0].reason
    assert parse_azure_events(azure_doc(azure_event(status="Completed")), "vm-1") == []
    assert parse_azure_events(azure_doc(azure_event(kind="Unknown")), "vm-1") == []
    kinds = ["Preempt", "Terminate", "Reboot", "Redeploy"]
    doc = azure_doc(*(azure_event(k, kind=k) for k in kinds))
    assert [n.key for n in parse_azure_events(doc, "vm-1")] == [f"azure:{k}" for k in kinds]
    odd_date = parse_azure_events(azure_doc(azure_event(not_before="tomorrow")), "vm-1")
    assert odd_date[0].deadline is None


def test_azure_freeze_is_a_notice_only_when_longer_than_the_threshold() -> None:
    def freeze(duration: Any) -> list[Notice]:
        event = azure_event(kind="Freeze") | {"DurationInSeconds": duration}
        return parse_azure_events(azure_doc(event), "vm-1", freeze_threshold=30)

    assert freeze(-1) == [] and freeze(30) == [] and freeze(None) == [] and freeze(True) == []
    (long_freeze,) = freeze(45)
    assert "Freeze E1" in long_freeze.reason and "for 45 s" in long_freeze.reason


def test_azure_malformed_event_never_hides_a_wellformed_one() -> None:
    good = azure_event("good")
    assert [n.key for n in parse_azure_events(azure_doc("junk", {"EventId": 4}, good), "vm-1")
            ] == ["azure:good"]
    with pytest.raises(NoticeFormatError, match="2 malformed"):
        parse_azure_events(azure_doc("junk", azure_event() | {"Resources": None}), "vm-1")
    assert parse_azure_events(azure_doc(), "vm-1") == []
    for body in (b"", b"[]", b'{"Events": {}}', b"\xff"):
        with pytest.raises(NoticeFormatError):
            parse_azure_events(body, "vm-1")


def random_json(rng: random.Random, depth: int = 0) -> Any:
    choices: list[Callable[[], Any]] = [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-5, 100),
        lambda: rng.choice(["", "TRUE", "Preempt", "Freeze", "Scheduled", "vm-1", AZURE_WHEN,
                            "2026-11-22T10:00:00Z", "\u00e9"]),
    ]
    if depth < 3:
        keys = ["action", "time", "noticeTime", "Events", "EventId", "EventType", "EventStatus",
                "Resources", "NotBefore", "DurationInSeconds", "Description"]
        choices += [
            lambda: [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {rng.choice(keys): random_json(rng, depth + 1)
                     for _ in range(rng.randint(0, 6))},
        ]
    return rng.choice(choices)()


PARSERS: list[Callable[[bytes], object]] = [
    parse_aws_spot_action, parse_aws_rebalance, parse_gce_preempted, parse_gce_maintenance,
    lambda body: parse_azure_events(body, "vm-1"), lambda body: parse_azure_events(body, ""),
]


def test_parsers_raise_only_notice_format_errors_on_garbage() -> None:
    rng = random.Random(7)
    bodies = [json.dumps(random_json(rng)).encode() for _ in range(400)]
    bodies += [rng.randbytes(rng.randint(0, 40)) for _ in range(100)]
    for parse in PARSERS:
        for body in bodies:
            try:
                parse(body)
            except NoticeFormatError as exc:
                assert isinstance(exc, UnderstudyError) and str(exc)
