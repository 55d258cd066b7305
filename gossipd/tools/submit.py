"""`gossipd submit`: send one prompt or a JSONL file of tasks and report how they went.

A task line is a JSON object: {"prompt": str, "id"?: str, "key"?: str, "params"?: {...},
"stream"?: bool, "timeout_ms"?: int, "model"?: str} (README.md, "Submitting a file of
tasks").  A line that is not a valid task counts as a failed task (bad_request, with its
line number) and is not sent.  ``--out FILE`` writes every Result as one JSON object per line,
with ``line``, the task's line number.  The exit status is 1 when any task failed, and when no
daemon accepts a connection within ``--connect-timeout`` (the message names the endpoints).
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from gossipd.core.messages import ErrorCode, Result, TaskId, error_result
from gossipd.core.sampling import SamplingParams
from gossipd.tools.client import DEFAULT_REPLY_BIND, Client, ProducerKeys, TaskHandle
from gossipd.tools.progress import Progress, percentile


@dataclass
class SubmitReport:
    total: int = 0
    ok: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    resubmitted: int = 0
    retried: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Latencies are of the tasks that succeeded: null when none did."""
        lat = sorted(self.latencies_ms)
        return {
            "total": self.total,
            "ok": self.ok,
            "failed": dict(self.failed),
            "tasks_per_s": round(self.total / self.elapsed_s, 1) if self.elapsed_s else 0.0,
            "latency_ms": {
                "p50": round(percentile(lat, 50), 3) if lat else None,
                "p99": round(percentile(lat, 99), 3) if lat else None,
            },
            "resubmitted": self.resubmitted,
            "retried": self.retried,
        }


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str
    id: TaskId | None = None  # the daemon's rule (1..128 characters): else not sent
    key: str = ""
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] = 30_000  # (the Task's)
    model: str = ""


NumberedLine = tuple[int, _Line | str]


# Read from the file at a time (in a thread: a pipe's reader waits there, not in the loop
# that takes the Results).
READ_BLOCK_BYTES = 64 * 1024
# A line longer than this is refused unread (no daemon takes a message over 256 MiB,
# ingress.message_bytes_max's ceiling), rather than held whole.
LINE_BYTES_MAX = 256 * 1024 * 1024


async def read_task_lines(fh: io.BufferedReader, path: Path) -> AsyncIterator[NumberedLine]:
    """(line number, the task or an error string "FILE:N: why") for each non-blank line, read
    as the tasks are sent: a file larger than memory, or a pipe, streams through.  A line
    that is not UTF-8 JSON of a task is that line's error, and so is one whose id an earlier
    line has (it would get that task's result).  Only the ids are kept, to see repeats."""
    seen: dict[str, int] = {}
    number = 0
    rest = bytearray()  # the line under way (cleared once over LINE_BYTES_MAX: skipped)
    too_long = False

    def ended() -> NumberedLine | None:
        """The line in ``rest`` is whole: what it holds (None: a blank line)."""
        nonlocal number, too_long
        number += 1
        raw, was_too_long = bytes(rest), too_long
        rest.clear()
        too_long = False
        if was_too_long:
            return number, f"{path}:{number}: a line over {LINE_BYTES_MAX} bytes"
        return (number, _task_line(raw, path, number, seen)) if raw.strip() else None

    while block := await asyncio.to_thread(fh.read1, READ_BLOCK_BYTES):
        *whole, tail = block.split(b"\n")
        for piece in whole:
            if not too_long:
                rest += piece
            if (line := ended()) is not None:
                yield line
        if not too_long:
            rest += tail
            if len(rest) > LINE_BYTES_MAX:  # (goes on in the next block: not held whole)
                rest.clear()
                too_long = True
    # (the last line, without a newline)
    if (rest or too_long) and (line := ended()) is not None:
        yield line


def _task_line(raw: bytes, path: Path, number: int, seen: dict[str, int]) -> _Line | str:
    try:
        line = msgspec.json.decode(raw, type=_Line)
    except msgspec.DecodeError as exc:
        return f"{path}:{number}: {exc}"
    if line.id is not None and line.id in seen:
        return (
            f"{path}:{number}: id {line.id!r} is line {seen[line.id]}'s too: each task its own id"
        )
    if line.id is not None:
        seen[line.id] = number
    return line


async def numbered(lines: list[_Line]) -> AsyncIterator[NumberedLine]:
    """Tasks made in the program, numbered from 1, as submit_many takes them."""
    for number, line in enumerate(lines, 1):
        yield number, line


def count_task_lines(path: Path) -> int | None:
    """The non-blank lines of a regular file, for the progress bar; None for a pipe or a
    device (read once, as it comes)."""
    if not path.is_file():
        return None
    with path.open("rb") as fh:
        return sum(1 for raw in fh if raw.strip())


