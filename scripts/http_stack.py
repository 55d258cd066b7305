"""Which HTTP stack for the door (issue 26, item 4): CPU per request of each candidate serving
the same small JSON answer to the same POST, on uvloop, measured with wrk.

    .venv/bin/python scripts/http_stack.py [--seconds 3] [--rounds 3] [--json]

Candidates: gossipd's own door server (gossipd/http/server.py: httptools under an asyncio
Protocol), uvicorn's ``Server.serve()`` with a bare ASGI app (httptools inside too, plus the
ASGI layer), aiohttp's ``web`` (its C parser), and granian's embedded mode
(``granian.server.embed.Server``: its Rust HTTP stack on its own runtime thread, the handler on
this loop) with its own RSGI interface and with ASGI.  granian is not a dependency of gossipd:
``.venv/bin/pip install granian`` to measure it (skipped, and said so, without it).  Each
server runs in its own process on one loop; wrk (2 threads, 16 connections) sends the request; CPU is the server
process's utime+stime over the window.  Rounds interleave the candidates; medians printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"ok"}]}'
REQUEST = '{"model":"echo","prompt":"hello there world","max_tokens":4}'

# The same bare ASGI app for uvicorn and granian, and granian's embedded server for either of
# its interfaces (INTERFACE: RSGI or ASGINL, ASGI without lifespan).
_ASGI_APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})
"""
_GRANIAN_EMBED = """
from granian.constants import HTTPModes, Interfaces
from granian.log import LogLevels
from granian.server.embed import Server
async def main():
    await Server(app, address="127.0.0.1", port=PORT, interface=Interfaces.INTERFACE,
                 http=HTTPModes.http1, runtime_threads=1, log_enabled=False,
                 log_level=LogLevels.error).serve()
uvloop.run(main())
"""

SERVERS = {
    "gossipd-httptools": """
import asyncio, uvloop
from gossipd.http.exchange import HttpLimits
from gossipd.http.server import serve
BODY = %r
def handle(request, exchange):
    exchange.respond(200, BODY)
async def main():
    await serve("127.0.0.1", PORT, handle, HttpLimits(body_bytes_max=1 << 20, connections_max=4096))
    await asyncio.Event().wait()
uvloop.run(main())
""",
    "uvicorn-asgi": """
import asyncio, uvicorn, uvloop
BODY = %r
"""
    + _ASGI_APP
    + """
config = uvicorn.Config(app, host="127.0.0.1", port=PORT, log_level="error",
                        access_log=False, http="httptools", loop="none", lifespan="off")
uvloop.run(uvicorn.Server(config).serve())
""",
    "aiohttp-web": """
import asyncio, uvloop
from aiohttp import web
BODY = %r
async def handle(request):
    await request.read()
    return web.Response(body=BODY, content_type="application/json")
async def main():
    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", PORT).start()
    await asyncio.Event().wait()
uvloop.run(main())
""",
    "granian-rsgi-embed": """
import asyncio, uvloop
BODY = %r
HEADERS = [("content-type", "application/json")]
async def app(scope, protocol):
    await protocol()
    protocol.response_bytes(200, HEADERS, BODY)
"""
    + _GRANIAN_EMBED.replace("INTERFACE", "RSGI"),
    "granian-asgi-embed": """
import asyncio, uvloop
BODY = %r
"""
    + _ASGI_APP
    + _GRANIAN_EMBED.replace("INTERFACE", "ASGINL"),
}

LUA = f"""
wrk.method = "POST"
wrk.body = '{REQUEST}'
wrk.headers["Content-Type"] = "application/json"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # type: ignore[no-any-return]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(port: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="http-stack-")
    lua = os.path.join(workdir, "post.lua")
    with open(lua, "w") as f:
        f.write(LUA)
    servers = dict(SERVERS)
    if importlib.util.find_spec("granian") is None:
        print("granian is not installed: its candidates are skipped (.venv/bin/pip install "
              "granian)", file=sys.stderr)  # fmt: skip
        servers = {k: v for k, v in servers.items() if not k.startswith("granian")}
    procs = {}
    ports = {}
    for name, source in servers.items():
        port = _free_port()
        code = (source % BODY).replace("PORT", str(port))
        procs[name] = subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd())
        ports[name] = port
    try:
        for port in ports.values():
            _wait_port(port)
        figures: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
        for r in range(args.rounds):
            for name, port in ports.items():
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                cpu0 = _cpu_s(procs[name].pid)
                out = subprocess.run(
                    ["wrk", "-t2", "-c16", f"-d{args.seconds}s", "-s", lua,
                     f"http://127.0.0.1:{port}/v1/completions"],
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                cpu = _cpu_s(procs[name].pid) - cpu0
                requests = int(next(x for x in out.splitlines() if "requests in" in x).split()[0])
                figures[name].append(
                    {"req_per_s": requests / args.seconds, "cpu_us_per_req": cpu / requests * 1e6}
                )
    finally:
        for proc in procs.values():
            proc.kill()
    report = {
        name: {k: round(statistics.median(f[k] for f in fs), 1) for k in fs[0]}
        for name, fs in figures.items()
    }
    if args.json:
        print(json.dumps({"rounds": args.rounds, "seconds": args.seconds, "servers": report}))
    else:
        for name, f in report.items():
            print(f"{name:<20} {f['req_per_s']:>9.0f} req/s {f['cpu_us_per_req']:>7.1f} us CPU/req")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
