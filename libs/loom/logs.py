"""One log format for every service: time, level, service, message, then key=value pairs."""

from __future__ import annotations

import logging
import sys


class _Formatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = self.formatTime(record, "%H:%M:%S")
        line = f"{ts}.{int(record.msecs):03d} {record.levelname:<7} {self.service:<9} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
