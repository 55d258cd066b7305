"""The HTTP door on real daemons with the echo engine: the wire (raw sockets: malformed,
oversized, pipelined), API keys and their revocation, forwarding to the owner and back,
cancel on disconnect, the door's own deadline, 429 with Retry-After honoured by the official
`openai` client's own retry (docs/PROTOCOL.md "HTTP")."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from simulations.cluster import Cluster
from tests.helpers import (
    gossipd_cli,
    key_owned_by,
    out_of_file_descriptors,
    running,
    scrape,
    wait_until,
)

HTTP = 'http.bind="127.0.0.1:0"'
METRICS = 'metrics.bind="127.0.0.1:0"'
KEY = "sk-test-0123456789abcdef"
# Token budgets of 40 tokens/s for the one producer, a burst of 1 s.
BUDGET_40_TOKENS_PER_S = (
    "budgets.enabled=true",
    "budgets.tokens_per_s_per_capacity=40",
    "budgets.default_share=1.0",
)


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _read_response(stream: Any) -> bytes:
    """One response with a content-length off a socket's file (status 200 asserted)."""
    assert stream.readline().startswith(b"HTTP/1.1 200 ")
    length = 0
    while (line := stream.readline()) != b"\r\n":
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return stream.read(length)  # type: ignore[no-any-return]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _body(n: int, prompt: str = "a b c") -> bytes:
    doc = json.dumps({"model": "echo", "prompt": prompt, "max_tokens": n}).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(doc), doc)
    )


def test_the_wire_refuses_bad_input_and_keeps_serving(daemon_factory: Any) -> None:
    d = daemon_factory(HTTP, METRICS, "http.body_bytes_max=2048")
    url = d.http_url
    port = _port(url)
    assert _raw(port, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    big = b"x" * 4096
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(big)
    answer = _raw(port, head + big)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"http.body_bytes_max" in answer
    huge_header = b"GET /health HTTP/1.1\r\nhost: t\r\nx-a: " + b"y" * 70_000 + b"\r\n\r\n"
    assert _raw(port, huge_header).startswith(b"HTTP/1.1 431 ")
    status, _, body = _post(f"{url}/v1/completions", {"model": "echo"})
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
    status, _, body = _post(f"{url}/v1/completions", {"model": "echo", "prompt": "x", "n": 0})
    assert status == 400 and json.loads(body)["error"]["param"] == "n"
    status, _, body = _post(f"{url}/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, _, _ = _post(f"{url}/v1/nowhere", {})
    assert status == 404
    # Three requests in one write: answered in order on the one connection.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_body(1, "one") + _body(1, "two") + _body(1, "three"))
        stream = sock.makefile("rb")
        texts = [json.loads(_read_response(stream))["choices"][0]["text"] for _ in range(3)]
    assert texts == ["one", "two", "three"]
    metrics = scrape(d.metrics_port)
    assert metrics["gossipd_http_bad_requests_total"] == 3
    assert metrics["gossipd_http_responses_total{status=404}"] == 2
    # Still serving after all that.
    status, _, body = _post(f"{url}/v1/completions", {"model": "echo", "prompt": "still here"})
    assert status == 200 and json.loads(body)["choices"][0]["text"].startswith("still")


def test_api_keys_are_asked_and_a_removed_key_is_refused_without_a_restart(
    daemon_factory: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "alice.key").write_text(KEY + "\n")
    (keys / "bob.key").write_text("sk-bob-fedcba9876543210\n")
    d = daemon_factory(HTTP, METRICS, f'http.keys_dir="{keys}"', "security.reload_interval_s=0.2")
    url = d.http_url
    body = {"model": "echo", "prompt": "hello"}
    assert _post(f"{url}/v1/completions", body)[0] == 401
    assert (
        _post(f"{url}/v1/completions", body, {"authorization": "Bearer wrong-key-123456"})[0] == 401
    )
    assert _post(f"{url}/v1/completions", body, {"authorization": f"Bearer {KEY}"})[0] == 200
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
        assert response.status == 200, "liveness needs no key"
    (keys / "alice.key").unlink()
    wait_until(
        lambda: _post(f"{url}/v1/completions", body, {"authorization": f"Bearer {KEY}"})[0] == 401,
        10,
        "alice's removed key to be refused",
    )
    ok = _post(f"{url}/v1/completions", body, {"authorization": "Bearer sk-bob-fedcba9876543210"})
    assert ok[0] == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-a-key-at-all", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="echo", prompt="x")
    metrics = scrape(d.metrics_port)
    assert metrics["gossipd_http_unauthorized_total"] >= 4
    # A request without a valid key holds no body here: read and dropped, answered 401.
    assert metrics["gossipd_http_bodies_dropped_total"] >= 3
    assert metrics["gossipd_http_read_bytes"] == 0


def test_a_request_whose_body_was_dropped_for_its_key_is_401_even_if_the_key_comes_meanwhile(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The body is dropped on the key's verdict at the head; a key provisioned (and
    reloaded) before the body ends must not have the request served with no body (a 400
    about the body): it is the 401 PROTOCOL.md promises, and the same request sent again
    is served."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "alice.key").write_text(KEY + "\n")
    d = daemon_factory(HTTP, f'http.keys_dir="{keys}"', "security.reload_interval_s=0.1")
    new = "sk-bob-fedcba9876543210"
    doc = {"model": "echo", "prompt": "hello", "max_tokens": 2}
    body = json.dumps(doc).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n" % (new.encode(), len(body))
    )
    bob = {"authorization": f"Bearer {new}"}
    with socket.create_connection(("127.0.0.1", _port(d.http_url)), timeout=10) as sock:
        sock.sendall(head)
        (keys / "bob.key").write_text(new + "\n")
        wait_until(
            lambda: _post(f"{d.http_url}/v1/completions", doc, bob)[0] == 200,
            10,
            "bob's key to be loaded",
        )
        sock.sendall(body)
        status_line = sock.makefile("rb").readline()
    assert status_line.startswith(b"HTTP/1.1 401 "), status_line
    assert _post(f"{d.http_url}/v1/completions", doc, bob)[0] == 200


def test_a_non_loopback_door_without_keys_or_tls_stops_start_up() -> None:
    done = gossipd_cli("check-config", "--set", 'http.bind="0.0.0.0:8000"')
    assert done.returncode == 2, done.stderr
    assert "http.keys_dir" in done.stderr and "TLS" in done.stderr


@pytest.fixture
def pair(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[HTTP, METRICS, "engine.token_delay_s=0.05"],
    )
    with running(c):
        yield c


def test_a_session_owned_elsewhere_is_forwarded_and_streams_back_through_the_entry(
    pair: Cluster,
) -> None:
    entry, owner = pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    session = key_owned_by(pair, owner.name)
    raw = client.completions.with_raw_response.create(
        model="echo", prompt="far away", max_tokens=3, extra_headers={"x-session-id": session}
    )
    assert raw.headers["x-gossipd-member"] == owner.name
    assert raw.parse().choices[0].text == "far away far"
    stream = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": "stream me"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-session-id": session},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "<|user|> stream me <|assistant|>"
    assert len({c.id for c in chunks}) == 1
    owner_metrics = scrape(owner.metrics_port)
    assert owner_metrics["gossipd_fanout_accepted_from_peers_total"] == 2
    # The answers came back on the entry's own connection to the owner (Forward.relay):
    # the Result of the first, the 4 chunks and the Result of the second, at least.
    assert owner_metrics["gossipd_fanout_replies_relayed_total"] >= 6
    assert scrape(entry.metrics_port)["gossipd_fanout_relayed_unroutable_total"] == 0


