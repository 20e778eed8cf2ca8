"""Cloud providers' advance notices that this machine is going away; each becomes a drain request.

Three layers, in the order of this file:

- pure parsers, one per provider response: bytes in, :class:`Notice` objects out, no I/O and no
  clock. Garbage raises :class:`NoticeFormatError` (a :class:`NoticeError`) and nothing else;
- pollers (:class:`AwsPoller`, :class:`GcePoller`, :class:`AzurePoller`): thin HTTP over
  ``urllib`` in a worker thread. Every request is bounded by the poller's timeout, ignores the
  proxy environment (metadata services are link-local) and refuses redirects. Any failure,
  network or format, raises :class:`NoticeError` with one sentence;
- :class:`NoticeWatcher`: runs the pollers every ``interval`` seconds until a stop event, hands
  each notice key to ``on_notice`` once, and reports a source's errors once per change.

What counts as "going away" (decided here, so every provider drains for the same reasons):
AWS spot instance-action (terminate, stop, hibernate) and rebalance recommendations; GCE
preemption and ``TERMINATE_ON_HOST_MAINTENANCE``; Azure Preempt, Terminate, Reboot and Redeploy.
Live migration (GCE ``MIGRATE_ON_HOST_MAINTENANCE``) and Azure Freeze pause the VM for seconds
and keep it, so they are not notices, except a Freeze that Azure says lasts longer than
``freeze_threshold`` seconds: a pause that long outlives collective timeouts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from understudy.common.config import NoticesConfig
from understudy.common.errors import UnderstudyError
from understudy.common.records import DrainSource

#: Bodies past this size are not metadata answers; refusing them bounds memory and parse time.
MAX_BODY = 64 * 1024
AWS_TOKEN_TTL = 21600
AZURE_API_VERSION = "2020-07-01"
#: Azure event types after which this VM is gone or rebooted. Freeze is handled apart.
AZURE_TAKES_AWAY = frozenset({"Preempt", "Terminate", "Reboot", "Redeploy"})
#: Freshly scheduled and already running events; anything else (Completed, Canceled) is history.
AZURE_LIVE_STATUSES = frozenset({"Scheduled", "Started"})
DEFAULT_FREEZE_THRESHOLD = 30.0


class NoticeError(UnderstudyError):
    """A metadata service could not be asked, or answered something unusable."""


class NoticeFormatError(NoticeError):
    """A metadata service answered a body that is not in the provider's documented format."""


@dataclass(frozen=True)
class Notice:
    #: "aws-spot", "aws-rebalance", "gce-preemption", "gce-maintenance", "azure-scheduled-event".
    source: str
    #: One readable sentence for logs and the drain request.
    reason: str
    #: Unix time at which the provider says the machine goes away, when it says.
    deadline: float | None
    #: Identity of this notice: the watcher reports each key once. Prefixed by the source, so
    #: keys of different providers never collide.
    key: str


# ---------------------------------------------------------------------------------------------
# Pure parsers


def parse_aws_spot_action(body: bytes) -> Notice:
    """Parse a 200 body of ``/latest/meta-data/spot/instance-action``.

    Any non-empty action is a notice (terminate, stop and hibernate all take the machine away,
    and an action AWS adds later most likely does too). An unreadable time keeps the notice and
    drops the deadline. Raises NoticeFormatError when there is no action at all.
    """
    doc = _json_object(body, "AWS spot instance-action")
    action = doc.get("action")
    if not isinstance(action, str) or not action:
        raise NoticeFormatError(f"AWS spot instance-action has no action: {_excerpt(body)}")
    when = doc.get("time")
    when_text = when if isinstance(when, str) else "an unknown time"
    return Notice(
        source=DrainSource.AWS_SPOT,
        reason=f"AWS spot instance-action: {action} at {when_text}",
        deadline=_iso_time(when),
        key=f"aws-spot:{action}:{when_text}",
    )


def parse_aws_rebalance(body: bytes) -> Notice:
    """Parse a 200 body of ``/latest/meta-data/events/recommendations/rebalance``.

    A recommendation has no deadline: ``noticeTime`` is when it was issued. Raises
    NoticeFormatError when ``noticeTime`` is missing.
    """
    doc = _json_object(body, "AWS rebalance recommendation")
    issued = doc.get("noticeTime")
    if not isinstance(issued, str) or not issued:
        raise NoticeFormatError(
            f"AWS rebalance recommendation has no noticeTime: {_excerpt(body)}"
        )
    return Notice(
        source=DrainSource.AWS_REBALANCE,
        reason=f"AWS rebalance recommendation issued at {issued}: spot interruption risk is "
        "elevated",
        deadline=None,
        key=f"aws-rebalance:{issued}",
    )


