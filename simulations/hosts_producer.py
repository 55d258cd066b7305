"""The bed's producer: keyed tasks at a rate from the producer host, every answer per id.

Run inside the producer's namespace (``ip netns exec gsdbed-prod python -m
simulations.hosts_producer ...``): a ``gossipd.tools.client.Client`` connected to every
daemon's ingress, its reply address on the producer host's own address (``--reply-bind``),
CURVE with the producer's key pair when given.  It submits ``--rate`` tasks a second for
``--duration`` s (keys drawn from ``--keys``), waits for every task to end, and prints one
JSON object: sent, ok, failed by code, lost (no ok Result), the ids answered ok twice (two ok
Results) without ever being resent (resubmitted, or retried after a retryable code) and those
answered twice after a resend, per node how many
tasks it answered, and per lost id its final error (code, message, the node that gave it, how
many times it was resent: ``lost_detail``).  ``--ids FILE`` writes one JSON line per id: its key, every final Result
(ok or code, node, seconds after submission) and how many times it was resent.
SIGTERM ends the sending early (the tasks sent are still waited for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gossipd.core.messages import Chunk, Result
from gossipd.tools.client import Client, ProducerKeys, TaskHandle

LOST_DETAIL_MAX = 20  # ids whose final error is reported, and retried unavailable answers
ERROR_MESSAGE_CHARS_MAX = 600


@dataclass
class IdRecord:
    key: str
    sent_at: float
    resent: int = 0
    results: list[tuple[str, str, float]] = field(default_factory=list)  # (ok|code, node, dt)


class RecordingClient(Client):
    """A Client that also records every final Result per id (the Client keeps the first and
    only counts the others) and every resend, for "answered twice without resubmission"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: dict[str, IdRecord] = {}
        # Answers retried (a retryable code for an outstanding id), per code, and the first
        # few unavailable ones: how often the cluster said "later" and why.
        self.retried_codes: Counter[str] = Counter()
        self.unavailable_examples: list[dict[str, str]] = []

    def _resend(
        self, handle: TaskHandle, loop: asyncio.AbstractEventLoop, *args: Any, **kwargs: Any
    ) -> None:
        record = self.records.get(handle.id)
        if record is not None:
            record.resent += 1
        super()._resend(handle, loop, *args, **kwargs)

    def _on_one_reply(self, reply: Chunk | Result, loop: asyncio.AbstractEventLoop) -> None:
        if type(reply) is Result:
            record = self.records.get(reply.id)
            if record is not None and (
                reply.error is None
                or reply.error.code not in self._retry_codes
                or reply.id not in self._outstanding
            ):
                outcome = "ok" if reply.error is None else reply.error.code
                record.results.append(
                    (outcome, reply.node, round(time.monotonic() - record.sent_at, 3))
                )
            elif record is not None and reply.error is not None:
                code = reply.error.code
                self.retried_codes[code] += 1
                if code == "unavailable" and len(self.unavailable_examples) < LOST_DETAIL_MAX:
                    self.unavailable_examples.append(
                        {
                            "id": reply.id,
                            "node": reply.node,
                            "message": reply.error.message[:ERROR_MESSAGE_CHARS_MAX],
                        }
                    )
        super()._on_one_reply(reply, loop)


def lost_detail(task_id: str, record: IdRecord, result: Result | None) -> dict[str, Any]:
    """Why a task was lost, as far as the producer can tell: its final Result's error."""
    detail: dict[str, Any] = {"id": task_id, "key": record.key, "resent": record.resent}
    if result is None:
        detail["code"] = "no_result"
    elif result.error is not None:
        detail["code"] = result.error.code
        detail["node"] = result.node
        detail["message"] = result.error.message[:ERROR_MESSAGE_CHARS_MAX]
    return detail


