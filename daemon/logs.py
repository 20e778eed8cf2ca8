"""Structured logs: JSON lines when stderr is not a terminal (the journal), readable otherwise.

Every line carries the entity it is about: ``node`` always, ``job``, ``rank`` and ``epoch`` when
known (bind them with ``log.bind``). Events (etcd) and metrics (Prometheus) are separate streams.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    stream = stream or sys.stderr
    json_out = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Any = (structlog.processors.JSONRenderer() if json_out
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # One write per line (print writes the newline apart): a node's workers share the
        # daemon's log, and two lines must never interleave.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get(**context: Any) -> Any:
    return structlog.get_logger().bind(**context)
