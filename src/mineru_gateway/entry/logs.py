"""Log output, configured once at the program's edge (the CLI); code only calls the loggers.

Events from structlog and records from the standard library's `logging` (asyncio, any
library's logger that propagates to the root) leave through the same renderer: with the json
format every line on stderr is one JSON object, as log shippers expect. Fields whose value is
None are left out: `worker_healthy` says nothing by adding `error=None`.
"""

from __future__ import annotations

import logging
import sys

import orjson
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from mineru_gateway.config import LogFormat


def drop_none(_logger: WrappedLogger, _name: str, event: EventDict) -> EventDict:
    """Removes the fields that hold None."""
    return {key: value for key, value in event.items() if value is not None}


def _shared() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        drop_none,
    ]


def configure_logging(level: str, log_format: LogFormat) -> None:
    renderer: Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory: WrappedLogger = structlog.BytesLoggerFactory(sys.stderr.buffer)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    numeric = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[*_shared(), structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    _route_standard_logging(numeric, log_format)


def _route_standard_logging(level: int, log_format: LogFormat) -> None:
    """The root logger's one handler renders records as structlog renders its events."""
    renderer: Processor = (
        structlog.processors.JSONRenderer()  # ProcessorFormatter needs text, not orjson's bytes
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_logger_name,
            *_shared(),
            structlog.processors.format_exc_info,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
