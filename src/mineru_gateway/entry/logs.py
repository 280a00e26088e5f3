"""Log output, configured once at the program's edge (the CLI); code only calls the loggers."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog

from mineru_gateway.config import LogFormat


def configure_logging(level: str, log_format: LogFormat) -> None:
    renderer: structlog.types.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory: structlog.types.WrappedLogger = structlog.BytesLoggerFactory(sys.stderr.buffer)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
