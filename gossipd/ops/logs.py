"""Structured logs: one JSON object per line (or plain text), and a rate limiter for the
lines about refused input, so a flood of garbage cannot flood the log (counters count all).

vLLM's own records go through the same formatter (``route_vllm_logs``): vLLM applies the
logging dictConfig file named by VLLM_LOGGING_CONFIG_PATH in each of its processes (this one
and its engine-core children), so the file we write there hands its "vllm" logger to our
handler everywhere; plain text from vLLM would otherwise be most of a daemon's log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self._node = node

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "node": self._node,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What setup_logging was last called with (level, format, node): route_vllm_logs uses it.
_settings: tuple[str, str, str] | None = None


def setup_logging(*, level: str, fmt: str, node: str) -> None:
    global _settings
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(node))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # Python warnings (torch's, vLLM's) as records too
    _settings = (level, fmt, node)


def log_format() -> str | None:
    """The format setup_logging set ("json" or "text"), None before it was called."""
    return None if _settings is None else _settings[1]


# Set by route_vllm_logs for vLLM's engine processes (children started with spawn): they
# import gossipd (their parent's main module) before vLLM, and gossipd/__init__.py then calls
# follow_parent_logging, so what vLLM logs while it is imported there is formatted too.
CHILD_LOGGING_ENV = "GOSSIPD_CHILD_LOGGING"


def follow_parent_logging(environ: dict[str, str] | None = None) -> bool:
    """In a child process of a daemon: set up logging as the daemon did (CHILD_LOGGING_ENV,
    which only a daemon's descendants inherit).  True when it did."""
    env = os.environ if environ is None else environ
    raw = env.get(CHILD_LOGGING_ENV, "")
    if not raw:
        return False
    try:
        level, fmt, node = json.loads(raw)
    except (ValueError, TypeError):
        return False
    setup_logging(level=str(level), fmt=str(fmt), node=str(node))
    return True


def vllm_logging_config(*, level: str, fmt: str, node: str) -> dict[str, object]:
    """A logging dictConfig that sends the "vllm" logger's records to stderr through our
    formatter (JSON lines, or our text format)."""
    formatter: dict[str, object] = (
        {"()": "gossipd.ops.logs.JsonFormatter", "node": node}
        if fmt == "json"
        else {"format": TEXT_FORMAT}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"gossipd": formatter},
        "handlers": {
            "gossipd": {
                "class": "logging.StreamHandler",
                "formatter": "gossipd",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {"vllm": {"handlers": ["gossipd"], "level": level.upper(), "propagate": False}},
    }


def route_vllm_logs(environ: dict[str, str] | None = None) -> str | None:
    """Before vLLM is imported: write ``vllm_logging_config`` (with setup_logging's settings)
    to a file and point VLLM_LOGGING_CONFIG_PATH at it, for this process and the engine
    processes it starts.  Nothing when setup_logging was not called (a library user's logging
    is theirs), or when the operator set VLLM_LOGGING_CONFIG_PATH or VLLM_CONFIGURE_LOGGING=0
    (their choice wins).  With JSON logs, tqdm's progress bars (vLLM loading a model) are off
    too (TQDM_DISABLE=1, unless set).  Returns the file's path, or None."""
    env = os.environ if environ is None else environ
    if _settings is None or env.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return None
    if env.get("VLLM_LOGGING_CONFIG_PATH"):
        return None
    level, fmt, node = _settings
    if fmt == "json":
        env.setdefault("TQDM_DISABLE", "1")
    env[CHILD_LOGGING_ENV] = json.dumps([level, fmt, node])
    fd, path = tempfile.mkstemp(prefix="gossipd-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(vllm_logging_config(level=level, fmt=fmt, node=node), fh)
    atexit.register(_remove, path)
    env["VLLM_LOGGING_CONFIG_PATH"] = path
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# Handlers of incoming messages that raised (a bug in this process: each is logged, rate
# limited, and the reader goes on), by handler; exported as gossipd_handler_failures_total.
# Per process, as the log is: one daemon a process in production.
HANDLER_FAILURES: Counter[str] = Counter()


def handler_name(handler: object) -> str:
    """What HANDLER_FAILURES calls ``handler``: its qualified name (a partial's function's)."""
    func = getattr(handler, "func", handler)
    name = str(getattr(func, "__qualname__", type(handler).__name__))
    return name.rpartition("<locals>.")[2]  # (a function's own classes and closures)


def note_handler_failure(where: str, logger: logging.Logger, what: str) -> None:
    """Count a failure of handler ``where`` and log it with its traceback (call it in the
    ``except``), at most a few a second for all handlers together."""
    HANDLER_FAILURES[where] += 1
    if _HANDLER_LOG.allow():
        logger.exception("%s failed; the rest go on", what, extra={"handler": where})


class RateLimiter:
    """Token bucket: ``allow()`` is true at most ``per_s`` times a second (burst ``burst``).
    ``suppressed`` counts the denials since the last allowed call, to report them then."""

    def __init__(self, per_s: float, burst: int = 10, clock: object = time.monotonic) -> None:
        self._per_s = per_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._last = clock()  # type: ignore[operator]
        self.suppressed = 0

    def allow(self) -> bool:
        now = self._clock()  # type: ignore[operator]
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        """The denials since the last allowed line, which is being written now (its
        ``suppressed_since_last``); counting starts again."""
        suppressed, self.suppressed = self.suppressed, 0
        return suppressed


_HANDLER_LOG = RateLimiter(per_s=1.0, burst=5)  # note_handler_failure's log lines
