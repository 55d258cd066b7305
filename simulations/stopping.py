"""What stopping a daemon costs its producers, measured the way a third-party soak did: real
daemons on loopback, a plain pyzmq producer pushing keyed tasks to all of them at a steady
rate, one daemon stopped (SIGTERM, or SIGKILL to compare) halfway.

    python -m simulations stopping [--nodes 3] [--rate 1000] [--signal TERM] [--json]

The producer is the soak's: one PUSH socket connected to every daemon (ZMQ_IMMEDIATE: it only
hands tasks to completed connections), a PULL socket for replies; a task with no final Result
after ``resubmit_s`` is sent again (same id), a shutting_down or overloaded answer is sent
again after its retry_after_ms hint.  Figures: tasks lost (no final Result by the end), tasks
whose final Result came more than ``slow_s`` after their first send (they waited for the
resubmission timer, or for several refusals), the answers by code, and how many resubmissions
the timer made.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from gossipd.tools.progress import summarize
from simulations.cluster import Cluster

RETRY_CODES = ("shutting_down", "overloaded")


@dataclass
class StopRun:
    nodes: int = 3
    rate_per_s: float = 1000.0
    before_s: float = 3.0  # steady sending before the signal
    after_s: float = 4.0  # and after it
    victim: int = 1
    sig: str = "TERM"  # TERM or KILL
    keys: int = 300
    resubmit_s: float = 3.0
    slow_s: float = 1.0
    seed: int = 1
    immediate: bool = True
    log_dir: str | None = None
    extra_overrides: list[str] = field(default_factory=list)


@dataclass
class _Task:
    id: str
    frame: bytes
    first_sent: float
    generation: int = 0  # bumped at each send: timers of older generations are stale
    done_at: float = 0.0
    code: str = ""
    node: str = ""
    timer_resends: int = 0
    retries: int = 0


TIMER, RETRY = "timer", "retry"


class SoakProducer:
    """A plain producer: pyzmq + msgpack, no gossipd code on the wire."""

    def __init__(self, endpoints: list[str], *, immediate: bool, resubmit_s: float) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.reply_to = f"tcp://127.0.0.1:{port}"
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        if immediate:
            self.push.setsockopt(zmq.IMMEDIATE, 1)
        for endpoint in endpoints:
            self.push.connect(endpoint)
        self.resubmit_s = resubmit_s
        self.tasks: dict[str, _Task] = {}
        self.answers: dict[str, int] = {}
        self._timers: list[tuple[float, int, str, int, str]] = []  # (at, seq, id, gen, kind)
        self._seq = 0

    def send_new(self, task_id: str, key: str, now: float) -> None:
        frame = msgpack.packb(
            {
                "v": 1,
                "t": 1,
                "id": task_id,
                "key": key,
                "prompt": "stop soak",
                "reply_to": self.reply_to,
                "params": {"max_tokens": 2},
                "timeout_ms": 60_000,
            }
        )
        task = self.tasks[task_id] = _Task(task_id, frame, now)
        self._send(task, now)

    def _send(self, task: _Task, now: float) -> None:
        # zmq.Again: no daemon connected at all this instant; the timer resends it.
        with contextlib.suppress(zmq.Again):
            self.push.send(task.frame, zmq.NOBLOCK)
        task.generation += 1
        self._arm(task, now + self.resubmit_s, TIMER)

    def _arm(self, task: _Task, at: float, kind: str) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (at, self._seq, task.id, task.generation, kind))

    def poll(self, timeout_s: float) -> None:
        """Read replies for up to ``timeout_s``, and resend what is due."""
        if self.pull.poll(max(0, int(timeout_s * 1000))):
            while True:
                try:
                    reply = msgpack.unpackb(self.pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                self._on_reply(reply, time.monotonic())
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, task_id, generation, kind = heapq.heappop(self._timers)
            task = self.tasks[task_id]
            if task.done_at or generation != task.generation:
                continue  # answered, or a newer send re-armed it
            if kind == TIMER:
                task.timer_resends += 1
            self._send(task, now)

    def _on_reply(self, reply: dict[str, Any], now: float) -> None:
        if reply.get("t") != 3:
            return
        task = self.tasks.get(reply["id"])
        if task is None or task.done_at:
            return
        code = "ok" if reply.get("ok") else reply["error"]["code"]
        self.answers[code] = self.answers.get(code, 0) + 1
        if code in RETRY_CODES:
            task.retries += 1
            task.generation += 1  # the resubmission timer of the refused send is void
            hint_s = reply["error"].get("retry_after_ms", 0) / 1000.0
            self._arm(task, now + hint_s, RETRY)
            return
        task.done_at, task.code, task.node = now, code, reply.get("node", "")

    def outstanding(self) -> int:
        return sum(1 for t in self.tasks.values() if not t.done_at)

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


def run_stop(run: StopRun, say: Any = None) -> dict[str, Any]:
    """Start ``run.nodes`` daemons, send at ``rate_per_s`` for before_s + after_s seconds with
    the signal in between, wait for every answer (or resubmit_s + 3 s), and report."""
    say = say or (lambda text: None)
    rng = random.Random(run.seed)
    cluster = Cluster(
        run.nodes,
        log_dir=run.log_dir or tempfile.mkdtemp(prefix="gossipd-stopping-"),
        extra_overrides=list(run.extra_overrides),
    )
    producer: SoakProducer | None = None
    try:
        cluster.start()
        cluster.wait_converged(timeout_s=30)
        cluster.wait_meta(timeout_s=30)
        producer = SoakProducer(
            [d.endpoint for d in cluster.daemons],
            immediate=run.immediate,
            resubmit_s=run.resubmit_s,
        )
        time.sleep(0.3)  # the producer's connections complete
        victim = cluster.daemons[run.victim]
        sig = signal.SIGTERM if run.sig == "TERM" else signal.SIGKILL
        t0 = time.monotonic()
        signal_at = t0 + run.before_s
        end_at = signal_at + run.after_s
        signalled = 0.0
        n = 0
        keys = [f"session-{i}" for i in range(run.keys)]
        while True:
            now = time.monotonic()
            if not signalled and now >= signal_at:
                victim.signal(sig)
                signalled = now
                say(f"{run.sig} to {victim.name} after {n} tasks")
            if now >= end_at:
                break
            due = int((now - t0) * run.rate_per_s)
            while n < due:
                n += 1
                producer.send_new(f"s{n}", rng.choice(keys), now)
            producer.poll(min(0.001, max(0.0, t0 + (n + 1) / run.rate_per_s - now)))
        say(f"sent {n} tasks; waiting for the answers")
        wait_until = time.monotonic() + run.resubmit_s + 3.0
        while producer.outstanding() and time.monotonic() < wait_until:
            producer.poll(0.05)
        victim.wait(30)
        tasks = list(producer.tasks.values())
        after = [t for t in tasks if t.first_sent >= signalled]
        done = [t for t in tasks if t.done_at]
        slow = [t for t in done if t.done_at - t.first_sent > run.slow_s]
        stopping_events = [e for e in victim.events() if e.get("msg") == "drained"]
        return {
            "nodes": run.nodes,
            "rate_per_s": run.rate_per_s,
            "signal": run.sig,
            "victim": victim.name,
            "immediate": run.immediate,
            "tasks": len(tasks),
            "sent_after_signal": len(after),
            "lost": len(tasks) - len(done),
            "lost_sent_after_signal": sum(1 for t in after if not t.done_at),
            "final_over_slow_s": len(slow),
            "slow_s": run.slow_s,
            "timer_resubmissions": sum(t.timer_resends for t in tasks),
            "tasks_resubmitted_by_timer": sum(1 for t in tasks if t.timer_resends),
            "retried_after_refusal": sum(1 for t in tasks if t.retries),
            "answers": dict(sorted(producer.answers.items())),
            "final_by_code": _count(t.code for t in done),
            "final_by_node": _count(t.node for t in done),
            "latency_ms": summarize([(t.done_at - t.first_sent) * 1e3 for t in done]),
            "victim_exit": victim.proc.returncode if victim.proc is not None else None,
            "victim_drained": stopping_events[-1] if stopping_events else None,
            "log_dir": str(cluster.log_dir),
        }
    finally:
        if producer is not None:
            producer.close()
        cluster.stop()


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m simulations stopping",
        description="Stop one of N daemons under a steady keyed load; count what it cost.",
    )
    p.add_argument("--nodes", type=int, default=3, help="daemons on loopback (default 3)")
    p.add_argument("--rate", type=float, default=1000.0, help="tasks per second, all daemons")
    p.add_argument("--before-s", type=float, default=3.0, help="sending before the signal")
    p.add_argument("--after-s", type=float, default=4.0, help="sending after the signal")
    p.add_argument("--signal", choices=["TERM", "KILL"], default="TERM")
    p.add_argument("--victim", type=int, default=1, help="index of the daemon to stop")
    p.add_argument("--resubmit-s", type=float, default=3.0, help="the producer's timer")
    p.add_argument("--slow-s", type=float, default=1.0, help="a final Result later is slow")
    p.add_argument(
        "--no-immediate",
        action="store_true",
        help="the producer's PUSH queues to disconnected daemons too (no ZMQ_IMMEDIATE)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="a daemon config override")
    p.add_argument("--json", action="store_true", help="one JSON object, no progress")
    args = p.parse_args(argv)
    run = StopRun(
        nodes=args.nodes,
        rate_per_s=args.rate,
        before_s=args.before_s,
        after_s=args.after_s,
        victim=args.victim,
        sig=args.signal,
        resubmit_s=args.resubmit_s,
        slow_s=args.slow_s,
        seed=args.seed,
        immediate=not args.no_immediate,
        extra_overrides=args.set,
    )
    say = None if args.json else (lambda text: print(text, file=sys.stderr, flush=True))
    report = run_stop(run, say)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0
