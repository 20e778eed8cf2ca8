"""Fake cloud metadata servers on 127.0.0.1 that speak each provider's documented format and
enforce its headers (AWS IMDSv2 token, GCE Metadata-Flavor, Azure Metadata: true)."""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SPOT = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"


@dataclass
class AwsState:
    spot: bytes | None = None
    rebalance: bytes | None = None
    put_status: int = 200
    tokens: set[str] = field(default_factory=set)
    puts: int = 0
    gets: int = 0


@dataclass
class GceState:
    preempted: bytes = b"FALSE"
    maintenance: bytes = b"NONE"
    flavor_header: bool = True


@dataclass
class AzureState:
    events: list[dict[str, Any]] = field(default_factory=list)
    raw: bytes | None = None  # served instead of the document when set
    gets: int = 0


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], state: Any) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.state = state


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep pytest output clean

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class AwsHandler(Handler):
    """IMDSv2: PUT a token with a TTL header, then GET with the token or get 401."""

    def do_PUT(self) -> None:
        state: AwsState = self.server.state
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if self.path != "/latest/api/token":
            self.reply(404)
        elif not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            self.reply(400)
        elif state.put_status != 200:
            self.reply(state.put_status)
        else:
            token = secrets.token_urlsafe(16)
            state.tokens.add(token)
            state.puts += 1
            self.reply(200, token.encode())

    def do_GET(self) -> None:
        state: AwsState = self.server.state
        state.gets += 1
        if self.headers.get("X-aws-ec2-metadata-token") not in state.tokens:
            self.reply(401)
            return
        body = {SPOT: state.spot, REBALANCE: state.rebalance}.get(self.path)
        if body is None:
            self.reply(404, b"Not Found")
        else:
            self.reply(200, body, {"Content-Type": "text/plain"})


class GceHandler(Handler):
    def do_GET(self) -> None:
        state: GceState = self.server.state
        flavor = {"Metadata-Flavor": "Google"} if state.flavor_header else {}
        if self.headers.get("Metadata-Flavor") != "Google":
            self.reply(403, b"Missing Metadata-Flavor:Google header.", flavor)
            return
        body = {
            "/computeMetadata/v1/instance/preempted": state.preempted,
            "/computeMetadata/v1/instance/maintenance-event": state.maintenance,
        }.get(self.path)
        if body is None:
            self.reply(404, b"Not Found", flavor)
        else:
            self.reply(200, body, {**flavor, "Content-Type": "application/text"})


class AzureHandler(Handler):
    def do_GET(self) -> None:
        state: AzureState = self.server.state
        state.gets += 1
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path != "/metadata/scheduledevents":
            self.reply(404)
        elif self.headers.get("Metadata") != "true" or "api-version" not in query:
            self.reply(400, b'{"error": "Bad request. Required metadata header not specified"}')
        else:
            doc = {"DocumentIncarnation": len(state.events), "Events": state.events}
            body = state.raw if state.raw is not None else json.dumps(doc).encode()
            self.reply(200, body, {"Content-Type": "application/json"})


@contextlib.contextmanager
def serve(handler: type[BaseHTTPRequestHandler], state: Any) -> Iterator[str]:
    server = FakeServer(handler, state)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-metadata"
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