def parse_gce_preempted(body: bytes) -> Notice | None:
    """Parse ``/computeMetadata/v1/instance/preempted``: TRUE is a notice, FALSE is none.

    GCE gives no time; the VM is stopped about 30 s after this turns TRUE. Raises
    NoticeFormatError for any other body.
    """
    value = _text(body, "GCE preempted")
    if value == "FALSE":
        return None
    if value != "TRUE":
        raise NoticeFormatError(f"GCE preempted is neither TRUE nor FALSE: {_excerpt(body)}")
    return Notice(
        source=DrainSource.GCE_PREEMPTION,
        reason="GCE preempted this instance: it is stopped within about 30 seconds",
        deadline=None,
        key="gce-preemption",
    )


def parse_gce_maintenance(body: bytes) -> Notice | None:
    """Parse ``/computeMetadata/v1/instance/maintenance-event``.

    Only TERMINATE_ON_HOST_MAINTENANCE is a notice (see the module docstring for live
    migration). Raises NoticeFormatError for a value GCE does not document.
    """
    value = _text(body, "GCE maintenance-event")
    if value in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE"):
        return None
    if value != "TERMINATE_ON_HOST_MAINTENANCE":
        raise NoticeFormatError(f"GCE maintenance-event is unknown: {_excerpt(body)}")
    return Notice(
        source=DrainSource.GCE_MAINTENANCE,
        reason="GCE host maintenance TERMINATE_ON_HOST_MAINTENANCE: the instance will be stopped",
        deadline=None,
        # The metadata server gives no event id. After a terminating maintenance the daemon
        # restarts with the machine, so one key per value cannot hide a later event.
        key=f"gce-maintenance:{value}",
    )


def parse_azure_events(
    body: bytes, vm_name: str = "", freeze_threshold: float = DEFAULT_FREEZE_THRESHOLD
) -> list[Notice]:
    """Parse a Scheduled Events document into the notices that concern ``vm_name``.

    ``vm_name`` is compared without case with each event's Resources; empty means every event
    counts (Azure shows a VM the events of its whole availability set, so empty is only right
    for a lone VM). A malformed event never hides a well-formed one: it is skipped when another
    event is a notice, and raises NoticeFormatError when none is, as does a malformed document.
    """
    doc = _json_object(body, "Azure scheduled events")
    events = doc.get("Events")
    if not isinstance(events, list):
        raise NoticeFormatError(f"Azure scheduled events has no Events list: {_excerpt(body)}")
    notices: list[Notice] = []
    malformed: list[Any] = []
    for event in events:
        try:
            notice = _azure_event(event, vm_name.lower(), freeze_threshold)
        except NoticeFormatError:
            malformed.append(event)
            continue
        if notice is not None:
            notices.append(notice)
    if malformed and not notices:
        raise NoticeFormatError(
            f"Azure scheduled events has {len(malformed)} malformed event(s), the first is "
            f"{_excerpt(json.dumps(malformed[0]).encode())}"
        )
    return notices


def _azure_event(event: Any, vm_name: str, freeze_threshold: float) -> Notice | None:
    if not isinstance(event, dict):
        raise NoticeFormatError("Azure event is not an object")
    event_id, kind = event.get("EventId"), event.get("EventType")
    if not isinstance(event_id, str) or not event_id or not isinstance(kind, str):
        raise NoticeFormatError("Azure event lacks EventId or EventType")
    if event.get("EventStatus") not in AZURE_LIVE_STATUSES:
        return None
    resources = event.get("Resources")
    if not isinstance(resources, list):
        raise NoticeFormatError("Azure event lacks its Resources list")
    if vm_name and vm_name not in {r.lower() for r in resources if isinstance(r, str)}:
        return None
    duration = event.get("DurationInSeconds")
    if kind == "Freeze":
        # -1 or a missing duration means "unknown"; Azure documents freezes as seconds long.
        long_freeze = (
            isinstance(duration, int | float)
            and not isinstance(duration, bool)
            and duration > freeze_threshold
        )
        if not long_freeze:
            return None
    elif kind not in AZURE_TAKES_AWAY:
        return None
    not_before = event.get("NotBefore")
    # A Started event has an empty NotBefore: it is happening now.
    when = not_before if isinstance(not_before, str) and not_before else "now"
    description = event.get("Description")
    reason = (
        f"Azure scheduled event {kind} {event_id} ({event.get('EventStatus')}, "
        f"from {event.get('EventSource', 'an unknown source')}) not before {when}"
    )
    if kind == "Freeze":
        reason += f" for {duration:g} s"
    if isinstance(description, str) and description:
        reason += f": {description}"
    return Notice(
        source=DrainSource.AZURE_SCHEDULED_EVENT,
        reason=reason,
        deadline=_http_date(not_before),
        key=f"azure:{event_id}",
    )


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise NoticeFormatError(f"{what} is not JSON: {_excerpt(body)}") from None
    if not isinstance(doc, dict):
        raise NoticeFormatError(f"{what} is not a JSON object: {_excerpt(body)}")
    return doc


