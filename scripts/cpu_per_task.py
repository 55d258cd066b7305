"""CPU per task of the daemon code, local and forwarded: a paired figure that a noisy machine
disturbs far less than throughput.

Two daemons and a Client in this process (as scripts/path_files.py builds them; it runs on
older trees too): rounds of N tasks sent to daemon ``a``, keyed so that ``a`` runs them
itself ("local") or ``b`` does ("forwarded"); the process's CPU time (user + system, all
threads: ZeroMQ's I/O threads too) over each round, per task.  The Client's own cost is in
both figures alike (its code is the same in the trees compared).

    cd TREE && python /path/to/scripts/cpu_per_task.py [--tasks 2000] [--rounds 5] [--json]
    # paired: alternate the trees, e.g. for i in 1 2 3; do (cd base && ...); (cd head && ...); done
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import path_files as pf  # this directory: the same two-daemon set-up

# Tasks in flight at once: under fanout.load_floor (256), so bounded loads move none off
# its owner and "local" and "forwarded" are what they say.
WINDOW = 200


async def _keys(owner: str, count: int) -> list[str]:
    from gossipd.core.ring import Ring

    ring = Ring({"a": 1.0, "b": 1.0})
    keys = (f"k{i}" for i in range(10_000_000))
    return [k for k in keys if ring.owner(k) == owner][:count]


async def _send(client: Any, keys: list[str], owner: str) -> int:
    tasks = [
        pf.Task(
            v=pf.PROTOCOL_VERSION,
            id=client.new_id(),
            key=key,
            prompt="cpu",
            params=pf.SamplingParams(max_tokens=3),
            reply_to=client.reply_to,
        )
        for key in keys
    ]
    ran = 0
    for at in range(0, len(tasks), WINDOW):
        handles = [await client.submit_task(t) for t in tasks[at : at + WINDOW]]
        results = await asyncio.gather(*(h.result() for h in handles))
        ran += sum(1 for r in results if r.ok and r.node == owner)
    return ran


async def main(args: argparse.Namespace) -> dict[str, Any]:
    ports = {n: {k: pf.free_tcp_port() for k in ("ingress", "gossip", "rpc")} for n in "ab"}
    a = pf.Daemon(pf._config("a", ports, "b"))
    b = pf.Daemon(pf._config("b", ports, "a"))
    runs = [asyncio.create_task(d.run()) for d in (a, b)]
    out: dict[str, Any] = {"tasks": args.tasks, "rounds": args.rounds}
    try:
        async with pf.Client([f"tcp://127.0.0.1:{ports['a']['ingress']}"]) as client:
            deadline = time.monotonic() + 30
            warm = await _keys("b", 5)
            while await _send(client, warm, "b") < len(warm):
                if time.monotonic() > deadline:
                    raise SystemExit("daemon a never forwarded to b in 30 s")
                await asyncio.sleep(0.2)
            keys = {o: await _keys(o, args.tasks) for o in ("a", "b")}
            for owner in ("a", "b"):
                await _send(client, keys[owner][: args.tasks // 4], owner)  # warm
            samples: dict[str, list[float]] = {"local": [], "forwarded": []}
            ran_there: dict[str, int] = {"local": 0, "forwarded": 0}
            for _ in range(args.rounds):
                for kind, owner in (("local", "a"), ("forwarded", "b")):
                    cpu = time.process_time()
                    ran_there[kind] += await _send(client, keys[owner], owner)
                    samples[kind].append((time.process_time() - cpu) / args.tasks * 1e6)
    finally:
        for d in (a, b):
            d.request_stop()
        await asyncio.gather(*runs, return_exceptions=True)
    for kind, values in samples.items():
        out[f"{kind}_cpu_us_per_task"] = round(statistics.median(values), 2)
        out[f"{kind}_rounds_us"] = [round(v, 1) for v in values]
        out[f"{kind}_ran_at_its_owner"] = round(ran_there[kind] / (args.tasks * args.rounds), 3)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    report = asyncio.run(main(parser.parse_args()))
    if "--json" in sys.argv:
        print(json.dumps(report))
    else:
        for kind in ("local", "forwarded"):
            print(
                f"{kind:9s} {report[f'{kind}_cpu_us_per_task']:7.1f} us of CPU a task "
                f"(median of {report['rounds']}; {report[f'{kind}_rounds_us']}), "
                f"{report[f'{kind}_ran_at_its_owner']:.0%} ran at the key's owner"
            )
