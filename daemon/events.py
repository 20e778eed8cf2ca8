"""The cluster's event stream in etcd: what happened, to which node, in one sentence."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable
from typing import Any

from understudy.common.errors import StoreError
from understudy.common.keys import Keys
from understudy.common.records import Event, event_id
from understudy.common.store import EtcdStore
from understudy.daemon.metrics import Metrics


class EventLog:
    """Writes events; while etcd is unreachable they wait in a bounded queue (oldest dropped)."""

    def __init__(self, store: EtcdStore, keys: Keys, node: str, metrics: Metrics,
                 clock: Callable[[], float] = time.time, backlog: int = 256) -> None:
        self._store, self._keys, self._node, self._metrics = store, keys, node, metrics
        self._clock = clock
        self._seq = itertools.count()
        self._pending: collections.deque[tuple[str, Event]] = collections.deque(maxlen=backlog)
        self._flushing = asyncio.Lock()

    async def emit(self, kind: str, message: str, node: str | None = None,
                   **details: Any) -> None:
        now = self._clock()
        ev = Event(time=now, kind=kind, node=node or self._node, message=message,
                   details=details)
        self._pending.append((self._keys.event(event_id(now, self._node, next(self._seq))), ev))
        self._metrics.events.labels(kind=kind).inc()
        await self.flush()

    async def flush(self) -> None:
        async with self._flushing:  # one writer at a time: events keep their order
            while self._pending:
                key, ev = self._pending[0]
                try:
                    await self._store.put(key, ev.encode())
                except StoreError:
                    return
                self._pending.popleft()
