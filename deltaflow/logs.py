"""deltaflow's logs: events with stable names and fields, as text for people or one JSON
object a line for collectors (``--log-format json``).

An event is a log record with ``extra={"event": name, "fields": {...}}``; :func:`event` makes
one. The names and their fields are listed in ``docs/operations.md``; a field never holds a
secret (callers pass identities, counts and codes, never tokens or storage options).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, Final, Literal, TextIO

__all__ = ["JsonFormatter", "TextFormatter", "configure", "event"]

LogFormat = Literal["text", "json"]
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def event(
    logger: logging.Logger, name: str, message: str, *, level: int = logging.INFO, **fields: Any
) -> None:
    """Log the event ``name`` (such as ``commit``) with ``message`` for people and ``fields``
    for machines."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"event": name, "fields": fields})


class TextFormatter(logging.Formatter):
    """The message, then an event's fields as ``name=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
        return text


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``event``
    (None for a plain message), ``message``, the event's fields, and ``error`` with the
    exception's type and text when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None),
            "message": record.getMessage(),
        }
        for key, value in (getattr(record, "fields", None) or {}).items():
            out.setdefault(key, value)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            out["error"] = {"type": type(exc).__name__, "message": str(exc)}
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(
    level: str = "warning", log_format: LogFormat = "text", stream: TextIO | None = None
) -> None:
    """Send deltaflow's (and Python libraries') logs to ``stream`` (stderr) at ``level``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiohttp's access log would say every /metrics scrape at INFO.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
