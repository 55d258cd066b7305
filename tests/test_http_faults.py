"""The HTTP door where things go wrong or security is on (real daemons, echo engine): an owner
SIGKILLed mid-task (the entry migrates the task and the client still gets its whole answer),
a client that does not read its stream (cancelled at the byte bound), CURVE on every socket
(the owner's answers reach the door's reply socket), TLS on the door."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq

from gossipd.core.messages import Result, encode
from gossipd.core.ring import Ring
from simulations.cluster import Cluster
from tests.helpers import running, scrape, wait_until

HTTP = 'http.bind="127.0.0.1:0"'
METRICS = 'metrics.bind="127.0.0.1:0"'


def _session_owned_by(names: list[str], member: str) -> str:
    ring = Ring({n: 1.0 for n in names})
    return next(k for k in (f"s-{i}" for i in range(1000)) if ring.owner(k) == member)


@pytest.fixture
def trio(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = Cluster(
        3, log_dir=str(tmp_path), extra_overrides=[HTTP, METRICS, "engine.token_delay_s=0.05"]
    )
    with running(c):
        yield c


def _stream_owned_by(trio: Cluster, owner: Any, max_tokens: int) -> Any:
    """A completion streamed through the first daemon's door, keyed to ``owner``."""
    client = openai.OpenAI(
        base_url=f"{trio.daemons[0].http_url}/v1", api_key="none", max_retries=0, timeout=60
    )
    return client.completions.create(
        model="echo",
        prompt="one two three",
        max_tokens=max_tokens,
        stream=True,
        extra_headers={
            "x-session-id": _session_owned_by([d.name for d in trio.daemons], owner.name)
        },
    )


def test_an_owner_killed_mid_task_does_not_lose_the_clients_answer(trio: Cluster) -> None:
    entry, owner, _other = trio.daemons
    stream = _stream_owned_by(trio, owner, 60)  # 3 s at 0.05 s a token
    chunks = iter(stream)
    first = next(chunks)
    owner.kill()  # SIGKILL: no goodbye, its engine and its answer are gone
    rest = list(chunks)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    words = text.split()
    assert len(words) == 60 and words[:3] == ["one", "two", "three"], text
    assert rest[-1].choices[0].finish_reason == "length"
    migrated = scrape(entry.metrics_port).get("gossipd_fanout_migrated_total", 0)
    assert migrated >= 1, "the entry moved the task off the dead owner"


def test_a_client_gone_while_its_owner_is_dying_leaves_nothing_running(trio: Cluster) -> None:
    """The client gives up on a stream stalled by its owner's death before membership
    declares the owner dead: the door's Cancel goes to a dead address, and the death then
    migrated the task, whose copy ran its 40 s of tokens for nobody (found by a review).
    The forwarder now remembers the Cancel: the death ends the task, answered cancelled."""
    entry, owner, other = trio.daemons
    stream = _stream_owned_by(trio, owner, 800)  # 40 s at 0.05 s a token
    next(iter(stream))
    # SIGSTOP, then SIGKILL below: the stream stalls, and the owner is dead to the entry only
    # once membership says so (seconds).  A SIGKILL's refused port told the members within
    # milliseconds, at times before the door saw the client gone: the task was then migrated
    # first, and its Cancel went to the new owner (CI at 2d35d66).
    owner.pause()
    stream.close()  # ...and the client gives up on it
    wait_until(
        lambda: scrape(entry.metrics_port)["gossipd_http_cancels_total{why=disconnect}"] == 1,
        10,
        "the door to see the client gone",
    )
    wait_until(
        lambda: scrape(entry.metrics_port)["gossipd_fanout_cancelled_not_migrated_total"] == 1,
        20,
        "the entry to declare the owner dead and end the cancelled task",
    )
    owner.kill()  # (stopped: a SIGTERM would wait for it)
    assert scrape(entry.metrics_port).get("gossipd_fanout_migrated_total", 0) == 0
    for d in (entry, other):
        assert scrape(d.metrics_port)["gossipd_tasks_running"] == 0, d.name


