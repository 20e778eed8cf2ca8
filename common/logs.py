"""Structured logs: JSON lines when stderr is not a terminal (the journal), readable otherwise.

Every line carries the entity it is about: ``node`` always, ``job``, ``rank`` and ``epoch`` when
known (bind them with ``log.bind``). Events (etcd) and metrics (Prometheus) are separate streams.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto", stream: Any = None,
              **context: Any) -> None:
    """Send this process's logs to ``stream`` (stderr): ours through structlog, and the
    standard library's (asyncio, grpc, aetcd, threads, unraisable exceptions) through the same
    renderer, so a library's traceback is one JSON line too, never raw text in the journal.
    ``context`` (``node=...``) is added to the library lines, which cannot bind it themselves."""
    stream = stream or sys.stderr
    json_out = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Any = (structlog.processors.JSONRenderer() if json_out
                     else structlog.dev.ConsoleRenderer(colors=False))
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # One write per line (print writes the newline apart): a node's workers share the
        # daemon's log, and two lines must never interleave.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(stream, level, [*shared, _add_context(context), _name_logger], renderer)


def _add_context(context: dict[str, Any]) -> Any:
    def add(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        for k, v in context.items():
            event_dict.setdefault(k, v)
        return event_dict
    return add


def _name_logger(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("logger", record.name)
    return event_dict


def _route_stdlib(stream: Any, level: str, pre_chain: list[Any], renderer: Any) -> None:
    # StreamHandler writes message and newline in one call: lines stay whole, as above.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    ))
    root = logging.getLogger()
    root.handlers = [handler]
    # Libraries' info lines are chatter; their warnings and errors are ours to see.
    root.setLevel(max(logging.WARNING, _LEVELS[level]))
    log = logging.getLogger("understudy")

    def thread_crashed(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        thread = args.thread.name if args.thread is not None else "?"
        log.error(f"Thread {thread} crashed.", exc_info=args.exc_value or True)

    def unraisable(args: Any) -> None:
        # An exception nobody could catch: in a destructor, or a coroutine closed at exit.
        where = args.err_msg or "Exception ignored"
        log.warning(f"{where}: {args.object!r}"[:500], exc_info=args.exc_value or True)

    threading.excepthook = thread_crashed
    sys.unraisablehook = unraisable


def get(name: str | None = None, **context: Any) -> Any:
    """A logger bound to ``context`` (node, job, rank, epoch...); ``name`` is the ``logger``
    field (``understudy.worker``), left out by default."""
    return (structlog.get_logger(name) if name else structlog.get_logger()).bind(**context)
