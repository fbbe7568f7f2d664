"""Structured logs: key=value text or JSON lines, with the fields a call carries. No secrets:
upstreams are named by index, nothing logs a request body or an upstream URL, and any URL's
credentials that reach a line anyway (a library's message) are cut."""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

FIELDS = (
    "request_id",
    "key",
    "client",
    "status",
    "network",
    "method",
    "path",
    "outcome",
    "cache",
    "total_ms",
    "upstream_ms",
)
# An API key is the path segment after /v3/ (in any case, after any slashes); it is cut from every
# value of a line before the line is written, whoever wrote it (aiohttp quotes a malformed request
# line, key included, in its own error), up to the next `/`, space, `?` or `#`: a key may hold quotes.
_KEY_SEGMENT = re.compile(r"(/v3/+)[^/\s?#]+", re.IGNORECASE)


# A URL's credentials (`redis+sentinel://user:password@h1:26379,h2:26379/...`, whatever the scheme
# and however many hosts): up to the last `@` before the path, since a password may hold an `@`.
_URL_CREDENTIALS = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s]*@")


def redacted(text: str) -> str:
    """Text fit for a log line: every /v3/<key> segment and every URL's credentials replaced, so no
    secret is written."""
    if "/v3/" in text or "/V3/" in text:
        text = _KEY_SEGMENT.sub(r"\1<key>", text)
    if "@" in text and "://" in text:
        text = _URL_CREDENTIALS.sub(r"\1<credentials>@", text)
    return text


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {f: getattr(record, f) for f in FIELDS if getattr(record, f, None) is not None}


def _redacted_values(fields: dict[str, Any]) -> dict[str, Any]:
    """Each text value redacted before the line is written (a key in the written line, escaped, could
    not be told from what follows it)."""
    return {k: redacted(v) if type(v) is str else v for k, v in fields.items()}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return printable(orjson.dumps(_redacted_values(entry)).decode())


# A logfmt value that needs no quotes: printable ASCII but space, `"`, `=` and `\`.
_BARE = re.compile(r"[\x21\x23-\x3c\x3e-\x5b\x5d-\x7e]+")  # fullmatch: `$` would let a last \n through
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code > 0xFFFF:  # as JSON writes it: a surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def printable(encoded: str) -> str:
    """A JSON text with every character outside printable ASCII as its \\uNNNN escape (orjson escapes
    only those below 0x20): a client's DEL, C1 control (a terminal's CSI, \\x9b) or any non-ASCII
    character reaches no log reader raw, and the text still decodes to the same value."""
    if encoded.isascii() and encoded.isprintable():
        return encoded
    return _UNPRINTABLE.sub(_escaped, encoded)


def logfmt_value(value: object) -> str:
    """One logfmt value: bare when it is printable ASCII that needs no quotes, else a double-quoted
    string with JSON escapes (every character outside printable ASCII escaped), so a multi-line
    message or traceback stays on its one line and no control character reaches a terminal."""
    text = str(value)
    return text if _BARE.fullmatch(text) else printable(orjson.dumps(text).decode())


class TextFormatter(logging.Formatter):
    """key=value (logfmt) lines: ts, level, logger, msg, then the call fields and any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return " ".join(f"{k}={logfmt_value(v)}" for k, v in _redacted_values(fields).items())

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}Z"


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def line(fmt: str, level: int, msg: str, logger: str = "rpc-proxy") -> str:
    """One log line in `fmt` without configuring logging: the CLI's own lines (a configuration
    error, before settings exist) look like every other line."""
    return formatter(fmt).format(logging.LogRecord(logger, level, __file__, 0, msg, None, None))


class ClientErrors(logging.Filter):
    """aiohttp logs a malformed request (a bad request line or header) as an ERROR with a traceback:
    one per bad client request, a flood. It is the client's fault: a DEBUG one-liner at most."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            return False
        record.msg, record.args, record.exc_info, record.exc_text = (
            "malformed HTTP request from a client: %s",
            (type(exc).__name__,),
            None,
            None,
        )
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


class ClientProtocols(logging.Filter):
    """aiohttp logs a WebSocket client's subprotocols word for word, at WARNING, whenever none is one
    the server offers (this proxy offers none): a browser client may carry its token there, as a
    browser cannot set a header on a WebSocket. A DEBUG line without them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("%s: Client protocols"):
            return True
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            return False
        record.msg, record.args = "a WebSocket client's subprotocols were not taken (none is offered)", None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def setup(fmt: str, level: str, access_log: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    # Every line goes through this one handler: the proxy's, aiohttp's, asyncio's and any library's
    # (their loggers propagate to the root), and Python warnings too.
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientErrors) for f in server.filters):
        server.addFilter(ClientErrors())
    websocket = logging.getLogger("aiohttp.websocket")
    if not any(isinstance(f, ClientProtocols) for f in websocket.filters):
        websocket.addFilter(ClientProtocols())
    # One line per call is opt-in: at thousands of calls a second it is the dearest thing we do.
    logging.getLogger("proxy.access").setLevel(logging.INFO if access_log else logging.WARNING)


class Throttled:
    """A repeated warning logged at most once per `interval` seconds per key, saying how many were
    suppressed: an outage or a flood of bad clients costs a few lines a minute, not one per event.

    Keys are the caller's fixed strings (an upstream's index, a Redis operation), never client data.
    """

    def __init__(
        self, logger: logging.Logger, interval: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: Any) -> bool:
        return self.log(logging.ERROR, key, msg, *args)

    def log(self, level: int, key: str, msg: str, *args: Any) -> bool:
        """Log it unless its key was logged less than the interval ago; whether it was logged."""
        now = self._clock()
        if now < self._next.get(key, 0.0):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        suppressed = self._suppressed.pop(key, 0)
        self._next[key] = now + self._interval
        if suppressed:
            msg += " (%d more like this in the last %gs)"
            args = (*args, suppressed, self._interval)
        self._logger.log(level, msg, *args)
        return True