def test_a_client_that_does_not_read_its_stream_is_cut_at_the_byte_bound(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory(HTTP, METRICS, "http.stream_buffer_bytes_max=65536")
    port = int(d.http_url.rsplit(":", 1)[1])
    word = "w" * 50_000  # one token is a 50 KB delta: megabytes a second, never read
    body = json.dumps(
        {"model": "echo", "prompt": word, "max_tokens": 2000, "stream": True}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until(
            lambda: scrape(d.metrics_port).get("gossipd_http_cancels_total{why=slow_client}") == 1,
            20,
            "the door to give up on the client",
        )
        metrics = scrape(d.metrics_port)
        assert metrics["gossipd_cancels_total{outcome=here}"] == 1, "its task cancelled"
        assert metrics["gossipd_http_pending"] == 0
    finally:
        sock.close()
    # The daemon serves the next client as before.
    client = openai.OpenAI(base_url=f"{d.http_url}/v1", api_key="none", max_retries=0)
    assert client.completions.create(model="echo", prompt="after", max_tokens=1).choices[0].text


def test_under_curve_a_forwarded_requests_answer_reaches_the_door(tmp_path: Path) -> None:
    c = Cluster(2, log_dir=str(tmp_path), curve=True, extra_overrides=[HTTP, METRICS])
    with running(c):
        entry, owner = c.daemons
        client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
        session = _session_owned_by([d.name for d in c.daemons], owner.name)
        raw = client.completions.with_raw_response.create(
            model="echo", prompt="sealed", max_tokens=2, extra_headers={"x-session-id": session}
        )
        assert raw.headers["x-gossipd-member"] == owner.name
        assert raw.parse().choices[0].text == "sealed sealed"
        # Relayed back on the entry's own connection: the route carries the entry's own key.
        owner_metrics = scrape(owner.metrics_port)
        assert owner_metrics["gossipd_fanout_replies_relayed_total"] >= 1
        assert owner_metrics["gossipd_fanout_relays_refused_total"] == 0
        # A stranger without a member's key cannot push answers into the door's socket:
        # CURVE refuses its connection, so nothing it sends is read (not even as unknown).
        reply_to = next(e["http_replies"] for e in entry.events() if e.get("msg") == "serving")
        stranger = zmq.Context.instance().socket(zmq.PUSH)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(reply_to)
        stranger.send(encode(Result(id="http-forged-1", ok=True, text="forged")), zmq.NOBLOCK)
        time.sleep(1.0)  # what would arrive has by now: nothing must
        stranger.close()
        metrics = scrape(entry.metrics_port)
        assert metrics["gossipd_http_replies_unknown_total"] == 0
        assert metrics["gossipd_http_replies_invalid_total"] == 0
        # The other member's max_model_len comes over the CURVE connection too (ModelCard).
        with urllib.request.urlopen(f"{entry.http_url}/v1/models", timeout=10) as response:
            listed = {m["id"]: m["max_model_len"] for m in json.loads(response.read())["data"]}
        assert list(listed) == ["echo"]
        wait_until(
            lambda: (
                scrape(entry.metrics_port).get("gossipd_model_cards_total{outcome=answered}") == 1
            ),
            5,
            "the owner's ModelCard",
        )


def test_the_door_serves_tls_when_given_a_certificate(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    d = daemon_factory(
        HTTP,
        f'http.tls_cert_file="{cert}"',
        f'http.tls_key_file="{key}"',
        'log.level="info"',
        "http.idle_timeout_s=1",
        "http.connections_max=3",
        METRICS,
    )
    url = d.http_url.replace("http://", "https://")
    client = openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        max_retries=0,
        http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))),
    )
    assert client.completions.create(model="echo", prompt="secret", max_tokens=1).choices[0].text
    with pytest.raises(openai.APIConnectionError):  # a client that trusts no such certificate
        openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).models.list()
    started = time.monotonic()
    plain = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)
    plain.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    answer = plain.recv(100)
    plain.close()
    assert not answer.startswith(b"HTTP/1.1 200"), "plain HTTP is not served on a TLS door"
    assert time.monotonic() - started < 5
    # A client that never shakes hands holds no connection past http.idle_timeout_s.
    silent = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
    started = time.monotonic()
    assert silent.recv(100) == b""
    silent.close()
    assert 0.5 < time.monotonic() - started < 5
    # Connections in their handshake count against http.connections_max (a stalled
    # ClientHello holds ~0.4 MiB): with 3 stalled, a 4th is closed at once, and once they
    # time out a client is served again.
    port = int(url.rsplit(":", 1)[1])
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    for sock in stalled:
        sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello's start
    wait_until(lambda: scrape(d.metrics_port)["gossipd_http_connections_open"] == 3, 5, "3 counted")
    fourth = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert fourth.recv(100) == b"", "a 4th connection is closed at once"
    fourth.close()
    for sock in stalled:  # closed at http.idle_timeout_s (reset: its bytes were unread)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(100) == b""
        sock.close()
    assert client.completions.create(model="echo", prompt="again", max_tokens=1).choices[0].text
    metrics = scrape(d.metrics_port)
    assert metrics["gossipd_http_connections_refused_total"] >= 1
    assert metrics["gossipd_http_tls_handshakes_failed_total"] >= 5  # plain, silent, 3 stalled


def test_a_stopping_entry_answers_what_it_holds_and_cancels_the_rest(tmp_path: Path) -> None:
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[HTTP, METRICS, "engine.token_delay_s=0.05"],
        overrides_for=lambda i: ["lifecycle.shutdown_grace_s=1"] if i == 0 else [],
    )
    with running(c):
        entry, owner = c.daemons
        client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="echo",
            prompt="stop me",
            max_tokens=400,  # 20 s: longer than the entry's 1 s grace
            stream=True,
            extra_headers={"x-session-id": _session_owned_by([d.name for d in c.daemons],
                                                              owner.name)},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        started = time.monotonic()
        entry.terminate()
        with pytest.raises(openai.APIError) as ended:
            list(chunks)  # the last event is an error: shutting_down
        assert "stopped before the answer came" in str(ended.value)
        assert time.monotonic() - started < 8
        wait_until(
            lambda: scrape(owner.metrics_port).get("gossipd_cancels_total{outcome=here}") == 1,
            10,
            "the owner to cancel the task the stopped entry held",
        )
        assert entry.wait(15) == 0
        drained = next(e for e in entry.events() if e.get("msg") == "drained")
        assert drained["http_answers_cut"] == 1
