"""The Prometheus HTTP endpoint: the /metrics server thread and its bearer-token guard
(with the count of refused requests)."""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import ThreadingWSGIServer

from gossipd.ops.logs import RateLimiter
from gossipd.ops.metric_families import C, _one
from gossipd.ops.metrics import DaemonCollector
from gossipd.ops.tcpdefaults import LISTEN_BACKLOG
from gossipd.security import is_loopback_host as is_loopback  # one rule for both

# The logger keeps the name it had before the split out of metrics.py (JSON logs name it).
log = logging.getLogger("gossipd.ops.metrics")


class MetricsGuard:
    """The bearer-token check in front of /metrics (empty token: none asked).  Runs in the
    HTTP server's threads; ``unauthorized`` is a plain int (one writer at a time under the
    GIL is enough for a counter read at scrape time)."""

    def __init__(self, token: str = "") -> None:
        self._expected = f"Bearer {token}".encode() if token else b""
        self.unauthorized = 0
        self._log = RateLimiter(per_s=1.0, burst=5)

    def allows(self, authorization: str) -> bool:
        if not self._expected:
            return True
        if hmac.compare_digest(authorization.encode("latin-1", "replace"), self._expected):
            return True
        self.unauthorized += 1
        if self._log.allow():
            log.warning(
                "refused a metrics request without the bearer token",
                extra={"suppressed_since_last": self._log.take_suppressed()},
            )
        return False

    def collect(self) -> Iterator[Metric]:
        yield _one(
            C,
            "gossipd_metrics_unauthorized_requests",
            "Metrics requests refused with 401 (no or wrong bearer token)",
            self.unauthorized,
        )


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


def serve_metrics(
    bind: str, collector: DaemonCollector, *, token: str = ""
) -> tuple[CollectorRegistry, int]:
    """Start the HTTP endpoint (a daemon thread); returns the registry and the bound port.
    With ``token``, a request without "Authorization: Bearer <token>" gets 401 (counted in
    ``gossipd_metrics_unauthorized_requests_total``).  A non-loopback address without a token
    is served, with a warning."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if not token and not is_loopback(host):
        log.warning(
            "metrics are served on a non-loopback address without a bearer token: anyone who "
            "can reach it reads them; bind metrics.bind to 127.0.0.1 or set "
            "metrics.bearer_token_file",
            extra={"bind": bind},
        )
    registry = CollectorRegistry()
    registry.register(collector)
    guard = MetricsGuard(token)
    registry.register(guard)
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if guard.allows(environ.get("HTTP_AUTHORIZATION", "")):
            return metrics_app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="gossipd"')],
        )
        return [b"401: send the header Authorization: Bearer <metrics.bearer_token_file>\n"]

    family = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family
        request_queue_size = LISTEN_BACKLOG  # (socketserver's default is 5)

    server = make_server(host, int(port), app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return registry, server.server_address[1]