def test_a_client_that_disconnects_cancels_its_task_where_it_runs(pair: Cluster) -> None:
    entry, owner = pair.daemons
    client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="echo",
        prompt="long",
        max_tokens=2000,  # 100 s at 0.05 s a token
        stream=True,
        extra_headers={"x-session-id": key_owned_by(pair, owner.name)},
    )
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    wait_until(
        lambda: scrape(owner.metrics_port).get("gossipd_cancels_total{outcome=here}") == 1,
        10,
        "the owner to cancel the task",
    )
    assert scrape(entry.metrics_port)["gossipd_http_cancels_total{why=disconnect}"] == 1
    wait_until(
        lambda: scrape(owner.metrics_port)["gossipd_tasks_running"] == 0, 10, "the engine idle"
    )


def test_overload_is_429_with_retry_after_and_the_openai_client_retries(
    daemon_factory: Any,
) -> None:
    # A budget of 40 tokens/s with a 1 s burst: each request costs 2 + 30 tokens.
    d = daemon_factory(HTTP, METRICS, *BUDGET_40_TOKENS_PER_S)
    body = {"model": "echo", "prompt": "budget me", "max_tokens": 30}
    # The bucket may go into debt by one task (core/tokenbudgets.py): a few go through.
    answers = [_post(f"{d.http_url}/v1/completions", body) for _ in range(4)]
    assert answers[0][0] == 200
    status, headers, answer = next((a for a in answers if a[0] != 200), answers[-1])
    assert status == 429, answer
    error = json.loads(answer)["error"]
    assert error["code"] == "over_budget" and error["type"] == "rate_limit_error"
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0
    client = openai.OpenAI(base_url=f"{d.http_url}/v1", api_key="none", max_retries=4)
    started = time.monotonic()
    done = client.completions.create(model="echo", prompt="budget me", max_tokens=30)
    assert done.choices[0].text.startswith("budget")
    assert time.monotonic() - started >= 0.3, "the client waited as Retry-After said"
    assert scrape(d.metrics_port)["gossipd_http_responses_total{status=429}"] >= 2


