"""A stub OpenAI-compatible completions server for `gossipd bench http`: the engine with no
service time that the routers' variants put behind them and the ``direct`` variant measures.

    python -m gossipd.tools.bench.http_stub --port 18001 [--model echo]

Why this and not something else: it must cost far less per request than the layers measured,
answer with vLLM's JSON (the routers parse nothing of it but a client might), and answer the
start-up and health probes the routers send.  uvloop + httptools (both gossipd dependencies:
C under an asyncio Protocol, no framework) serves 130-155k keep-alive requests a second here
at 6-7 us of CPU each, 6-8x what the fastest router passes; a framework (FastAPI, aiohttp)
costs several times that.  It reads no JSON: the body is discarded, and each answer is vLLM's
non-streamed completion shape with a fresh id, one token of text and ``finish_reason``
"length".

Probes: vllm-router asks ``GET /health``; sglang-router asks ``/health``, then ``/server_info``
and ``/model_info`` (and their older ``/get_*`` names).  Those info paths get 404 on purpose:
when a worker names a model path there, sglang-router downloads that model's tokenizer from
Hugging Face (ignoring HF_HUB_OFFLINE); without one it skips the tokenizer.  ``/v1/models``
is answered (model "echo"), for clients that look the model up.

Paths it was asked for are counted and printed to stderr at SIGTERM (what a router probes).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import time
from collections import Counter
from typing import Any, cast

import httptools
import uvloop

_ids = itertools.count(1)
paths_seen: Counter[str] = Counter()


def _response(status: str, body: bytes, *, keep_alive: bool) -> bytes:
    conn = b"keep-alive" if keep_alive else b"close"
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: " + conn + b"\r\n\r\n"
    ) + body


class _Answers:
    """Pre-encoded bodies (except the completion's id and time, made per request)."""

    def __init__(self, model: str) -> None:
        self.model = model
        models = {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": model,
                    "parent": None,
                    "max_model_len": 2048,
                    "permission": [],
                }
            ],
        }
        self.models = json.dumps(models).encode()
        # vLLM's non-streamed /v1/completions answer, split around its per-request fields.
        self._head = b'{"id":"cmpl-stub-'
        self._mid = b'","object":"text_completion","created":'
        self._tail = (
            ',"model":' + json.dumps(model) + ',"choices":[{"index":0,"text":" hello",'
            '"logprobs":null,"finish_reason":"length","stop_reason":null,'
            '"prompt_logprobs":null}],"usage":{"prompt_tokens":2,"total_tokens":3,'
            '"completion_tokens":1,"prompt_tokens_details":null},"kv_transfer_params":null}'
        ).encode()

    def completion(self) -> bytes:
        return b"".join(
            (self._head, str(next(_ids)).encode(), self._mid, str(int(time.time())).encode(),
             self._tail)
        )  # fmt: skip

    def answer(self, method: bytes, path: bytes) -> tuple[str, bytes]:
        route = path.split(b"?", 1)[0]
        if route in (b"/v1/completions", b"/v1/chat/completions", b"/generate"):
            return "200 OK", self.completion()
        if route in (b"/health", b"/health_generate", b"/v1/health/ready", b"/ping"):
            return "200 OK", b"{}"
        if route == b"/v1/models":
            return "200 OK", self.models
        return "404 Not Found", b'{"error":{"message":"not found","type":"NotFound"}}'


class _Conn(asyncio.Protocol):
    def __init__(self, answers: _Answers) -> None:
        self._answers = answers
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance check.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.write(_response("400 Bad Request", b"{}", keep_alive=False))
            self._transport.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_message_complete(self) -> None:
        assert self._transport is not None
        method = self._parser.get_method()
        paths_seen[f"{method.decode()} {self._url.decode(errors='replace')}"] += 1
        status, body = self._answers.answer(method, self._url)
        keep = self._parser.should_keep_alive()
        self._transport.write(_response(status, body, keep_alive=keep))
        self._url = b""
        if not keep:
            self._transport.close()


async def serve(host: str, port: int, model: str) -> None:
    loop = asyncio.get_running_loop()
    answers = _Answers(model)
    server = await loop.create_server(lambda: _Conn(answers), host, port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub serving on {host}:{port}", file=sys.stderr, flush=True)
    await stop.wait()
    server.close()
    print(f"stub paths: {dict(paths_seen)}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="echo")
    a: Any = p.parse_args(argv)
    uvloop.run(serve(a.host, a.port, a.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
