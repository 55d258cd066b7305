"""A closed-loop load generator over raw pyzmq: keep ``window`` tasks outstanding, record the
latency of each from send to reply.  Used against the daemon and the baseline alike, so the
generator's own cost is the same on both sides of every ratio."""

from __future__ import annotations

import itertools
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from gossipd.core.codec import pack_tasks
from gossipd.core.messages import PROTOCOL_VERSION, MsgType, Task, encode
from gossipd.core.sampling import SamplingParams
from gossipd.tools.curvekeys import CurveLayout
from gossipd.tools.packing import PACK_BYTES_MAX, PACK_ITEMS_MAX
from gossipd.tools.progress import percentile

REPLIES, RESULT = int(MsgType.REPLIES), int(MsgType.RESULT)


@dataclass(frozen=True)
class LoadResult:
    tasks: int
    ok: int
    elapsed_s: float
    latencies_ms: list[float]
    by_task_ms: dict[int, float] | None = None  # task index -> latency (drive_many)

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.elapsed_s

    def summary(self) -> dict[str, float]:
        lat = sorted(self.latencies_ms)
        return {
            "tasks_per_s": round(self.tasks_per_s, 1),
            "p50_ms": round(percentile(lat, 50), 3),
            "p99_ms": round(percentile(lat, 99), 3),
            "ok": self.ok,
        }


def final_results(pull: zmq.Socket, timeout_ms: int) -> list[dict[str, Any]]:
    """The final Results (``t`` = 3, as maps) queued on ``pull``, after waiting up to
    ``timeout_ms`` for the first message; chunks and other messages are skipped."""
    out: list[dict[str, Any]] = []
    if not pull.poll(timeout_ms):
        return out
    while True:
        try:
            reply = msgpack.unpackb(pull.recv(zmq.NOBLOCK))
        except zmq.Again:
            return out
        if reply.get("t") == 3:
            out.append(reply)


def make_frames(
    n: int,
    reply_to: str,
    *,
    run: str,
    max_tokens: int = 1,
    keys: list[str] | None = None,
    batch_replies: bool = False,
) -> list[tuple[str, bytes]]:
    params = SamplingParams(max_tokens=max_tokens)
    out = []
    for i in range(n):
        task = Task(
            v=PROTOCOL_VERSION,
            id=f"{run}-{i}",
            prompt=f"word{i} and more",
            params=params,
            reply_to=reply_to,
            key=keys[i] if keys else "",
            batch_replies=batch_replies,
        )
        out.append((task.id, encode(task)))
    return out


@dataclass(frozen=True)
class ProducerCurve:
    """CURVE for the generator: its key pair and each endpoint's server key (z85)."""

    public: bytes
    secret: bytes
    server_keys: list[bytes]


def one_daemon_keys(prefix: str) -> tuple[CurveLayout, ProducerCurve]:
    """CURVE keys in a fresh directory for one daemon, "bench" (``layout.overrides("bench")``
    starts it with them), and one producer, as ``drive`` takes them."""
    layout = CurveLayout(tempfile.mkdtemp(prefix=prefix), nodes=["bench"], producers=["producer"])
    public, secret = layout.pair("producer")
    return layout, ProducerCurve(public, secret, [layout.public("bench")])


def drive(
    endpoint: str,
    n: int,
    window: int,
    *,
    run: str,
    timeout_s: float = 120.0,
    curve: ProducerCurve | None = None,
    batch_replies: bool = False,
    batch_tasks: bool = False,
) -> LoadResult:
    return drive_many(
        [endpoint],
        n,
        window,
        run=run,
        timeout_s=timeout_s,
        curve=curve,
        batch_replies=batch_replies,
        batch_tasks=batch_tasks,
    )