def test_past_its_deadline_a_request_gets_504(daemon_factory: Any) -> None:
    d = daemon_factory(HTTP, METRICS, "engine.token_delay_s=0.1", "http.request_timeout_s=0.5")
    status, _, body = _post(
        f"{d.http_url}/v1/completions", {"model": "echo", "prompt": "slow", "max_tokens": 100}
    )
    assert status == 504, body
    assert json.loads(body)["error"]["code"] == "deadline_exceeded"


def test_a_chat_without_max_tokens_runs_to_the_models_context(daemon_factory: Any) -> None:
    """A chat that names no max_tokens gets http.chat_max_tokens_default within the model's
    context (here engine.max_model_len, which the echo engine does not stop at), or with 0
    the whole context, as OpenAI and `vllm serve`; completions keep OpenAI's 16."""
    d = daemon_factory(HTTP, "engine.max_model_len=40")
    chat = {"model": "echo", "messages": [{"role": "user", "content": "w"}]}
    status, _, body = _post(f"{d.http_url}/v1/chat/completions", chat)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 40
    status, _, body = _post(f"{d.http_url}/v1/chat/completions", {**chat, "max_tokens": 3})
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    status, _, body = _post(f"{d.http_url}/v1/completions", {"model": "echo", "prompt": "w"})
    assert json.loads(body)["usage"]["completion_tokens"] == 16
    # An unknown model: 404 with OpenAI's type for it
    status, _, body = _post(f"{d.http_url}/v1/chat/completions", {**chat, "model": "gpt-9"})
    error = json.loads(body)["error"]
    assert status == 404 and error["type"] == "invalid_request_error"
    assert error["code"] == "model_not_found"
    # a long context: http.chat_max_tokens_default (4096); 0: the whole context (at most
    # what a task carries)
    for overrides, tokens in (((), 4096), (("http.chat_max_tokens_default=0",), 32768)):
        long = daemon_factory(HTTP, "engine.max_model_len=100000", *overrides)
        status, _, body = _post(f"{long.http_url}/v1/chat/completions", chat)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == tokens


def test_models_health_and_readiness(daemon_factory: Any) -> None:
    d = daemon_factory(HTTP, METRICS)
    with urllib.request.urlopen(f"{d.http_url}/v1/models", timeout=10) as response:
        models = json.loads(response.read())
    assert [m["id"] for m in models["data"]] == ["echo"]
    assert set(models["data"][0]) >= {
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "max_model_len",
    }
    for path in ("/health", "/v1/health/ready"):
        with urllib.request.urlopen(f"{d.http_url}{path}", timeout=10) as response:
            assert response.status == 200
    with urllib.request.urlopen(f"{d.http_url}/metrics", timeout=10) as response:
        assert b"gossipd_http_requests_total" in response.read()
    # OpenAI's "retrieve model" (the official client's call): the card as listed, or 404.
    client = openai.OpenAI(base_url=f"{d.http_url}/v1", api_key="none", max_retries=0)
    card = client.models.retrieve("echo")
    assert (
        card.id == "echo"
        and card.model_extra["max_model_len"] == (models["data"][0]["max_model_len"])
    )
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/not-here")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    # x-request-id on a task's answer and on a 405 (with allow: POST).
    status, headers, _ = _post(
        f"{d.http_url}/v1/completions",
        {"model": "echo", "prompt": "a", "max_tokens": 1},
        {"x-request-id": "r-200"},
    )
    assert status == 200 and headers["x-request-id"] == "r-200"
    # without one: the response's id, which the openai client reads as _request_id
    raw = client.completions.with_raw_response.create(model="echo", prompt="a", max_tokens=1)
    assert raw.headers["x-request-id"] == raw.parse().id and raw.parse().id.startswith("cmpl-")
    answer = _raw(
        _port(d.http_url),
        b"GET /v1/completions HTTP/1.1\r\nhost: t\r\nx-request-id: r-405\r\nconnection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 405 ") and b"allow: POST\r\n" in answer
    assert b"x-request-id: r-405\r\n" in answer
    # The read paths take GET and HEAD only: 405 with allow: GET, HEAD (the health checks
    # answered 200 to any method); a path that is none of them stays 404.
    for path in (b"/health", b"/v1/health/ready", b"/v1/models", b"/v1/models/echo", b"/metrics"):
        answer = _raw(
            _port(d.http_url),
            b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\nconnection: close\r\n\r\n" % path,
        )
        assert answer.startswith(b"HTTP/1.1 405 "), (path, answer[:200])
        assert b"allow: GET, HEAD\r\n" in answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == (
            "invalid_request_error"
        )
    answer = _raw(
        _port(d.http_url), b"DELETE /nowhere HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 404 ")