def _text(body: bytes, what: str) -> str:
    try:
        return body.decode("ascii").strip()
    except UnicodeDecodeError:
        raise NoticeFormatError(f"{what} is not ASCII text: {_excerpt(body)}") from None


def _excerpt(body: bytes) -> str:
    return repr(body[:80]) + ("..." if len(body) > 80 else "")


def _iso_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)  # accepts the trailing Z since Python 3.11
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)  # IMDS times are UTC
    return parsed.timestamp()


def _http_date(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)  # "-0000" means UTC with no stated zone
    return parsed.timestamp()


# ---------------------------------------------------------------------------------------------
# HTTP


@dataclass(frozen=True)
class _Response:
    url: str
    status: int
    headers: Mapping[str, str]  # names lower-cased
    body: bytes


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # A metadata service never redirects; following one could leave the link-local network.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError with the 3xx status


def _opener() -> urllib.request.OpenerDirector:
    # ProxyHandler({}) ignores http_proxy: a proxy cannot reach the link-local metadata service.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _fetch_blocking(
    opener: urllib.request.OpenerDirector,
    method: str,
    url: str,
    headers: Mapping[str, str],
    timeout: float,
) -> _Response:
    request = urllib.request.Request(url, method=method, headers=dict(headers))
    try:
        try:
            with opener.open(request, timeout=timeout) as answer:
                status, got = answer.status, answer.headers
                body = answer.read(MAX_BODY + 1)
        except urllib.error.HTTPError as exc:  # 4xx/5xx are answers, not failures
            try:
                status, got = exc.code, exc.headers
                body = exc.read(MAX_BODY + 1)
            finally:
                exc.close()
    except TimeoutError as exc:
        raise NoticeError(f"{method} {url} did not answer within {timeout:g} s") from exc
    except urllib.error.URLError as exc:  # connect errors, a connect timeout included
        if isinstance(exc.reason, TimeoutError):
            raise NoticeError(f"{method} {url} did not answer within {timeout:g} s") from exc
        raise NoticeError(f"{method} {url} failed: {exc.reason}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise NoticeError(f"{method} {url} failed: {exc or type(exc).__name__}") from exc
    if len(body) > MAX_BODY:
        raise NoticeError(f"{method} {url} answered more than {MAX_BODY} bytes")
    return _Response(url, status, {k.lower(): v for k, v in got.items()}, body)


class _Http:
    """Requests to one metadata service, each bounded by ``timeout`` seconds in all."""

    def __init__(self, base_url: str, timeout: float) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"metadata service URL must start with http://, got {base_url!r}")
        if not timeout > 0:
            raise ValueError(f"metadata request timeout must be positive, got {timeout!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._opener = _opener()

    async def request(self, method: str, path: str, headers: Mapping[str, str]) -> _Response:
        """Return the answer, whatever its status; raises NoticeError."""
        url = self.base_url + path
        try:
            # The socket timeout bounds each read; wait_for bounds the whole request. A thread
            # abandoned here ends by its socket timeout.
            response = await asyncio.wait_for(
                asyncio.to_thread(
                    _fetch_blocking, self._opener, method, url, headers, self.timeout
                ),
                self.timeout,
            )
        except TimeoutError as exc:
            raise NoticeError(f"{method} {url} did not answer within {self.timeout:g} s") from exc
        return response


def _unexpected(method: str, response: _Response) -> NoticeError:
    return NoticeError(
        f"{method} {response.url} answered HTTP {response.status}: {_excerpt(response.body)}"
    )


# ---------------------------------------------------------------------------------------------
# Pollers


class NoticePoller(Protocol):
    #: Names the poller in error reports: "aws", "gce" or "azure".
    name: str

    async def poll(self) -> list[Notice]:
        """Return the notices the provider shows now; raises NoticeError."""
        ...


class AwsPoller:
    """IMDSv2: a session token from ``PUT /latest/api/token``, then the spot and rebalance keys.

    The token is reused for half its TTL and fetched again once when a request answers 401.
    """

    name = "aws"
    SPOT_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"

    def __init__(
        self, base_url: str, timeout: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._http = _Http(base_url, timeout)
        self._clock = clock
        self._token: str | None = None
        self._token_renew_at = 0.0

    async def poll(self) -> list[Notice]:
        """Return the spot action and rebalance notices; raises NoticeError."""
        notices = []
        spot = await self._get(self.SPOT_PATH)
        if spot is not None:
            notices.append(parse_aws_spot_action(spot))
        rebalance = await self._get(self.REBALANCE_PATH)
        if rebalance is not None:
            notices.append(parse_aws_rebalance(rebalance))
        return notices

    async def _get(self, path: str) -> bytes | None:
        """Body of a 200, None for a 404 (nothing announced); raises NoticeError."""
        response = await self._get_once(path)
        if response.status == 401:
            self._token = None  # expired or revoked: one fresh token, then give up
            response = await self._get_once(path)
        if response.status == 404:
            return None
        if response.status != 200:
            raise _unexpected("GET", response)
        return response.body

    async def _get_once(self, path: str) -> _Response:
        token = await self._session_token()
        return await self._http.request("GET", path, {"X-aws-ec2-metadata-token": token})

    async def _session_token(self) -> str:
        if self._token is not None and self._clock() < self._token_renew_at:
            return self._token
        started = self._clock()
        ttl_header = {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL)}
        response = await self._http.request("PUT", "/latest/api/token", ttl_header)
        if response.status != 200:
            raise _unexpected("PUT", response)
        token = _text(response.body, "AWS IMDSv2 token")
        if not token:
            raise NoticeFormatError(f"PUT {response.url} answered an empty IMDSv2 token")
        self._token, self._token_renew_at = token, started + AWS_TOKEN_TTL / 2
        return token


class GcePoller:
    """GCE metadata server: the ``preempted`` and ``maintenance-event`` values."""

    name = "gce"
    PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
    MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"

    def __init__(self, base_url: str, timeout: float) -> None:
        self._http = _Http(base_url, timeout)

    async def poll(self) -> list[Notice]:
        """Return the preemption and terminating-maintenance notices; raises NoticeError."""
        preempted = parse_gce_preempted(await self._get(self.PREEMPTED_PATH))
        maintenance = parse_gce_maintenance(await self._get(self.MAINTENANCE_PATH))
        return [n for n in (preempted, maintenance) if n is not None]

    async def _get(self, path: str) -> bytes:
        response = await self._http.request("GET", path, {"Metadata-Flavor": "Google"})
        # Checked first: any other server on that name answers without it, whatever its status.
        if response.headers.get("metadata-flavor") != "Google":
            raise NoticeError(
                f"GET {response.url} answered without 'Metadata-Flavor: Google': it is not "
                "the GCE metadata server"
            )
        if response.status != 200:
            raise _unexpected("GET", response)
        return response.body


class AzurePoller:
    """Azure Scheduled Events. Events are only read, never approved: the platform proceeds at
    NotBefore, which the drain deadline already respects.

    Azure enables the service on the first request and may take up to two minutes to answer it;
    until then polls time out and are reported as errors.
    """

    name = "azure"
    PATH = f"/metadata/scheduledevents?api-version={AZURE_API_VERSION}"

    def __init__(
        self,
        base_url: str,
        timeout: float,
        vm_name: str,
        *,
        freeze_threshold: float = DEFAULT_FREEZE_THRESHOLD,
    ) -> None:
        self._http = _Http(base_url, timeout)
        self.vm_name = vm_name
        self._freeze_threshold = freeze_threshold

    async def poll(self) -> list[Notice]:
        """Return the notices of the events that concern this VM; raises NoticeError."""
        response = await self._http.request("GET", self.PATH, {"Metadata": "true"})
        if response.status != 200:
            raise _unexpected("GET", response)
        return parse_azure_events(response.body, self.vm_name, self._freeze_threshold)


def pollers_from_config(cfg: NoticesConfig, node_name: str) -> list[NoticePoller]:
    """Build the enabled pollers. ``node_name`` is the Azure VM name to match events against.

    Raises ValueError for a URL that is not http(s) or a non-positive timeout.
    """
    pollers: list[NoticePoller] = []
    if cfg.aws:
        pollers.append(AwsPoller(cfg.aws_url, cfg.timeout))
    if cfg.gce:
        pollers.append(GcePoller(cfg.gce_url, cfg.timeout))
    if cfg.azure:
        pollers.append(AzurePoller(cfg.azure_url, cfg.timeout, node_name))
    return pollers


# ---------------------------------------------------------------------------------------------
# Watcher

OnNotice = Callable[[Notice], Awaitable[None]]
OnError = Callable[[str, Exception], None]
OnRecover = Callable[[str], None]


class NoticeWatcher:
    """Polls every source each ``interval`` seconds until a stop event.

    - ``on_notice`` is awaited once per notice key. If it raises an UnderstudyError (etcd down
      while requesting the drain) the key is not remembered, so the next round offers it again.
      It must bound its own blocking calls; other exceptions are bugs and end :meth:`run`.
    - ``on_error(source, exc)`` is called when a source starts failing or fails with a different
      sentence, not on every failed round, so it can log directly; ``error_counts`` counts every
      failed round for metrics. ``on_recover(source)`` is called when a failing source succeeds.
    - Stopping is prompt: a round still polling is abandoned when the event is set.
    """

    def __init__(
        self,
        pollers: Sequence[NoticePoller],
        interval: float,
        on_notice: OnNotice,
        on_error: OnError,
        on_recover: OnRecover | None = None,
        *,
        max_keys: int = 1024,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"notice poll interval must be positive, got {interval!r}")
        self._pollers = tuple(pollers)
        self._interval = interval
        self._on_notice = on_notice
        self._on_error = on_error
        self._on_recover = on_recover
        # Insertion-ordered so the oldest key is forgotten first; it bounds memory on a machine
        # that lives through many notices (rebalance recommendations come and go).
        self._seen: dict[str, None] = {}
        self._max_keys = max_keys
        self._failing: dict[str, str] = {}
        self.error_counts: collections.Counter[str] = collections.Counter()

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set; raises only a bug's exception (see the class docstring)."""
        while not stop.is_set():
            results = await self._poll_unless_stopped(stop)
            if results is None:
                return
            await self._deliver(results)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)

    async def poll_once(self) -> None:
        """One round: poll every source and deliver what is new."""
        await self._deliver(await self._poll_all())

    async def _poll_unless_stopped(
        self, stop: asyncio.Event
    ) -> list[list[Notice] | NoticeError] | None:
        polling = asyncio.ensure_future(self._poll_all())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({polling, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (polling, stopped):
                task.cancel()
            # Cancelled awaits of worker threads finish at once; the threads end by timeout.
            await asyncio.wait({polling, stopped})
        if polling.cancelled():
            return None
        results = polling.result()  # re-raises a bug in a poller even when stopping
        return None if stop.is_set() else results

    async def _poll_all(self) -> list[list[Notice] | NoticeError]:
        # Concurrent, so a provider that times out does not delay the others.
        return list(await asyncio.gather(*(self._poll(p) for p in self._pollers)))

    @staticmethod
    async def _poll(poller: NoticePoller) -> list[Notice] | NoticeError:
        try:
            return await poller.poll()
        except NoticeError as exc:
            return exc

    async def _deliver(self, results: Sequence[list[Notice] | NoticeError]) -> None:
        for poller, result in zip(self._pollers, results, strict=True):
            error = result if isinstance(result, NoticeError) else await self._hand_over(result)
            if error is None:
                self._recovered(poller.name)
            else:
                self._failed(poller.name, error)

    async def _hand_over(self, notices: list[Notice]) -> UnderstudyError | None:
        first_error: UnderstudyError | None = None
        for notice in notices:
            if notice.key in self._seen:
                continue
            try:
                await self._on_notice(notice)
            except UnderstudyError as exc:
                first_error = first_error or exc
                continue
            self._seen[notice.key] = None
            if len(self._seen) > self._max_keys:
                del self._seen[next(iter(self._seen))]
        return first_error

    def _failed(self, source: str, exc: Exception) -> None:
        self.error_counts[source] += 1
        sentence = str(exc)
        if self._failing.get(source) != sentence:
            self._failing[source] = sentence
            self._on_error(source, exc)

    def _recovered(self, source: str) -> None:
        if self._failing.pop(source, None) is not None and self._on_recover is not None:
            self._on_recover(source)
