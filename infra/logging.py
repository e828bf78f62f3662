"""One logging set-up for every Fulmen process: text for people, JSON lines for log pipelines."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from fulmen.infra.settings import LogSettings

__all__ = ["setup_logging"]

_TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_NOISY = ("aiokafka", "kafka", "urllib3", "httpx", "httpcore", "filelock", "asyncio")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _TransientKafkaNoise(logging.Filter):
    """aiokafka logs ERROR while a fresh broker elects its group coordinator, which resolves itself within
    a second; keep that at DEBUG so a real error stands out."""

    _TRANSIENT = ("GroupCoordinatorNotAvailableError", "NotCoordinatorForGroupError")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and any(t in record.getMessage() for t in self._TRANSIENT):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def setup_logging(settings: LogSettings | None = None) -> None:
    """Configure the root logger once per process (calling it again replaces the handlers)."""
    settings = settings or LogSettings()
    handler: logging.Handler
    if settings.file is not None:
        settings.file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(settings.file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if settings.format == "json" else logging.Formatter(_TEXT_FORMAT))
    handler.addFilter(_TransientKafkaNoise())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.level)
    quiet = logging.WARNING if settings.level != "DEBUG" else logging.INFO
    for name in _NOISY:
        logging.getLogger(name).setLevel(quiet)