def test_models_lists_every_members_model_and_requests_go_where_it_is_served(
    tmp_path: Path,
) -> None:
    """GET /v1/models at either member lists both models, each with the max_model_len of
    the member that serves it (asked of it by a ModelQuery), and a request naming the other
    member's model is served there."""
    served = {0: ("echo", 1024), 1: ("echo-b", 2048)}  # (model, max_model_len) a member
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[HTTP, METRICS],
        overrides_for=lambda i: [
            f'engine.served_model_name="{served[i][0]}"',
            f"engine.max_model_len={served[i][1]}",
        ],
    )
    want = {"echo": 1024, "echo-b": 2048}
    with running(c):
        entry = c.daemons[0]
        # Retrieve first, before any list asked for cards: it waits for the card it asks
        # for, as the list does (a member just joined: its length, not null).
        alive = "gossipd_members{state=alive}"
        wait_until(lambda: scrape(entry.metrics_port).get(alive) == 1, 30, "b alive at a")
        with urllib.request.urlopen(f"{entry.http_url}/v1/models/echo-b", timeout=10) as got:
            assert json.loads(got.read())["max_model_len"] == 2048
        for d in c.daemons:

            def cards(d: Any = d) -> dict[str, Any] | None:
                with urllib.request.urlopen(f"{d.http_url}/v1/models", timeout=10) as response:
                    data = json.loads(response.read())["data"]
                found = {m["id"]: m["max_model_len"] for m in data}
                return found if found == want else None

            wait_until(cards, 30, f"both models' max_model_len at {d.name}")
            counted = scrape(d.metrics_port)
            assert counted["gossipd_model_cards_total{outcome=answered}"] >= 1
            assert counted["gossipd_model_cards_total{outcome=refused}"] == 0
        client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
        raw = client.completions.with_raw_response.create(
            model="echo-b", prompt="served there", max_tokens=2
        )
        assert raw.headers["x-gossipd-member"] == c.daemons[1].name
        assert raw.parse().choices[0].text == "served there"


