"""The election's etcd error log: once per kind of error per outage, a summary while it lasts,
and one line with the count when etcd answers again (docs/OPERATIONS.md, "Leader election").

While etcd is unreachable the election retries after 0.1 s doubling to 2 s (backoff.py) and
its keepalive as often or every TTL/3, and the two loops fail with different errors (a gRPC UNAVAILABLE, a timeout), whose texts also
vary (addresses, the last connect error).  Logging each change of text logged ~260 lines in
15 s (issue 24).  A kind is the exception's type and, for gRPC, its status code; its first
text is the one logged.  ``gossipd_etcd_errors_total`` still counts every failed call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

SUMMARY_S = 60.0  # while an outage lasts, one summary line this often


def error_kind(exc: BaseException) -> str:
    """What makes two errors the same kind: the type, and a gRPC error's status code."""
    kind = type(exc).__name__
    if isinstance(exc, grpc.aio.AioRpcError):
        kind += f" {exc.code().name}"
    return kind


class EtcdErrorLog:
    """Counts one outage (from the first failed call to the next success) and logs it."""

    def __init__(self, log: logging.Logger, monotonic: Callable[[], float]) -> None:
        self._log = log
        self._monotonic = monotonic
        self.kinds: dict[str, int] = {}  # this outage's failed calls, by kind
        self._since = 0.0
        self._summary_at = 0.0
        self._summarised = 0

    @property
    def failing(self) -> bool:
        return bool(self.kinds)

    def failed(self, exc: BaseException) -> None:
        now = self._monotonic()
        if not self.kinds:
            self._since = now
            self._summary_at = now + SUMMARY_S
            self._summarised = 0
        kind = error_kind(exc)
        count = self.kinds.get(kind, 0)
        self.kinds[kind] = count + 1
        if count == 0:
            text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            self._log.warning("etcd unreachable or refusing (retrying): %s", text)
        elif now >= self._summary_at:
            self._summary_at = now + SUMMARY_S
            total = sum(self.kinds.values())
            self._log.warning(
                "etcd still unreachable after %.0f s: %d failed calls (%d since the last line; %s)",
                now - self._since,
                total,
                total - self._summarised,
                self._kinds_text(),
            )
            self._summarised = total

    def cleared(self) -> None:
        if not self.kinds:
            return
        self._log.info(
            "etcd reachable again after %.1f s: %d failed calls (%s)",
            self._monotonic() - self._since,
            sum(self.kinds.values()),
            self._kinds_text(),
        )
        self.kinds = {}

    def _kinds_text(self) -> str:
        return ", ".join(f"{k} x{n}" for k, n in sorted(self.kinds.items()))
