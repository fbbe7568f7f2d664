"""Structured logs: key=value text or JSON lines, with the fields a call carries. No secrets:
upstreams are named by index, and nothing logs a request body or an upstream URL."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

FIELDS = ("request_id", "network", "method", "outcome", "cache", "upstream_ms")


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {f: getattr(record, f) for f in FIELDS if getattr(record, f, None) is not None}


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
        return orjson.dumps(entry).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        return line + "".join(f" {k}={v}" for k, v in extras.items()) if extras else line


def setup(fmt: str, level: str, access_log: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # One line per call is opt-in: at thousands of calls a second it is the dearest thing we do.
    logging.getLogger("proxy.access").setLevel(logging.INFO if access_log else logging.WARNING)
