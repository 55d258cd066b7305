"""Which files a forwarded task's path runs through, and which calls go back up, measured.

Two daemons in this process (real sockets, real gossip and fan-out, as tests/test_tracing.py
builds them); a Client sends tasks to daemon ``a`` whose keys daemon ``b`` owns, so each is
forwarded a -> b and answered back.  With ``--door local`` or ``--door forwarded`` the
tasks are HTTP requests instead (the bench's ``POST /v1/completions``, keep-alive
connections, 8 at a time) through ``a``'s OpenAI door, keyed (``x-session-id``) so that
``a`` or ``b`` runs them: the path of ``gossipd bench http``'s two kinds of request.  A profile hook on the loop's thread records every call
into gossipd's own modules (``gossipd/tools``, the Client, left out) while N such tasks go
through, three times, and over an idle window: the path is the modules called at least once
every other task in every round, net of what the idle daemons call in as long.  A call "goes back up" when it enters a part (a class, or a module-level function)
that is already on the stack below another part (A -> B -> A): a part calling into one that
called it.  The stacks where that happens are counted by pattern.

    .venv/bin/python scripts/path_files.py [--tasks 200] [--door local|forwarded] [--json]

Works on older trees too (it needs only Daemon, load_config, Client and Task), so the same
count can run at a base commit: ``cd BASE_TREE && python /path/to/scripts/path_files.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.getcwd())

from gossipd.config import NodeConfig, load_config
from gossipd.core.messages import PROTOCOL_VERSION, Task
from gossipd.core.sampling import SamplingParams
from gossipd.daemon import Daemon
from gossipd.tools.client import Client
from gossipd.tools.launcher import free_tcp_port

# A module on the path is called at least this often per task, net of its idle calls, in
# each of ROUNDS rounds of tasks; the idle rate from IDLE_S seconds without tasks.
PER_TASK_MIN = 0.5
ROUNDS = 3
IDLE_S = 2.0
ROOT = os.path.join(os.getcwd(), "gossipd") + os.sep
# Busy-polling's turns (gossipd/busypoll.py) are the loop's, as many as the time between
# reads allows, not a request's: off, so the count stays a count.  Its poke on each read is
# still on the path.  (Trees before it have no such key.)
POLLING_OFF = ["node.busy_poll_us=0"] if "busy_poll_us" in NodeConfig.__struct_fields__ else []


def _config(name: str, ports: dict[str, dict[str, int]], peer: str, door: bool) -> Any:
    p, q = ports[name], ports[peer]
    return load_config(
        environ={},
        overrides=[
            *([f'http.bind="127.0.0.1:{p["http"]}"'] if door else []),
            f'node.id="{name}"',
            f'ingress.bind="tcp://127.0.0.1:{p["ingress"]}"',
            f'gossip.bind="tcp://127.0.0.1:{p["gossip"]}"',
            f'gossip.seeds=["tcp://127.0.0.1:{q["gossip"]}"]',
            'gossip.preset="local"',
            f'fanout.rpc_bind="tcp://127.0.0.1:{p["rpc"]}"',
            'journal.path=""',
            *POLLING_OFF,
        ],
    )


def _module(filename: str) -> str | None:
    if not filename.startswith(ROOT):
        return None
    rel = filename[len(ROOT) :]
    if rel.startswith("tools" + os.sep):
        return None
    return rel.removesuffix(".py")


def _part(frame: Any, module: str) -> str:
    """The part a frame runs in: its module and the class (or module-level function) its
    code belongs to, ``zmqloop.SocketReader``."""
    return f"{module}.{frame.f_code.co_qualname.split('.')[0]}"


class Recorder:
    """The profile hook: modules called, and call stacks that re-enter a part (a class, or
    a module-level function) with another part between: A -> B -> A."""

    def __init__(self) -> None:
        self.modules: Counter[str] = Counter()
        self.back_up: Counter[str] = Counter()
        self.on = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        module = _module(frame.f_code.co_filename)
        if module is None:
            return
        self.modules[module] += 1
        part = _part(frame, module)
        chain = [part]
        f = frame.f_back
        while f is not None:
            m = _module(f.f_code.co_filename)
            if m is not None:
                p = _part(f, m)
                if p != chain[-1]:
                    chain.append(p)
            f = f.f_back
        # chain[0] is the callee's part, then its callers' outwards: back up when the
        # callee's part appears again further out, past another part.
        if part in chain[2:]:
            cut = chain.index(part, 2)
            self.back_up[" -> ".join(reversed(chain[: cut + 1]))] += 1


def _keys_of(owner: str, count: int) -> list[str]:
    from gossipd.core.ring import Ring

    ring = Ring({"a": 1.0, "b": 1.0})
    keys = (f"k{i}" for i in range(100_000))
    return [k for k in keys if ring.owner(k) == owner][:count]


class Door:
    """HTTP/1.1 keep-alive connections to a door, the bench's request on each in turn."""

    AT_ONCE = 8

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> Door:
        for _ in range(self.AT_ONCE):
            self.streams.append(await asyncio.open_connection("127.0.0.1", self.port))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for _, writer in self.streams:
            writer.close()

    async def _one(self, i: int, keys: list[str], owner: str) -> int:
        reader, writer = self.streams[i]
        ran_there = 0
        for key in keys[i :: self.AT_ONCE]:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                b"x-session-id: %s\r\nContent-Length: %d\r\n\r\n%s"
                % (key.encode(), len(BODY), BODY)
            )
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
            await reader.readexactly(length)
            ran_there += (
                head.startswith("http/1.1 200") and f"x-gossipd-member: {owner}\r\n" in head
            )
        return ran_there

    async def send(self, keys: list[str], owner: str) -> int:
        """How many of ``keys`` were answered 200 by ``owner``."""
        done = await asyncio.gather(*(self._one(i, keys, owner) for i in range(self.AT_ONCE)))
        return sum(done)


