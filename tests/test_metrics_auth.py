"""/metrics behind a bearer token (metrics.bearer_token_file), and the warning for a
non-loopback address without one."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gossipd.ops.metrics import DaemonCollector
from gossipd.ops.metrics_server import is_loopback, serve_metrics
from gossipd.tools.launcher import free_tcp_port
from tests.helpers import scrape


def _status(port: int, authorization: str | None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        return urllib.request.urlopen(request, timeout=5).status  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:
        return exc.code


def test_metrics_without_the_bearer_token_get_401_and_are_counted(
    daemon_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "metrics.token"
    token_file.write_text("s3cret-token\n")
    port = free_tcp_port()
    daemon_factory(f"metrics.bind=127.0.0.1:{port}", f"metrics.bearer_token_file={token_file}")
    assert _status(port, None) == 401
    assert _status(port, "Bearer wrong") == 401
    assert _status(port, "s3cret-token") == 401  # not a bearer header
    assert _status(port, "Bearer s3cret-token") == 200
    metrics = scrape(port, token="s3cret-token")
    assert metrics["gossipd_metrics_unauthorized_requests_total"] == 3
    assert "gossipd_tasks_pending" in metrics


def test_an_empty_token_file_stops_start_up_with_one_line(tmp_path: Path) -> None:
    from tests.helpers import gossipd_cli

    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    done = gossipd_cli(
        "run",
        "--set",
        "gossip.bind=",
        "--set",
        f"ingress.bind=tcp://127.0.0.1:{free_tcp_port()}",
        "--set",
        f"fanout.rpc_bind=tcp://127.0.0.1:{free_tcp_port()}",
        "--set",
        f"metrics.bind=127.0.0.1:{free_tcp_port()}",
        "--set",
        f"metrics.bearer_token_file={empty}",
        timeout_s=30,
    )
    assert done.returncode == 2
    assert "metrics.bearer_token_file" in done.stderr and "empty" in done.stderr


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("10.0.0.5", False),
        ("[::]", False),
        ("node1.example", False),
    ],
)
def test_is_loopback_table(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_non_loopback_bind_without_a_token_logs_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    collector = DaemonCollector("n", lambda: {})
    with caplog.at_level(logging.WARNING, logger="gossipd.ops.metrics"):
        serve_metrics("127.0.0.1:0", collector)
        assert not caplog.records
        serve_metrics("0.0.0.0:0", collector, token="t")
        assert not caplog.records
        serve_metrics("0.0.0.0:0", collector)
    (record,) = caplog.records
    assert "non-loopback" in record.getMessage() and "bearer_token_file" in record.getMessage()