def summarise(
    records: dict[str, IdRecord], final: dict[str, Result], elapsed_s: float
) -> dict[str, Any]:
    failed: Counter[str] = Counter()
    per_node: Counter[str] = Counter()
    twice_plain, twice_resent, lost = [], [], []
    details: list[dict[str, Any]] = []
    for task_id, record in records.items():
        result = final.get(task_id)
        if result is None or result.error is not None:
            lost.append(task_id)
            if len(details) < LOST_DETAIL_MAX:
                details.append(lost_detail(task_id, record, result))
            failed[result.error.code if result and result.error else "no_result"] += 1
        else:
            per_node[result.node] += 1
        if sum(1 for r in record.results if r[0] == "ok") >= 2:
            (twice_resent if record.resent else twice_plain).append(task_id)
    return {
        "sent": len(records),
        "ok": len(records) - len(lost),
        "failed": dict(failed),
        "lost": len(lost),
        "lost_ids": lost[:50],
        "lost_detail": details,
        "answered_twice_without_resubmission": len(twice_plain),
        "answered_twice_without_resubmission_ids": twice_plain[:50],
        "answered_twice_after_resubmission": len(twice_resent),
        "resubmitted": sum(1 for r in records.values() if r.resent),
        "answered_by": dict(sorted(per_node.items())),
        "elapsed_s": round(elapsed_s, 2),
    }


async def produce(args: argparse.Namespace) -> dict[str, Any]:
    curve = None
    if args.secret_key:
        curve = ProducerKeys.from_files(args.secret_key, args.server_key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    final: dict[str, Result] = {}
    started = time.monotonic()
    async with RecordingClient(
        args.endpoint,
        reply_bind=args.reply_bind,
        curve=curve,
        resubmit_after_s=args.resubmit_after,
        outstanding_max=100_000,
        id_prefix=args.id_prefix,
        connect_timeout_s=10.0,
    ) as client:
        waiters: list[asyncio.Task[None]] = []

        async def wait(handle: TaskHandle) -> None:
            final[handle.id] = await handle.result()

        total = int(args.rate * args.duration)
        next_progress = started + 5
        for i in range(total):
            due = started + i / args.rate
            now = time.monotonic()
            if due > now:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), due - now)
            if stop.is_set():
                break
            key = f"k{i % args.keys}"
            task_id = f"{args.id_prefix}-{i}"
            client.records[task_id] = IdRecord(key=key, sent_at=time.monotonic())
            handle = await client.submit(
                f"task {i}",
                task_id=task_id,
                key=key,
                max_tokens=args.max_tokens,
                timeout_s=args.timeout,
            )
            waiters.append(loop.create_task(wait(handle)))
            if time.monotonic() >= next_progress:
                next_progress += 5
                print(
                    f"producer: {i + 1}/{total} sent, {len(final)} ended",
                    file=sys.stderr,
                    flush=True,
                )
        await asyncio.gather(*waiters)
        await asyncio.sleep(args.linger)  # late second answers still count
        records = client.records
    report = summarise(records, final, time.monotonic() - started)
    report["retried_answers"] = dict(client.retried_codes)
    report["unavailable_retried_examples"] = client.unavailable_examples
    if args.ids:
        with open(args.ids, "w") as fh:
            for task_id, record in records.items():
                fh.write(
                    json.dumps(
                        {
                            "id": task_id,
                            "key": record.key,
                            "resent": record.resent,
                            "results": record.results,
                        }
                    )
                    + "\n"
                )
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.hosts_producer")
    p.add_argument("--endpoint", "-e", action="append", required=True)
    p.add_argument("--reply-bind", required=True, help="tcp://PRODUCER_ADDR:*")
    p.add_argument("--secret-key", default="")
    p.add_argument("--server-key", action="append", default=[])
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--keys", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--timeout", type=float, default=60.0, help="task deadline, s")
    p.add_argument("--resubmit-after", type=float, default=5.0)
    p.add_argument("--linger", type=float, default=3.0, help="s to wait for late answers")
    p.add_argument("--id-prefix", default="bed")
    p.add_argument("--ids", help="write one JSON line per id here")
    args = p.parse_args(argv)
    import uvloop

    report = uvloop.run(produce(args))
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