BODY = b'{"model":"echo","prompt":"hello world","max_tokens":1}'  # the bench's


async def _door_up(port: int) -> int:
    """``port`` once the door there takes connections (the daemon binds it as it starts)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"no HTTP door on 127.0.0.1:{port} within 30 s") from None
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return port


async def _send(client: Client, keys: list[str]) -> int:
    tasks = [
        Task(
            v=PROTOCOL_VERSION,
            id=client.new_id(),
            key=key,
            prompt="where does it go",
            params=SamplingParams(max_tokens=3),
            reply_to=client.reply_to,
        )
        for key in keys
    ]
    handles = [await client.submit_task(t) for t in tasks]
    results = await asyncio.gather(*(h.result() for h in handles))
    return sum(1 for r in results if r.ok and r.node == "b")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    door = getattr(args, "door", None)  # None: ZeroMQ tasks; "local"/"forwarded": HTTP
    names = ("ingress", "gossip", "rpc", "http")
    ports = {n: {k: free_tcp_port() for k in names} for n in "ab"}
    a = Daemon(_config("a", ports, "b", door is not None))
    b = Daemon(_config("b", ports, "a", door is not None))
    runs = [asyncio.create_task(d.run()) for d in (a, b)]
    recorder = Recorder()
    owner = "a" if door == "local" else "b"
    try:
        async with contextlib.AsyncExitStack() as stack:
            if door is None:
                endpoint = f"tcp://127.0.0.1:{ports['a']['ingress']}"
                client = await stack.enter_async_context(Client([endpoint]))

                async def send(keys: list[str], owner: str = "b") -> int:
                    return await _send(client, keys)
            else:
                http = await _door_up(ports["a"]["http"])
                connections = await stack.enter_async_context(Door(http))

                async def send(keys: list[str], owner: str = "b") -> int:
                    return await connections.send(keys, owner)

            deadline = time.monotonic() + 30
            # Until both daemons gossip and place on each other: b answers its keys.
            warm = _keys_of("b", 8)
            while await send(warm) < len(warm):
                if time.monotonic() > deadline:
                    raise SystemExit("daemon a never forwarded to b in 30 s")
                await asyncio.sleep(0.2)
            await send(_keys_of(owner, 50), owner)  # warm caches
            keys = _keys_of(owner, args.tasks)
            sys.setprofile(recorder)
            ok, rounds, back_up_calls = args.tasks, [], Counter[str]()
            for _ in range(ROUNDS):
                started = time.monotonic()
                recorder.on = True
                ok = min(ok, await send(keys, owner))
                recorder.on = False
                rounds.append((Counter(recorder.modules), time.monotonic() - started))
                back_up_calls.update(recorder.back_up)
                recorder.modules.clear()
                recorder.back_up.clear()
            await asyncio.sleep(0.5)  # the tasks' tail (TaskDones, load gossip) settles
            recorder.on = True
            await asyncio.sleep(IDLE_S)
            recorder.on = False
            sys.setprofile(None)
            idle = Counter(recorder.modules)
    finally:
        sys.setprofile(None)
        for d in (a, b):
            d.request_stop()
        await asyncio.gather(*runs, return_exceptions=True)
    # Per task, what the idle daemons would have called in as long anyway taken off; the
    # least of the rounds (a gossip timer that fired in one round is not the path).
    per_task = {
        m: min((calls[m] - idle[m] * took / IDLE_S) / args.tasks for calls, took in rounds)
        for m in set().union(*(calls for calls, _ in rounds))
    }
    path = sorted(m for m, n in per_task.items() if n >= PER_TASK_MIN)
    total = args.tasks * ROUNDS
    back_up = {p: n for p, n in back_up_calls.most_common() if n >= total // 4}
    return {
        "door": door,
        "tasks": args.tasks,
        "ok": ok,
        "path_files": len(path),
        "path": path,
        "calls_per_task": {m: round(per_task[m], 1) for m in path},
        "seen_less_than_once_a_task": sorted(m for m in per_task if m not in path),
        "calls_back_up_per_task": {p: round(n / total, 2) for p, n in back_up.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--door", choices=("local", "forwarded"), default=None)
    parser.add_argument("--json", action="store_true")
    out = asyncio.run(main(parser.parse_args()))
    if "--json" in sys.argv:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['ok']}/{out['tasks']} ok; the path runs through {out['path_files']} files:")
        for m in out["path"]:
            print(f"  {out['calls_per_task'][m]:7.1f} calls a task  {m}")
        print("seen less than once a task:", ", ".join(out["seen_less_than_once_a_task"]))
        print("calls that go back up (per task):")
        for p, n in out["calls_back_up_per_task"].items():
            print(f"  {n:6.2f}  {p}")
