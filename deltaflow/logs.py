"""deltaflow's logs: events with stable names and fields, as text for people or one JSON
object a line for collectors (``--log-format json``).

An event is a log record with ``extra={"event": name, "fields": {...}}``; :func:`event` makes
one. The names and their fields are listed in ``docs/operations.md``; a field never holds a
secret (callers pass identities, counts and codes, never tokens or storage options).
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import sys
from typing import Any, Final, Literal, TextIO

__all__ = ["JsonFormatter", "TextFormatter", "configure", "event", "printable"]

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
    """The message, then an event's fields as ``name=value``; a record is one line (its
    traceback, if any, on the lines after it, indented).

    A record's text may hold wire values (a refused stream id, a table name), so none can
    start a line of its own: the message's control characters are escaped (:func:`printable`),
    a field's value holding whitespace, a quote or a control character is written as a JSON
    string with every control character escaped, and a traceback's lines are indented.
    """

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = copy.copy(record)  # other handlers see the record as it was
        line.msg, line.args = printable(record.getMessage()), None
        line.exc_info, line.exc_text, line.stack_info = None, None, None
        text = super().format(line)
        fields = getattr(record, "fields", None)
        if fields:
            text += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
        if record.exc_info:
            text += "\n" + _indented(self.formatException(record.exc_info))
        elif record.exc_text:
            text += "\n" + _indented(record.exc_text)
        if record.stack_info:
            text += "\n" + _indented(self.formatStack(record.stack_info))
        return text


def printable(text: str) -> str:
    """``text`` with every character that is not printable (newline, tab, ESC, the other C0
    and C1 controls, DEL, Unicode's line and paragraph separators, format characters, spaces
    other than " ") written as an escape: ``\\n``, ``\\t``, ``\\r``, ``\\x1b``, ``\\u2028``.
    Such text cannot break a line, nor drive a terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _ESCAPES.get(c) or _escape(c) for c in text)


_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    n = ord(char)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _indented(text: str) -> str:
    """A traceback's lines, each escaped and indented: an exception's message from the wire
    cannot pass for a record."""
    return "\n".join("    " + printable(line) for line in text.splitlines())


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    text = str(value)
    if text and text.isprintable() and " " not in text and '"' not in text:
        return text
    # A JSON string, its controls escaped (json leaves DEL, C1 and U+2028 as they are).
    quoted = json.dumps(text, ensure_ascii=False)
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in quoted)


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
