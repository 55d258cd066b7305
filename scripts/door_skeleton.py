"""The floor of the HTTP door's design in Python on this machine: two processes that do only
what the bench's load needs, measured beside gossipd and vllm-router under the same wrk.

Each skeleton process is uvloop + httptools (gossipd's own stack), serves ``POST
/v1/completions``, reads the body's JSON (msgspec), takes ``x-session-id``, and decides the
owner by the key's crc32 (about half the keys are the other process's).  Its own keys it
answers at once with vLLM's completion JSON; the others it forwards to the other process over
one TCP connection (length-prefixed frames, the turn's frames in one write), which answers
and sends the text back the same way, and the entry process answers the HTTP request.  No
admission, budgets, dedup, deadlines, membership, ledger, CURVE, metrics or logs: it is what
gossipd's topology would cost if gossipd did nothing else, so the question it answers is
whether any Python door of this shape (two single-threaded processes, half the requests
forwarded, the answer back through the entry) can reach a given figure here.

    .venv/bin/python scripts/door_skeleton.py [--rounds 3] [--seconds 4]
        [--concurrency 1,16,64] [--json] [--no-router] [--no-gossipd]
    .venv/bin/python scripts/door_skeleton.py serve --index I --http-port P
        --peer-listen L --peer-port Q     # one skeleton process (the runner starts two)

Variants are interleaved per round (their order rotated) and reported as medians: req/s,
p50, and CPU microseconds a request of the layer's processes (the skeleton's two, gossipd's
two daemons, the router; not wrk's, not the stubs').
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_FRAME = struct.Struct("!IQ")  # payload length, request number
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
_ids = itertools.count(1)


def completion(text: str, model: str) -> bytes:
    """vLLM's non-streamed completion answer (as the stub's, with the text it was given)."""
    return (
        b'{"id":"cmpl-sk-' + str(next(_ids)).encode() + b'","object":"text_completion",'
        b'"created":' + str(int(time.time())).encode() + b',"model":' + json.dumps(model).encode()
        + b',"choices":[{"index":0,"text":' + json.dumps(text).encode()
        + b',"logprobs":null,"finish_reason":"length","stop_reason":null}],'
        b'"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1}}'
    )  # fmt: skip


class Peer(asyncio.Protocol):
    """One end of the frame channel: frames of a turn leave in one write at its end."""

    def __init__(self, on_frame: Any) -> None:
        self._on_frame = on_frame
        self._buf = b""
        self._out: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, number: int, payload: bytes) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(_FRAME.pack(len(payload), number) + payload)

    def _flush(self) -> None:
        assert self.transport is not None
        self.transport.write(b"".join(self._out))
        self._out.clear()

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        at, size = 0, _FRAME.size
        while len(buf) - at >= size:
            length, number = _FRAME.unpack_from(buf, at)
            if len(buf) - at - size < length:
                break
            self._on_frame(number, buf[at + size : at + size + length])
            at += size + length
        self._buf = buf[at:]


class Skeleton:
    def __init__(self, index: int) -> None:
        self.index = index
        self.peer: Peer | None = None
        self.waiting: dict[int, Door] = {}
        self.numbers = itertools.count(1)
        self.counts = {"local": 0, "forwarded": 0}  # requests that entered here, by path

    def owns(self, key: bytes) -> bool:
        return (zlib.crc32(key) & 1) == self.index

    def on_frame(self, number: int, payload: bytes) -> None:
        """A frame from the other process; its first byte says which: a Forward to run, or
        the answer to one of ours."""
        kind, body = payload[:1], payload[1:]
        if kind == b"F":  # a forward: run it, send the text back
            assert self.peer is not None
            self.peer.send(number, b"R" + body)
        else:  # an answer to one of ours
            door = self.waiting.pop(number, None)
            if door is not None:
                door.answer(completion(body.decode(), "echo"))


class Door(asyncio.Protocol):
    """One client connection: httptools in, the answer written when it is known."""

    def __init__(self, sk: Skeleton) -> None:
        import httptools
        import msgspec

        self._sk = sk
        self._parser = httptools.HttpRequestParser(self)
        self._decode = msgspec.json.decode
        self._key = b""
        self._url = b""
        self._body: list[bytes] = []
        self._header_name = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"x-session-id":
            self._key = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._url == b"/stats":  # the runner's check that half the requests crossed
            self.answer(json.dumps(self._sk.counts).encode())
            return
        req = self._decode(b"".join(self._body))
        self._body.clear()
        prompt = req["prompt"]
        if not isinstance(prompt, str) or req.get("max_tokens", 16) < 1:
            raise ValueError("bad request")
        if self._sk.owns(self._key):
            self._sk.counts["local"] += 1
            self.answer(completion(prompt, req["model"]))
            return
        self._sk.counts["forwarded"] += 1
        number = next(self._sk.numbers)
        self._sk.waiting[number] = self
        assert self._sk.peer is not None
        self._sk.peer.send(number, b"F" + prompt.encode())

    def answer(self, body: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():  # the client left while its answer was on the way
            return
        self.transport.write(_HEAD + str(len(body)).encode() + b"\r\n\r\n" + body)


async def serve(index: int, http_port: int, peer_listen: int, peer_port: int) -> None:
    loop = asyncio.get_running_loop()
    sk = Skeleton(index)
    # Index 0 dials, index 1 listens: one connection, both ways.
    if index == 1:
        await loop.create_server(lambda: _peer_for(sk), "127.0.0.1", peer_listen)
    else:
        for _ in range(200):
            try:
                await loop.create_connection(lambda: _peer_for(sk), "127.0.0.1", peer_port)
                break
            except OSError:
                await asyncio.sleep(0.05)
        else:
            raise SystemExit("skeleton 0: the other skeleton never listened")
    await loop.create_server(lambda: Door(sk), "127.0.0.1", http_port, backlog=1024)
    print(f"skeleton {index} serving on {http_port}", file=sys.stderr, flush=True)
    await asyncio.Event().wait()


def _peer_for(sk: Skeleton) -> Peer:
    sk.peer = Peer(sk.on_frame)
    return sk.peer


# -- the runner ------------------------------------------------------------------------------


def _start_skeletons(procs: Any) -> tuple[list[str], list[int]]:
    from gossipd.tools.bench.http_peers import wait_serving
    from gossipd.tools.launcher import free_tcp_port

    http = [free_tcp_port(), free_tcp_port()]
    peer = free_tcp_port()
    pids = []
    for i in (1, 0):  # the listener first
        cmd = [
            sys.executable, __file__, "serve", "--index", str(i), "--http-port", str(http[i]),
            "--peer-listen", str(peer), "--peer-port", str(peer),
        ]  # fmt: skip
        pids.append(procs.start(f"skeleton{i}", cmd))
    urls = [f"http://127.0.0.1:{p}" for p in http]
    for url in urls:
        wait_serving(url, 30, headers={"x-session-id": "warm"})
    return urls, pids


def _stats(url: str) -> dict[str, int]:
    import urllib.request

    with urllib.request.urlopen(url + "/stats", timeout=10) as answer:
        return cast(dict[str, int], json.loads(answer.read()))


def run(rounds: int, seconds: int, levels: list[int], router: bool, gossipd: bool) -> dict:
    from gossipd.tools.bench.http import _gossipd
    from gossipd.tools.bench.http_peers import (
        ROUTER_ENV,
        ROUTERS,
        Processes,
        Wrk,
        default_router_venv,
        new_workdir,
        start_stub,
        wait_serving,
    )
    from gossipd.tools.launcher import free_tcp_port

    workdir = new_workdir()
    procs = Processes(workdir)
    targets: dict[str, tuple[list[str], list[int]]] = {}
    cluster = None
    try:
        targets["skeleton"] = _start_skeletons(procs)
        if router:
            rr = next(r for r in ROUTERS if r.name == "vllm-router:round_robin")
            venv = default_router_venv()
            why = rr.missing(venv)
            if why:
                raise SystemExit(f"vllm-router: {why} (or pass --no-router)")
            stubs = [start_stub(procs, f"stub{i}")[0] for i in range(2)]
            port = free_tcp_port()
            pid = procs.start(rr.name, rr.command(venv, port, stubs), env=ROUTER_ENV)
            url = f"http://127.0.0.1:{port}"
            wait_serving(url, 60)
            targets[rr.name] = ([url], [pid])
        if gossipd:
            cluster, urls, pids = _gossipd(workdir)
            targets["gossipd"] = (urls, pids)
        wrk = Wrk(workdir)
        names = list(targets)
        for name in names:
            wrk.run(targets[name][0], 16, 2, targets[name][1])  # warm
        windows: dict[str, dict[int, list[Any]]] = {n: {c: [] for c in levels} for n in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for c in levels:
                for name in order:
                    urls, pids = targets[name]
                    windows[name][c].append(wrk.run(urls, c, seconds, pids))
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        counts = [_stats(url) for url in targets["skeleton"][0]]
    finally:
        if cluster is not None:
            cluster.stop()
        procs.stop()
    crossed = sum(c["forwarded"] for c in counts)
    out: dict[str, Any] = {
        "rounds": rounds,
        "seconds": seconds,
        "skeleton_forwarded_fraction": round(
            crossed / max(1, crossed + sum(c["local"] for c in counts)), 3
        ),
        "variants": {},
    }
    for name, by_c in windows.items():
        out["variants"][name] = {
            str(c): {
                "req_per_s": round(statistics.median(w.req_per_s for w in ws)),
                "p50_us": round(statistics.median(w.p50_us for w in ws)),
                "cpu_us_per_req": round(statistics.median(w.cpu_us_per_req or 0 for w in ws), 1),
                "errors": sum(w.errors for w in ws),
            }
            for c, ws in by_c.items()
        }
    ref = out["variants"].get("vllm-router:round_robin")
    if ref is not None:
        out["ratio_vs_vllm_router"] = {
            name: {c: round(v[c]["req_per_s"] / ref[c]["req_per_s"], 3) for c in v}
            for name, v in out["variants"].items()
        }
    out["load"] = os.getloadavg()
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        p = argparse.ArgumentParser()
        p.add_argument("serve")
        p.add_argument("--index", type=int, required=True)
        p.add_argument("--http-port", type=int, required=True)
        p.add_argument("--peer-listen", type=int, required=True)
        p.add_argument("--peer-port", type=int, required=True)
        a = p.parse_args()
        import uvloop

        uvloop.run(serve(a.index, a.http_port, a.peer_listen, a.peer_port))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=4)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-router", action="store_true")
    p.add_argument("--no-gossipd", action="store_true")
    a = p.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    report = run(a.rounds, a.seconds, levels, not a.no_router, not a.no_gossipd)
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"skeleton: {report['skeleton_forwarded_fraction']:.1%} of requests forwarded")
    for name, by_c in report["variants"].items():
        for c, f in by_c.items():
            ratio = report.get("ratio_vs_vllm_router", {}).get(name, {}).get(c)
            print(
                f"{name:26s} c={c:>3}: {f['req_per_s']:>7,} req/s  p50 {f['p50_us']:>6,} us  "
                f"CPU {f['cpu_us_per_req']:>6} us/req  errors {f['errors']}"
                + (f"  x{ratio} of vllm-router" if ratio is not None else "")
            )


if __name__ == "__main__":
    main()
