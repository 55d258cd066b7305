"""`gossipd submit`: send one prompt or a JSONL file of tasks and report how they went.

A task line is a JSON object: {"prompt": str, "id"?: str, "key"?: str, "params"?: {...},
"stream"?: bool, "timeout_ms"?: int, "model"?: str}.  A line that is not a valid task counts
as a failed task (bad_request, with its line number) and is not sent.  The exit status is 1
when any task failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gossipd.core.messages import Result, SamplingParams
from gossipd.tools.client import Client, ProducerKeys, TaskHandle
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
        lat = sorted(self.latencies_ms)
        return {
            "total": self.total,
            "ok": self.ok,
            "failed": dict(self.failed),
            "tasks_per_s": round(self.total / self.elapsed_s, 1) if self.elapsed_s else 0.0,
            "latency_ms": {
                "p50": round(percentile(lat, 50), 3),
                "p99": round(percentile(lat, 99), 3),
            },
            "resubmitted": self.resubmitted,
            "retried": self.retried,
        }


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str
    id: str | None = None
    key: str = ""
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    timeout_ms: int = 30_000
    model: str = ""


def read_task_lines(path: Path) -> list[_Line | str]:
    """Each line parsed, or an error string naming the line."""
    out: list[_Line | str] = []
    with path.open() as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                out.append(msgspec.json.decode(raw, type=_Line))
            except msgspec.DecodeError as exc:
                out.append(f"{path}:{number}: {exc}")
    return out


async def submit_many(
    endpoints: list[str],
    lines: list[_Line | str],
    *,
    resubmit_after_s: float,
    window: int,
    show_progress: bool,
    on_result: Any = None,
    curve: ProducerKeys | None = None,
) -> SubmitReport:
    report = SubmitReport(total=len(lines))
    progress = Progress(len(lines), "submit", enabled=show_progress)
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
        endpoints, resubmit_after_s=resubmit_after_s, outstanding_max=window, curve=curve
    ) as client:
        waiters: list[asyncio.Task[None]] = []

        async def wait(handle: TaskHandle) -> None:
            result = await handle.result()
            record(result, loop.time() - handle.submitted_at)

        for line in lines:
            if isinstance(line, str):
                report.failed["bad_request"] += 1
                done += 1
                print(f"refused: {line}", file=sys.stderr)
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
            waiters.append(loop.create_task(wait(handle)))
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
    print(
        f"{d['total']} tasks: {d['ok']} ok, failed: {failed}; "
        f"{d['tasks_per_s']} tasks/s; latency p50 {d['latency_ms']['p50']} ms, "
        f"p99 {d['latency_ms']['p99']} ms; resubmitted {d['resubmitted']}, retried {d['retried']}"
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
    curve: ProducerKeys | None = None,
) -> int:
    async with Client(endpoints, curve=curve) as client:
        handle = await client.submit(
            prompt, max_tokens=max_tokens, timeout_s=timeout_s, stream=stream, key=key
        )
        if stream and not as_json:
            async for delta in handle.deltas():
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
        result = await handle.result()
    if as_json:
        print(msgspec.json.encode(result).decode())
    elif not result.ok:
        assert result.error is not None
        print(f"error {result.error.code}: {result.error.message}", file=sys.stderr)
    elif not stream:
        print(result.text)
    return 0 if result.ok else 1
