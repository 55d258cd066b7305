"""Tracing (gossipd/ops/tracing.py): a forwarded task gives spans on both daemons under one
trace id; with tracing off nothing of OpenTelemetry is imported.

Two Daemon instances in this process (real sockets, real gossip and fan-out) export to the
one in-memory exporter of the process (``tracing.exporter = "memory"``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest

from gossipd.config import load_config
from gossipd.core.messages import PROTOCOL_VERSION, Task
from gossipd.core.ring import Ring
from gossipd.core.sampling import SamplingParams
from gossipd.daemon import Daemon
from gossipd.tools.client import Client
from gossipd.tools.launcher import free_tcp_port
from tests.helpers import wait_until_async

pytest.importorskip("opentelemetry.sdk.trace")

PRODUCER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN_ID = "00f067aa0ba902b7"


def _config(name: str, ports: dict[str, dict[str, int]], peer: str) -> Any:
    p, q = ports[name], ports[peer]
    return load_config(
        environ={},
        overrides=[
            f'node.id="{name}"',
            f'ingress.bind="tcp://127.0.0.1:{p["ingress"]}"',
            f'gossip.bind="tcp://127.0.0.1:{p["gossip"]}"',
            f'gossip.seeds=["tcp://127.0.0.1:{q["gossip"]}"]',
            'gossip.preset="local"',
            f'fanout.rpc_bind="tcp://127.0.0.1:{p["rpc"]}"',
            'journal.path=""',
            "tracing.enabled=true",
            'tracing.exporter="memory"',
        ],
    )


async def _two_daemons_one_forwarded_task(
    traceparent: str, *, sampled: bool = True
) -> tuple[Any, list[Any]]:
    from gossipd.ops.tracing import memory_exporter

    exporter = memory_exporter()
    exporter.clear()
    ports = {n: {k: free_tcp_port() for k in ("ingress", "gossip", "rpc")} for n in "ab"}
    a = Daemon(_config("a", ports, "b"))
    b = Daemon(_config("b", ports, "a"))
    runs = [asyncio.create_task(d.run()) for d in (a, b)]
    try:

        def both_placed() -> bool:
            return all(
                d.dispatcher is not None
                and set(d.dispatcher.placer.view().weights) == {"a", "b"}
                and set(d.dispatcher.placer.view().addrs) >= {"a", "b"} - {d.node}
                for d in (a, b)
            )

        await wait_until_async(both_placed, 20, "both daemons placing on both")
        ring = Ring({"a": 1.0, "b": 1.0})
        key = next(f"k{i}" for i in range(1000) if ring.owner(f"k{i}") == "b")
        endpoint = f"tcp://127.0.0.1:{ports['a']['ingress']}"
        async with Client([endpoint]) as client:
            task = Task(  # a producer that traces sends its context in traceparent
                v=PROTOCOL_VERSION,
                id=client.new_id(),
                key=key,
                prompt="trace me",
                params=SamplingParams(max_tokens=3),
                reply_to=client.reply_to,
                traceparent=traceparent,
            )
            result = await (await client.submit_task(task)).result()
        assert result.ok and result.node == "b", result

        if not sampled:  # nothing to wait for but both daemons being done with the task
            await wait_until_async(
                lambda: not a.tracer._open and not b.tracer._open,
                10,
                "the task done",  # type: ignore[union-attr]
            )
            return result, [s for s in exporter.get_finished_spans() if _task(s) == result.id]

        def spans() -> list[Any]:
            mine = [s for s in exporter.get_finished_spans() if _task(s) == result.id]
            names = {(s.resource.attributes["gossipd.node"], s.name) for s in mine}
            want = {("a", "receive"), ("a", "forward")} | {
                ("b", n) for n in ("receive", "queue", "engine", "reply")
            }
            return mine if want <= names else []

        return result, await wait_until_async(spans, 10, "the spans of both daemons")
    finally:
        for d in (a, b):
            d.request_stop()
        await asyncio.gather(*runs)


def _task(span: Any) -> str:
    return str(span.attributes.get("gossipd.task.id", ""))


def _by(spans: list[Any], node: str, name: str) -> Any:
    (span,) = [s for s in spans if s.resource.attributes["gossipd.node"] == node and s.name == name]
    return span


def test_a_forwarded_task_gives_spans_on_both_daemons_under_one_trace_id() -> None:
    _, spans = asyncio.run(_two_daemons_one_forwarded_task(traceparent=""))
    assert len({s.context.trace_id for s in spans}) == 1
    a_receive, a_forward = _by(spans, "a", "receive"), _by(spans, "a", "forward")
    b_receive = _by(spans, "b", "receive")
    assert a_receive.parent is None  # no traceparent from the producer: a new trace
    assert a_forward.parent.span_id == a_receive.context.span_id
    # The Forward's task.traceparent carried a's forward span: b's spans hang under it.
    assert b_receive.parent.span_id == a_forward.context.span_id
    for name in ("queue", "engine", "reply"):
        span = _by(spans, "b", name)
        assert span.parent.span_id == b_receive.context.span_id
        assert span.start_time <= span.end_time
    queue, engine = _by(spans, "b", "queue"), _by(spans, "b", "engine")
    assert queue.end_time == engine.start_time
    assert a_receive.attributes["gossipd.outcome"] == "forwarded"
    assert b_receive.attributes["gossipd.outcome"] == "ok"
    assert a_receive.resource.attributes["service.name"] == "gossipd"


def test_a_producers_traceparent_is_the_parent_of_the_entry_daemons_spans() -> None:
    traceparent = f"00-{PRODUCER_TRACE_ID}-{PRODUCER_SPAN_ID}-01"
    _, spans = asyncio.run(_two_daemons_one_forwarded_task(traceparent=traceparent))
    assert {f"{s.context.trace_id:032x}" for s in spans} == {PRODUCER_TRACE_ID}
    assert f"{_by(spans, 'a', 'receive').parent.span_id:016x}" == PRODUCER_SPAN_ID


def test_a_producers_unsampled_trace_is_recorded_nowhere() -> None:
    """Sampling is parent-based (the SDK's default): flags 00 from the producer means no span
    on the entry daemon, and the decision travels on in the Forward to the owner."""
    traceparent = f"00-{PRODUCER_TRACE_ID}-{PRODUCER_SPAN_ID}-00"
    result, spans = asyncio.run(_two_daemons_one_forwarded_task(traceparent, sampled=False))
    assert result.ok and spans == []


def test_tracing_off_imports_nothing_of_opentelemetry() -> None:
    code = (
        "import sys\n"
        "from gossipd.config import load_config\n"
        "from gossipd.daemon import Daemon\n"
        "d = Daemon(load_config(environ={}, overrides=['journal.path=\"\"']))\n"
        "assert d.tracer is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
