"""CPU per request of the HTTP door's path, measured in one process without the network
(scripts/cpu_per_task.py's counterpart for the door: that one sends ZeroMQ tasks).

Two daemons (echo engine, no token delay, no journal) run on this process's event loop.
Requests go straight into daemon A's HTTP connection objects (gossipd/http/server.py) through a
transport that only counts the answers, so neither wrk nor the kernel's TCP is measured:
what is left is gossipd's own path, door to engine and back.  Two paths:

- ``local``: keys that A owns: parse, door, intake, admission, runner, answer;
- ``forwarded``: keys that B owns: the same plus the forward over ZeroMQ (loopback TCP, both
  daemons' I/O threads counted) and B's owner side.

Each is driven with 1 request at a time and with 16 at once (answers awaited together),
best of 3 windows of CPU time (process_time: both daemons and their ZeroMQ threads) over
requests.  On a shared 2-vCPU VM the same path costs more under wrk (cold caches, its
threads and the other daemon preempting it): compare figures of this script with each other,
before and after a change, not with ``gossipd bench http``'s.

    .venv/bin/python scripts/door_path_cpu.py [--requests 20000] [--json]
        [--cprofile PATH]   # a profile of the forwarded path (pstats)
        [--cprofile-at-once K]   # ... with K requests at once (16 unless told)
        [--cprofile-path local]   # ... of the local path instead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.config import NodeConfig, load_config
from gossipd.core.ring import Ring
from gossipd.daemon import Daemon
from gossipd.http.server import HttpConnection
from gossipd.http.turnwrites import TurnWrites
from gossipd.tools.launcher import free_tcp_port

BODY = b'{"model":"echo","prompt":"hello world","max_tokens":1}'
AT_ONCE = (1, 16)


class CountingTransport:
    """What HttpConnection writes to: counts the answers, wakes whoever waits for N."""

    def __init__(self) -> None:
        self.answers = 0
        self._target = 0
        self._done: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.answers += 1
        if self._done is not None and self.answers >= self._target and not self._done.done():
            self._done.set_result(None)

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    async def wait_for(self, answers: int) -> None:
        if self.answers < answers:
            self._target = answers
            self._done = asyncio.get_running_loop().create_future()
            await self._done


POLLING_OFF = ["node.busy_poll_us=0"] if "busy_poll_us" in NodeConfig.__struct_fields__ else []


def _config(name: str, ports: dict[str, int], peer: dict[str, int]) -> Any:
    return load_config(
        environ={},
        overrides=[
            f'node.id="{name}"',
            f'ingress.bind="tcp://127.0.0.1:{ports["ingress"]}"',
            f'gossip.bind="tcp://127.0.0.1:{ports["gossip"]}"',
            f'gossip.seeds=["tcp://127.0.0.1:{peer["gossip"]}"]',
            'gossip.preset="local"',
            f'fanout.rpc_bind="tcp://127.0.0.1:{ports["rpc"]}"',
            'journal.path=""',
            'engine.kind="echo"',
            "engine.token_delay_s=0",
            f'http.bind="127.0.0.1:{ports["http"]}"',
            'log.level="warning"',
            # Busy-polling's turns are the loop's, not the path's: in one process, where the
            # loop never waits between requests, they only add to the figure (about 17 us a
            # request one at a time).  Trees before it have no such key.
            *POLLING_OFF,
        ],
    )


def _requests(keys: list[str]) -> list[bytes]:
    return [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-session-id: %s\r\nContent-Length: %d\r\n\r\n%s" % (k.encode(), len(BODY), BODY)
        for k in keys
    ]


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    ports = {n: {k: free_tcp_port() for k in ("ingress", "gossip", "rpc", "http")} for n in "ab"}
    a = Daemon(_config("a", ports["a"], ports["b"]))
    b = Daemon(_config("b", ports["b"], ports["a"]))
    runs = [asyncio.create_task(d.run()) for d in (a, b)]

    def placed() -> bool:
        return (
            a.door is not None
            and a.door.server is not None
            and all(
                d.dispatcher is not None
                and set(d.dispatcher.placer.view().weights) == {"a", "b"}
                and set(d.dispatcher.placer.view().addrs) >= {"a", "b"} - {d.node}
                for d in (a, b)
            )
        )

    until = time.monotonic() + 60
    while not placed():
        if time.monotonic() > until or any(r.done() for r in runs):
            raise SystemExit("the two daemons did not place on each other within 60 s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # the peer link up, the first gossip rounds done
    door = a.door
    assert door is not None
    ring = Ring({"a": 1.0, "b": 1.0})
    transport = CountingTransport()
    conns = []
    writes = TurnWrites()  # one for all, as the door's server has
    for _ in range(max(AT_ONCE)):
        conn = HttpConnection(door.handle, door.limits, writes)
        conn.connection_made(transport)  # type: ignore[arg-type]
        conns.append(conn)
    report: dict[str, Any] = {
        "requests_per_window": args.requests,
        "cpu_us_per_request": {},
        "ran_where_keyed": {},  # of each path's requests, those its keys' owner ran
    }
    for path, owner in (("local", "a"), ("forwarded", "b")):
        runs_before = (b if owner == "b" else a).ingress.runner.results["ok"]
        answers_before = transport.answers
        keys = [k for k in (f"s{i}" for i in range(40_000)) if ring.owner(k) == owner][:4096]
        requests = _requests(keys)
        sent = 0

        async def batch(k: int, requests: list[bytes] = requests) -> None:
            nonlocal sent
            start = transport.answers
            for conn in conns[:k]:
                conn.data_received(requests[sent % len(requests)])
                sent += 1
            await transport.wait_for(start + k)

        for _ in range(200):  # warm
            await batch(16)
        for k in AT_ONCE:
            rounds = args.requests // k
            best = float("inf")
            for _ in range(3):
                t0 = time.process_time()
                for _ in range(rounds):
                    await batch(k)
                best = min(best, (time.process_time() - t0) / (rounds * k) * 1e6)
            report["cpu_us_per_request"][f"{path}_{k}_at_once"] = round(best, 2)
            if not args.json:
                print(f"{path:>9}, {k:>2} at once: {best:6.2f} us CPU a request", flush=True)
        if args.cprofile and path == args.cprofile_path:  # a window of its own, not timed
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
            k = args.cprofile_at_once
            for _ in range(args.requests // k):
                await batch(k)
            profile.disable()
            profile.dump_stats(args.cprofile)
        # Bounded loads could run some elsewhere: the figure is the path's only if ~all ran
        # where their key said.
        ran = (b if owner == "b" else a).ingress.runner.results["ok"] - runs_before
        report["ran_where_keyed"][path] = round(ran / (transport.answers - answers_before), 4)
    if not args.json:
        print(f"ran where their key said: {report['ran_where_keyed']}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000, help="per window")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cprofile", default="", help="write the forwarded path's profile")
    parser.add_argument("--cprofile-at-once", type=int, default=16, choices=AT_ONCE)
    parser.add_argument("--cprofile-path", default="forwarded", choices=("local", "forwarded"))
    uvloop.run(_main(parser.parse_args()))


async def _main(args: argparse.Namespace) -> None:
    report = await _measure(args)
    if args.json:
        print(json.dumps(report, indent=1))
    sys.stdout.flush()
    # Leave at once, inside the loop: the daemons' graceful stop (drain, leave, waits for
    # members) is not what is measured, and cancelling them from outside waits for it.
    os._exit(0)


if __name__ == "__main__":
    main()