def test_the_wire_bounds_pipelining_idle_clients_and_answers_head_and_expect(
    daemon_factory: Any,
) -> None:
    d = daemon_factory(HTTP, METRICS, "http.idle_timeout_s=0.5")
    port = _port(d.http_url)
    # 40 tasks in one write: more than 16 waiting behind the first: the connection is
    # closed (the first's answer was under way: no 429 can be put before it).  40 health
    # checks in one write are each answered as read.
    assert _raw(port, _body(1) * 40).count(b"HTTP/1.1 200 ") < 40
    health = _raw(
        port,
        b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" * 39
        + b"GET /health HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n",
    )
    assert health.count(b"HTTP/1.1 200 ") == 40
    # A request never finished, and an idle connection: closed after idle_timeout_s.
    for partial in (b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-len", b""):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            started = time.monotonic()
            sock.sendall(partial)
            assert sock.recv(100) == b"", "closed by the daemon"
            assert 0.3 < time.monotonic() - started < 4
    # HEAD: the head only; x-request-id echoed on every answer, a 404 too.
    answer = _raw(port, b"HEAD /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n")
    answer = _raw(
        port, b"GET /nope HTTP/1.1\r\nhost: t\r\nx-request-id: r-7\r\nconnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 404 ") and b"x-request-id: r-7\r\n" in answer
    # Expect: 100-continue (curl, for bodies over 1 KiB): told to go on at once.
    body = json.dumps({"model": "echo", "prompt": "x " * 800, "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")
    metrics = scrape(d.metrics_port)
    assert metrics["gossipd_http_connections_idle_closed_total"] >= 2
    assert metrics["gossipd_http_bad_requests_total"] == 1  # the 41-task burst


def test_prompts_over_a_task_and_metrics_behind_their_token(
    daemon_factory: Any, tmp_path: Path
) -> None:
    token = tmp_path / "metrics.token"
    token.write_text("metrics-secret-123\n")
    d = daemon_factory(
        HTTP, METRICS, "ingress.message_bytes_max=65536", f'metrics.bearer_token_file="{token}"'
    )
    status, _, body = _post(
        f"{d.http_url}/v1/completions", {"model": "echo", "prompt": "x" * 60_000}
    )
    assert status == 413 and json.loads(body)["error"]["param"] == "prompt"
    request = urllib.request.Request(f"{d.http_url}/metrics")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    request.add_header("authorization", "Bearer metrics-secret-123")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert b"gossipd_http_responses_total" in response.read()


def test_start_up_refuses_a_reply_address_other_hosts_cannot_reach() -> None:
    remote = ["--set", 'fanout.rpc_bind="tcp://10.9.9.9:7000"', "--set", "security.insecure=true"]
    done = gossipd_cli("check-config", "--set", 'http.bind="127.0.0.1:8000"', *remote)
    assert done.returncode == 2 and "http.reply_bind" in done.stderr, done.stderr
    done = gossipd_cli(
        "check-config", "--set", 'http.bind="127.0.0.1:8000"',
        "--set", 'http.reply_bind="tcp://0.0.0.0:*"',
    )  # fmt: skip
    assert done.returncode == 2 and "wildcard" in done.stderr, done.stderr


def test_request_ids_are_random_distinct_and_outlast_their_pool() -> None:
    from gossipd.http.door import RandomIds

    ids = RandomIds()
    drawn = [ids.next() for _ in range(1000)]  # about three pools
    assert len(set(drawn)) == 1000
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in drawn)


def test_a_client_that_does_not_read_its_answers_gets_no_more_taken_until_it_does(
    daemon_factory: Any,
) -> None:
    """Pipelined requests whose answers (~1 MB each) the client does not read: once the
    connection's write buffer is full the door takes none of the rest (they wait unread in
    the socket, bounded by PIPELINED_MAX), other clients are served meanwhile, and when the
    client reads, every answer comes, whole and in order."""
    d = daemon_factory(HTTP, METRICS)
    port = _port(d.http_url)
    words = " ".join(f"word{i:04d}" + "x" * 21 for i in range(1000))  # 30 characters a word
    requests = 6
    answered = "gossipd_http_responses_total{status=200}"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", port))
        sock.sendall(_body(32768, words) * requests)
        wait_until(lambda: scrape(d.metrics_port).get(answered, 0) >= 1, 20, "a first answer")
        time.sleep(1.0)  # a window in which nothing more may be taken
        taken = scrape(d.metrics_port).get(answered, 0)
        assert taken < requests, "the door kept answering a client that does not read"
        assert _raw(
            port, b"GET /health HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
        ).startswith(b"HTTP/1.1 200 ")
        got = b""
        while got.count(b"HTTP/1.1 200 ") < requests or not got.endswith(b"}"):
            chunk = sock.recv(1 << 20)
            assert chunk, f"closed after {got.count(b'HTTP/1.1 200 ')} answers"
            got += chunk
    answers = got.split(b"HTTP/1.1 200 ")[1:]
    assert len(answers) == requests
    for answer in answers:
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["usage"]["completion_tokens"] == 32768
        assert len(body["choices"][0]["text"]) > 900_000


def test_the_wire_answers_in_openais_shape_with_the_type_of_its_status() -> None:
    """What the wire answers itself (a malformed request, a handler that raised) is OpenAI's
    error shape with the type PROTOCOL.md's table gives its status; a handler's bug is
    counted and the server keeps serving."""
    import asyncio

    from gossipd.http.door import _wire_error
    from gossipd.http.exchange import HttpLimits
    from gossipd.http.server import serve

    def handler(request: Any, exchange: Any) -> None:
        if request.path == "/bug":
            raise RuntimeError("a bug in the handler")
        exchange.respond(200, b"{}")

    statuses: list[int] = []
    limits = HttpLimits(
        body_bytes_max=1024,
        connections_max=8,
        error_body=_wire_error,
        count_status=statuses.append,
    )

    async def main() -> list[bytes]:
        server = await serve("127.0.0.1", 0, handler, limits)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        close = b"host: x\r\nconnection: close\r\n\r\n"
        try:
            return [
                await loop.run_in_executor(
                    None,
                    _raw,
                    port,
                    b"GET /bug HTTP/1.1\r\nx-request-id: r-500\r\n" + close,
                ),
                await loop.run_in_executor(None, _raw, port, b"GET / HTTP/1.1\r\n" + close),
                await loop.run_in_executor(None, _raw, port, b"\x00\x01 nonsense\r\n\r\n"),
            ]
        finally:
            server.close()

    bug, fine, malformed = asyncio.run(main())
    assert bug.startswith(b"HTTP/1.1 500 ") and b"x-request-id: r-500\r\n" in bug
    assert statuses == [500]  # counted by status, as the door counts its own answers
    error = json.loads(bug.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "server_error" and error["message"] == "internal error"
    assert fine.startswith(b"HTTP/1.1 200 ")  # still serving
    assert malformed.startswith(b"HTTP/1.1 400 ")
    assert json.loads(malformed.partition(b"\r\n\r\n")[2])["error"]["type"] == (
        "invalid_request_error"
    )
    assert limits.counters.handler_errors == 1 and limits.counters.bad_requests == 1
    assert json.loads(_wire_error("too many", 429))["error"]["type"] == "rate_limit_error"
    # (read_bytes_max's 503 is the server's state, not the request's fault: PROTOCOL.md)
    assert json.loads(_wire_error("busy", 503))["error"]["type"] == "server_error"


def test_a_large_body_then_the_start_of_the_next_request_is_no_431() -> None:
    """The header bound counts what a head holds, not the body before it: a request whose
    body is over 64 KiB, followed in the same read by the first bytes of the next request's
    head, and then the rest of that head, gets two answers; one endless header is still
    refused (431)."""
    import asyncio

    import uvloop

    from gossipd.http.exchange import HttpLimits
    from gossipd.http.server import HEADER_BYTES_MAX, serve

    def handler(request: Any, exchange: Any) -> None:
        if request.path == "/block":
            # Holds the loop while the client's next bytes pile up in the socket, so that
            # the next read carries much of the body and the next head's start together.
            time.sleep(0.5)
        exchange.respond(200, b'{"n": %d}' % len(request.body))

    limits = HttpLimits(body_bytes_max=1 << 20, connections_max=8)
    block = b"GET /block HTTP/1.1\r\nhost: x\r\n\r\n"
    # The body's size puts the next head's first 10 bytes at the end of a 64 KiB read,
    # should the server read in 64 KiB pieces (in one read of it all, they are there too).
    head = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
    big = b"x" * (3 * 65536 - 10 - len(head % 190000))
    first = head % len(big) + big
    assert len(first) + 10 == 3 * 65536
    second = b"GET /b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"

    def client(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(block)
            time.sleep(0.1)  # the loop is held in /block's handler
            sock.sendall(first + second[:10])
            time.sleep(0.8)  # the server has read the body and the head's first bytes
            sock.sendall(second[10:])
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)

    def endless(port: int) -> bytes:
        # Just over the bound and never ended: the daemon reads it all, answers and closes.
        return _raw(
            port, b"GET / HTTP/1.1\r\nhost: t\r\nx-long: " + b"y" * (HEADER_BYTES_MAX + 16384)
        )

    async def main() -> tuple[bytes, bytes]:
        server = await serve("127.0.0.1", 0, handler, limits)
        # Room for all of it while /block holds the loop (accepted sockets inherit it).
        server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        try:
            return (
                await loop.run_in_executor(None, client, port),
                await loop.run_in_executor(None, endless, port),
            )
        finally:
            server.close()

    both, refused = uvloop.run(main())
    assert both.count(b"HTTP/1.1 200 ") == 3, both[:300]
    assert b'{"n": %d}' % len(big) in both and b'{"n": 0}' in both
    assert refused.startswith(b"HTTP/1.1 431 ")
    assert limits.counters.bad_requests == 1


def test_a_request_on_an_open_connection_after_the_grace_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """A stopping daemon answers what it holds within its grace, then 503s the rest; a
    keep-alive client's request that comes after that gets 503 shutting_down at once, with
    the connection closed (docs/PROTOCOL.md "A stopping daemon"), instead of being routed
    to a member whose answer no door would carry back.  A forwarded task longer than the
    grace marks its end: its 503 is the grace's, and the entry still closes its intake
    (a Cancel to the owner, its TaskDone) before it closes the door."""
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[HTTP, METRICS, "engine.token_delay_s=0.05"],
        overrides_for=lambda i: ["lifecycle.shutdown_grace_s=1"] if i == 0 else [],
    )
    with running(c):
        entry, owner = c.daemons
        port = _port(entry.http_url)
        far = key_owned_by(c, owner.name)
        near = key_owned_by(c, entry.name)

        def request(key: str, tokens: int, request_id: str = "r") -> bytes:
            doc = json.dumps({"model": "echo", "prompt": "a b", "max_tokens": tokens}).encode()
            return (
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-session-id: %s\r\n"
                b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s"
                % (key.encode(), request_id.encode(), len(doc), doc)
            )

        kept = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            kept.sendall(request(near, 1))
            assert _read_response(kept.makefile("rb"))  # 200: the connection stays open
            slow.sendall(request(far, 200))  # 10 s at the owner
            wait_until(
                lambda: (
                    scrape(owner.metrics_port).get("gossipd_fanout_accepted_from_peers_total", 0)
                    >= 1
                ),
                10,
                "the owner runs the forwarded task",
            )
            entry.terminate()

            def readiness() -> bytes:
                kept.sendall(b"GET /v1/health/ready HTTP/1.1\r\nhost: x\r\n\r\n")
                return kept.recv(65536)

            # Readiness says so (503 with the reason) once the signal is taken, on the
            # kept connection.
            ready = wait_until(
                lambda: (a := readiness()).startswith(b"HTTP/1.1 503 ") and a, 5, "503"
            )
            assert b"shutting down" in ready
            # The grace (1 s) ends: the slow request is cut with 503, and the door takes
            # nothing more.
            slow_answer = slow.recv(65536)
            assert slow_answer.startswith(b"HTTP/1.1 503 "), slow_answer[:300]
            assert b"stopped before the answer came" in slow_answer
            started = time.monotonic()
            kept.sendall(request(near, 1, "late"))
            answer = kept.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
            assert time.monotonic() - started < 1.0
            assert b"connection: close\r\n" in answer and b"x-request-id: late\r\n" in answer
            assert b'"code":"shutting_down"' in answer
            assert f"x-gossipd-member: {entry.name}\r\n".encode() in answer
        finally:
            kept.close()
            slow.close()


def test_connections_past_connections_max_are_closed_at_once_and_counted() -> None:
    import asyncio

    from gossipd.http.exchange import HttpLimits
    from gossipd.http.server import serve

    def handler(request: Any, exchange: Any) -> None:
        exchange.respond(200, b"{}")

    limits = HttpLimits(body_bytes_max=1024, connections_max=2)

    def clients(port: int) -> tuple[bytes, bytes]:
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        try:
            wait_until(lambda: limits.counters.open_now == 2, 5, "two connections open")
            over = socket.create_connection(("127.0.0.1", port), timeout=5)
            over.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            try:
                refused = over.recv(100)
            except ConnectionResetError:
                refused = b""
            over.close()
            held[0].sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            return refused, held[0].recv(100)
        finally:
            for sock in held:
                sock.close()

    async def main() -> tuple[bytes, bytes]:
        server = await serve("127.0.0.1", 0, handler, limits)
        port = server.sockets[0].getsockname()[1]
        try:
            return await asyncio.get_running_loop().run_in_executor(None, clients, port)
        finally:
            server.close()

    refused, served = asyncio.run(main())
    assert refused == b"" and served.startswith(b"HTTP/1.1 200 ")
    assert limits.counters.connections_refused == 1 and limits.counters.connections == 3


def test_api_keys_whose_directory_goes_away_are_all_refused_until_it_is_back(
    tmp_path: Path,
) -> None:
    """Removing http.keys_dir revokes every key (it kept them all), and a SIGHUP's forced
    read of a directory that cannot be read no longer raises in the signal handler."""
    import shutil

    from gossipd.http.keys import ApiKeys

    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    (keys_dir / "alice.key").write_text("k" * 32 + "\n")
    keys = ApiKeys(str(keys_dir))
    bearer = "Bearer " + "k" * 32
    assert keys.name_of(bearer) == "alice"
    shutil.rmtree(keys_dir)
    assert not keys.reload(force=True)  # SIGHUP's read: no exception
    assert keys.name_of(bearer) is None and keys.unreadable
    assert not keys.reload()  # the periodic read, still gone: still none
    keys_dir.mkdir()
    (keys_dir / "alice.key").write_text("k" * 32 + "\n")
    assert keys.reload() and keys.name_of(bearer) == "alice" and not keys.unreadable
    with pytest.raises(OSError, match=r"http\.keys_dir"):
        ApiKeys(str(tmp_path / "never-there"))  # at start-up: it stops the daemon


def test_one_bad_key_file_is_skipped_and_the_other_keys_stay_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NAME.key that cannot be stat()ed (a dangling symlink: a secret volume mid-update)
    was taken as the whole directory unreadable: start-up failed, and later every key was
    refused.  And a key file of two lines made its key unusable, silently: now it is
    skipped and said (taking its first line would make a comment above the key the key)."""
    from gossipd.http.keys import ApiKeys

    alice, carol = "a" * 32, "c" * 32
    (tmp_path / "alice.key").write_text(alice + "\n")
    (tmp_path / "bob.key").symlink_to(tmp_path / "gone")  # dangling at start
    keys = ApiKeys(str(tmp_path))  # no OSError
    assert keys.name_of(f"Bearer {alice}") == "alice" and len(keys) == 1
    (tmp_path / "dave.key").symlink_to(tmp_path / "gone-too")  # and later
    (tmp_path / "carol.key").write_text(carol + "\n")
    # A comment above the key would have become the key: a file of two lines is skipped.
    (tmp_path / "erin.key").write_text("# erin's, issued 2026-12-06\n" + "e" * 32 + "\n")
    with caplog.at_level("WARNING", logger="gossipd.http.keys"):
        assert keys.reload()
    assert not keys.unreadable
    assert keys.name_of(f"Bearer {alice}") == "alice"
    assert keys.name_of(f"Bearer {carol}") == "carol"
    assert keys.name_of("Bearer # erin's, issued 2026-12-06") is None
    assert keys.name_of("Bearer " + "e" * 32) is None and len(keys) == 2
    assert "more than one line" in caplog.text and "unreadable" in caplog.text
    (tmp_path / "gone").write_text("b" * 32)  # bob's target appears: a change, read
    assert keys.reload() and keys.name_of("Bearer " + "b" * 32) == "bob"


def test_a_key_rewritten_with_its_size_and_mtime_kept_is_read_again(tmp_path: Path) -> None:
    """A rotation that keeps the file's length and mtime (cp -p, rsync -t, tar x) changed
    neither of the two figures the reload compared: the old key stayed valid and the new
    one was refused until a SIGHUP.  The ctime and inode tell it."""
    import os

    from gossipd.http.keys import ApiKeys

    path = tmp_path / "carol.key"
    old, new = "o" * 32, "n" * 32
    path.write_text(old + "\n")
    keys = ApiKeys(str(tmp_path))
    assert keys.name_of(f"Bearer {old}") == "carol"
    st = path.stat()
    staged = tmp_path / "carol.key.new"
    staged.write_text(new + "\n")
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p leaves it
    staged.replace(path)
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size
    assert keys.reload()  # the periodic look, not a forced one
    assert keys.name_of(f"Bearer {new}") == "carol" and keys.name_of(f"Bearer {old}") is None
    # In place too (the same inode, the same size and mtime): its ctime moved.
    with path.open("r+") as f:
        f.write(old)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert keys.reload() and keys.name_of(f"Bearer {old}") == "carol"


def test_out_of_file_descriptors_keeps_the_keys_as_they_were(tmp_path: Path) -> None:
    """A flood of connections that takes every file descriptor made the reload read the
    directory as unreadable and drop every key (each request then 401).  Out of descriptors
    says nothing of the keys: they stay, and the next look reads again.  Real EMFILE: this
    process's descriptor limit lowered to what it has open, then restored."""
    import os

    from gossipd.http.keys import ApiKeys

    alice = "a" * 32
    (tmp_path / "alice.key").write_text(alice + "\n")
    keys = ApiKeys(str(tmp_path))
    (tmp_path / "bob.key").write_text("b" * 32 + "\n")  # a change for the reload to see
    with out_of_file_descriptors():
        with pytest.raises(OSError):  # (none left indeed)
            os.open("/dev/null", os.O_RDONLY)
        assert not keys.reload() and not keys.reload(force=True)
        assert keys.name_of(f"Bearer {alice}") == "alice" and not keys.unreadable
    assert keys.reload() and keys.name_of("Bearer " + "b" * 32) == "bob"
    # A directory emptied after a look out of descriptors is read (its () was the marker
    # of a look to make again: an empty directory's too, so its keys stayed valid).
    with out_of_file_descriptors():
        with pytest.raises(OSError):  # (none left indeed)
            os.open("/dev/null", os.O_RDONLY)
        assert not keys.reload()
    for path in tmp_path.glob("*.key"):
        path.unlink()
    assert keys.reload() and keys.name_of(f"Bearer {alice}") is None and len(keys) == 0


def test_a_chats_min_tokens_and_a_structured_forms_size_are_400_and_413_never_500(
    daemon_factory: Any,
) -> None:
    """min_tokens against a chat's max_tokens default (http.chat_max_tokens_default) is the
    client's 400, not the door's 500; a structured output's form rides in the task beside the
    prompt, so together they are held to what a task may carry (413)."""
    d = daemon_factory(
        HTTP,
        "http.chat_max_tokens_default=100",
        "ingress.message_bytes_max=65536",  # a prompt's room: 48 KiB
        "fanout.message_bytes_max=65536",
    )
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    status, _, body = _post(f"{d.http_url}/v1/chat/completions", {**chat, "min_tokens": 50})
    assert status == 200, body
    status, _, body = _post(f"{d.http_url}/v1/chat/completions", {**chat, "min_tokens": 200})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "min_tokens", body
    assert "http.chat_max_tokens_default" in error["message"]
    prompt = "w " * 15_000  # 30 KB: fits alone
    schema = {"type": "object", "description": "d" * 25_000}  # 25 KB more: not together
    status, _, _ = _post(f"{d.http_url}/v1/completions", {"model": "echo", "prompt": prompt})
    assert status == 200
    status, _, body = _post(
        f"{d.http_url}/v1/completions",
        {"model": "echo", "prompt": prompt, "guided_json": schema},
    )
    message = json.loads(body)["error"]["message"]
    assert (
        status == 413 and "the prompt (30000 bytes) and the form the output is held to" in message
    )