def drive_many(
    endpoints: list[str],
    n: int,
    window: int,
    *,
    run: str,
    timeout_s: float = 120.0,
    entry_of: list[int] | None = None,
    keys: list[str] | None = None,
    curve: ProducerCurve | None = None,
    batch_replies: bool = False,
    batch_tasks: bool = False,
) -> LoadResult:
    """Like ``drive``; task i enters at ``endpoints[entry_of[i]]`` with key ``keys[i]``;
    ``curve``: over CurveZMQ (the reply PULL served with the generator's key pair);
    ``batch_replies``: the tasks ask for Replies frames (several results in one frame);
    ``batch_tasks``: the tasks of one refill of the window go to each endpoint as Tasks
    frames, bounded as gossipd's Client bounds them (``packing.PACK_ITEMS_MAX`` tasks and
    ``PACK_BYTES_MAX`` bytes a frame)."""
    ctx: zmq.Context = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        pull.curve_server = True
        pull.curve_publickey, pull.curve_secretkey = curve.public, curve.secret
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    pushes = []
    for i, endpoint in enumerate(endpoints):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey = curve.public, curve.secret
            sock.curve_serverkey = curve.server_keys[i]
        sock.connect(endpoint)
        pushes.append(sock)
    entry_of = entry_of or [0] * n
    by_task: dict[int, float] = {}
    index = {}
    reply_to = f"tcp://127.0.0.1:{port}"
    frames = make_frames(n, reply_to, run=run, keys=keys, batch_replies=batch_replies)
    packs = itertools.count()

    def pack(group: list[bytes]) -> bytes:  # as the Client packs: with a pack id and reply_to
        return pack_tasks(group, pack_id=f"{run}-pack-{next(packs)}", reply_to=reply_to)

    for i, (task_id, _) in enumerate(frames):
        index[task_id] = i
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    ok = 0
    next_i = 0
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    clock = time.perf_counter

    def _send_packed(frames: list[tuple[str, bytes]], first: int, left: int, room: int) -> int:
        """Send the next ``min(left, room)`` tasks packed per endpoint; the next index."""
        groups: dict[int, list[bytes]] = {}
        sizes: dict[int, int] = {}
        now = clock()
        end = first + min(left, room)
        for i in range(first, end):
            task_id, frame = frames[i]
            sent_at[task_id] = now
            e = entry_of[i]
            group = groups.setdefault(e, [])
            if group and (len(group) >= PACK_ITEMS_MAX or sizes[e] + len(frame) > PACK_BYTES_MAX):
                pushes[e].send(pack(group))
                group.clear()
                sizes[e] = 0
            group.append(frame)
            sizes[e] = sizes.get(e, 0) + len(frame)
        for e, group in groups.items():
            if group:
                pushes[e].send(group[0] if len(group) == 1 else pack(group))
        return end

    started = clock()
    try:
        while len(latencies) < n:
            if batch_tasks:
                next_i = _send_packed(frames, next_i, n - next_i, window - len(sent_at))
            while next_i < n and len(sent_at) < window:
                task_id, frame = frames[next_i]
                sent_at[task_id] = clock()
                pushes[entry_of[next_i]].send(frame)
                next_i += 1
            if not poller.poll(1000) and clock() - started > timeout_s:
                raise TimeoutError(f"{len(latencies)}/{n} replies after {timeout_s} s")
            while True:
                try:
                    data = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = msgpack.unpackb(data)
                for reply in msg["items"] if msg.get("t") == REPLIES else (msg,):
                    t0 = sent_at.pop(reply["id"], None)
                    if t0 is None or reply.get("t") != RESULT:
                        continue
                    latencies.append((clock() - t0) * 1e3)
                    by_task[index[reply["id"]]] = latencies[-1]
                    ok += bool(reply["ok"])
        elapsed = clock() - started
    finally:
        for sock in pushes:
            sock.close(linger=0)
        pull.close(linger=0)
    return LoadResult(tasks=n, ok=ok, elapsed_s=elapsed, latencies_ms=latencies, by_task_ms=by_task)