class ResultWriter:
    """``--out FILE``: each Result as one JSON object per line, in the order they end, with
    ``line`` (the task's line number in the input) added; a line that was no valid task gets
    a ``bad_request`` Result with the id "FILE:N"."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("w", buffering=1)  # a line as each Result ends: tail -f shows it
        self.written = 0

    def write(self, result: Result, line: int) -> None:
        record = msgspec.to_builtins(result)
        record["line"] = line
        self._fh.write(json.dumps(record) + "\n")
        self.written += 1

    def close(self) -> None:
        self._fh.close()


async def submit_many(
    endpoints: list[str],
    numbered: AsyncIterable[NumberedLine],
    *,
    total: int | None,
    resubmit_after_s: float,
    window: int,
    show_progress: bool,
    on_result: Any = None,
    connect_timeout_s: float | None = None,
    out: ResultWriter | None = None,
    curve: ProducerKeys | None = None,
    pack_tasks: bool = True,
    reply_bind: str = DEFAULT_REPLY_BIND,
) -> SubmitReport:
    """Send every task line as it is read (at most ``window`` outstanding), wait for every
    Result.  ``numbered``: (line number in the input, for ``out``; the task, or why the line
    is none); ``total``: how many there are, for progress (None: not known ahead).
    ``connect_timeout_s``: fail with ``NotConnected`` when no daemon accepts a connection
    within that long.  ``pack_tasks``: the Client's (several tasks in one Tasks frame)."""
    report = SubmitReport()
    progress = Progress(total, "submit", enabled=show_progress)
    loop = asyncio.get_running_loop()
    started = loop.time()
    done = 0

    def record(result: Result, latency_s: float) -> None:
        nonlocal done
        done += 1
        if result.ok:
            report.ok += 1
            report.latencies_ms.append(latency_s * 1e3)
        else:
            assert result.error is not None
            report.failed[result.error.code] += 1
        if on_result is not None:
            on_result(result)
        progress.update(done, f"ok={report.ok} failed={sum(report.failed.values())}")

    async with Client(
        endpoints,
        resubmit_after_s=resubmit_after_s,
        outstanding_max=window,
        connect_timeout_s=connect_timeout_s,
        curve=curve,
        pack_tasks=pack_tasks,
        reply_bind=reply_bind,
    ) as client:
        waiters: set[asyncio.Task[None]] = set()  # the outstanding tasks' (at most window)

        async def wait(handle: TaskHandle, number: int) -> None:
            result = await handle.result()
            record(result, loop.time() - handle.submitted_at)
            if out is not None:
                out.write(result, number)

        async for number, line in numbered:
            report.total += 1
            if isinstance(line, str):
                report.failed["bad_request"] += 1
                done += 1
                print(f"refused: {line}", file=sys.stderr)
                if out is not None:
                    where, _, why = line.partition(": ")
                    out.write(
                        error_result(where[-128:], ErrorCode.BAD_REQUEST, why, node="client"),
                        number,
                    )
                continue
            handle = await client.submit(
                line.prompt,
                task_id=line.id,
                key=line.key,
                params=line.params,
                timeout_s=line.timeout_ms / 1000.0,
                stream=line.stream,
                model=line.model,
            )
            waiter = loop.create_task(wait(handle, number))
            waiters.add(waiter)
            waiter.add_done_callback(waiters.discard)
        await asyncio.gather(*waiters)
        stats = client.statistics()
        report.resubmitted, report.retried = stats.resubmitted, stats.retried
    report.elapsed_s = loop.time() - started
    progress.close(done, f"ok={report.ok} failed={sum(report.failed.values())}")
    return report


def print_report(report: SubmitReport, *, as_json: bool) -> None:
    d = report.as_dict()
    if as_json:
        print(json.dumps(d))
        return
    failed = ", ".join(f"{code}={n}" for code, n in sorted(d["failed"].items())) or "none"
    lat = d["latency_ms"]
    latency = (
        f"latency p50 {lat['p50']} ms, p99 {lat['p99']} ms"
        if lat["p50"] is not None
        else "latency n/a (no task succeeded)"
    )
    print(
        f"{d['total']} tasks: {d['ok']} ok, failed: {failed}; "
        f"{d['tasks_per_s']} tasks/s; {latency}; "
        f"resubmitted {d['resubmitted']}, retried {d['retried']}"
    )


async def submit_one(
    endpoints: list[str],
    prompt: str,
    *,
    max_tokens: int,
    timeout_s: float,
    stream: bool,
    key: str,
    as_json: bool,
    connect_timeout_s: float | None = None,
    curve: ProducerKeys | None = None,
    reply_bind: str = DEFAULT_REPLY_BIND,
) -> int:
    async with Client(
        endpoints, connect_timeout_s=connect_timeout_s, curve=curve, reply_bind=reply_bind
    ) as client:
        handle = await client.submit(
            prompt, max_tokens=max_tokens, timeout_s=timeout_s, stream=stream, key=key
        )
        if stream and not as_json:
            async for delta in handle.deltas():
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
        result = await handle.result()
    if stream and not as_json:
        print(status_line(result), file=sys.stderr)
        return 0 if result.ok else 1
    if as_json:
        print(msgspec.json.encode(result).decode())
    elif not result.ok:
        assert result.error is not None
        print(f"error {result.error.code}: {result.error.message}", file=sys.stderr)
    elif not stream:
        print(result.text)
    return 0 if result.ok else 1


def status_line(result: Result) -> str:
    """The line ``submit --stream`` ends with (on stderr): how the task ended, where, and how
    long it took."""
    t = result.timings
    if result.ok:
        return (
            f"[ok: {result.chunks} chunks from {result.node or '?'}, first token "
            f"{t.first_token_ms:.1f} ms, total {t.total_ms:.1f} ms, attempts {result.attempts}]"
        )
    assert result.error is not None
    return f"[error {result.error.code} from {result.node or '?'}: {result.error.message}]"
