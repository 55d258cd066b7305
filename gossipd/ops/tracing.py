"""Tracing: OpenTelemetry spans for each task on each daemon it crosses, joined by trace id.

Off by default (``[tracing] enabled = false``): ``build_tracer`` returns None, the shells hold
None and test for it, and nothing of OpenTelemetry is imported (tests/test_tracing.py checks
that), so tracing costs nothing when it is off.  On, it needs the ``otel`` extra
(``pip install 'gossipd[otel]'``: opentelemetry-sdk, and the OTLP exporter).

Spans of one task on one daemon (all children of ``receive``):
- ``receive``: from the task's arrival (a producer's PUSH, or a peer's Forward) until this
  daemon is done with it: its Result sent, its forward reported done (TaskDone) or refused,
  or it was withdrawn or handed off.  Its parent is the task's ``traceparent`` when that is a
  valid W3C trace context, else it starts a new trace;
- ``forward``: from the first Forward to another member until that member's TaskDone (or
  the refusal to the producer when no member took it).  The Forward's ``task.traceparent``
  is this span's context, so the owner's spans join the trace under it;
- ``queue``: admitted until a worker started it; ``engine``: the engine's work (Result
  timings); ``reply``: from the engine's end until the Result is handed to the reply sender.
``queue``, ``engine`` and ``reply`` are made when the task ends, with the times it recorded.

Exporters: ``[tracing] exporter = "env"`` follows OTEL_TRACES_EXPORTER (``otlp``, the
default, configured by the OTEL_EXPORTER_OTLP_* variables; ``console``; ``none``); sampling
follows OTEL_TRACES_SAMPLER (parent-based by default: a producer's unsampled traceparent is
not recorded).  ``exporter = "memory"`` keeps spans in this process (``memory_exporter()``,
for tests).  Open records are bounded (``open_tasks_max``): beyond it the oldest are ended
with ``gossipd.evicted`` set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.errors import StartupError

if TYPE_CHECKING:
    from gossipd.config import TracingConfig
    from gossipd.core.lifecycle import Owned
    from gossipd.core.messages import Result, Task
    from gossipd.core.peer_messages import Forward

_MEMORY_EXPORTER: Any = None


def memory_exporter() -> Any:
    """The process's InMemorySpanExporter (``exporter = "memory"``: every daemon in this
    process exports to it; tests read ``get_finished_spans()``)."""
    global _MEMORY_EXPORTER
    if _MEMORY_EXPORTER is None:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        _MEMORY_EXPORTER = InMemorySpanExporter()
    return _MEMORY_EXPORTER


def build_tracer(
    config: TracingConfig, node: str, *, clock: Clock = SYSTEM_CLOCK
) -> TaskTracer | None:
    """The daemon's tracer, or None when tracing is off."""
    if not config.enabled:
        return None
    try:
        return TaskTracer(config, node, clock=clock)
    except ImportError as exc:
        raise StartupError(
            f"tracing.enabled = true needs the OpenTelemetry SDK ({exc.name} is missing): "
            "pip install 'gossipd[otel]', or set tracing.enabled = false"
        ) from None


def _span_exporter(kind: str) -> Any:
    if kind == "env":
        kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip() or "otlp"
    if kind == "memory":
        return memory_exporter()
    if kind == "none":
        return None
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind == "otlp":
        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        )
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        return OTLPSpanExporter()
    raise StartupError(
        f"OTEL_TRACES_EXPORTER = {kind!r}: gossipd knows otlp, console and none "
        "(or set tracing.exporter)"
    )


class _Open:
    """One task's spans on this daemon while it is here."""

    __slots__ = ("context", "forward", "receive", "received_s", "recording")

    def __init__(self, receive: Any, context: Any, received_s: float) -> None:
        self.receive = receive
        # False: not sampled (OTEL_TRACES_SAMPLER); no child spans, the context still travels.
        self.recording = bool(receive.is_recording())
        self.context = context  # receive's context: the parent of the other spans
        self.forward: Any = None
        self.received_s = received_s  # the clock's monotonic() at arrival


class TaskTracer:
    """What the shells call (each call is made only when tracing is on).  Inputs are
    the clock's ``monotonic()`` readings (gossipd/clock.py), as everywhere in the daemon; spans get wall-clock
    nanoseconds from one offset taken at start."""

    def __init__(self, config: TracingConfig, node: str, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self._kind = trace.SpanKind
        self._status = trace.Status
        self._error = trace.StatusCode.ERROR
        self._propagator = TraceContextTextMapPropagator()
        attributes = {"service.instance.id": node, "gossipd.node": node}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = config.service_name
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._memory = False
        exporter = _span_exporter(config.exporter)
        if exporter is not None:
            # Spans leave in a background thread, in batches; the in-memory exporter takes
            # each span as it ends (tests read them at once).
            self._memory = exporter is _MEMORY_EXPORTER
            processor = SimpleSpanProcessor if self._memory else BatchSpanProcessor
            self._provider.add_span_processor(processor(exporter))
        self._tracer = self._provider.get_tracer("gossipd")
        self._node = node
        self._open: dict[str, _Open] = {}  # by task id, oldest first
        self._open_max = config.open_tasks_max
        self._epoch_offset_ns = round((clock.wall() - clock.monotonic()) * 1e9)
        self.evicted = 0

    # -- wiring ----------------------------------------------------------------------------

    def attach(self, ingress: Any) -> None:
        """Listen to the ingress (admitted, finished, released, refused) and, with fan-out,
        see each producer's task before the router places it: the router link is wrapped
        (the dispatcher, given this tracer when built, calls ``forwarding``, ``forward_done``
        and ``refused`` itself)."""
        ingress.intake.on_admitted.append(self.admitted)
        ingress.runner.on_finished.append(self.finished)
        ingress.runner.on_released.append(self.released)
        ingress.intake.on_refused.append(self.refused_here)
        route = ingress.intake.links.router
        if route is not None:
            ingress.intake.links.router = self._traced_router(route)

    def _traced_router(self, route: Callable[[Task, float], bool]) -> Callable[[Task, float], bool]:
        def traced(task: Task, now: float) -> bool:
            self.received(task, now)
            return bool(route(task, now))

        return traced

    def close(self) -> None:
        """End what is still open, flush the exporter, stop its thread."""
        for task_id in list(self._open):
            self._end(task_id, self._clock.monotonic(), outcome="daemon_stopped")
        if self._memory:  # shared by the process's daemons: shutting it down would stop it
            self._provider.force_flush()
        else:
            self._provider.shutdown()

    # -- inputs ----------------------------------------------------------------------------

    def received(self, task: Task, now: float) -> None:
        """A task arrived (from a producer, or admitted from a peer's Forward)."""
        if task.id in self._open:
            return
        parent = None
        if task.traceparent:
            parent = self._propagator.extract({"traceparent": task.traceparent})
        span = self._tracer.start_span(
            "receive",
            context=parent,
            kind=self._kind.SERVER,
            start_time=self._ns(now),
            attributes={
                "gossipd.node": self._node,
                "gossipd.task.id": task.id,
                "gossipd.task.key": task.key,
                "gossipd.task.attempt": task.attempt,
            },
        )
        if len(self._open) >= self._open_max:
            oldest = next(iter(self._open))
            self.evicted += 1
            self._end(oldest, now, outcome="evicted", evicted=True)
        self._open[task.id] = _Open(span, self._trace.set_span_in_context(span), now)

    def admitted(self, task: Task) -> None:
        """Ingress on_admitted: a task that did not pass the router (a peer's, or no
        fan-out) starts its spans here."""
        if task.id not in self._open:
            self.received(task, self._clock.monotonic())

    def forwarding(self, msg: Forward, addr: str) -> Forward:
        """A Forward is about to leave: open ``forward`` (at the first attempt) and carry its
        context in the task's traceparent."""
        now = self._clock.monotonic()
        task = msg.task
        record = self._open.get(task.id)
        if record is None:
            self.received(task, now)
            record = self._open[task.id]
        if record.recording:
            if record.forward is None:
                record.forward = self._tracer.start_span(
                    "forward",
                    context=record.context,
                    kind=self._kind.CLIENT,
                    start_time=self._ns(now),
                    attributes={"gossipd.node": self._node, "gossipd.task.id": task.id},
                )
            record.forward.add_event(
                "attempt",
                {"gossipd.peer": addr, "gossipd.attempt": msg.attempt},
                timestamp=self._ns(now),
            )
            carrier = record.forward
        else:  # not sampled: no span, but the decision travels on (flags 00)
            carrier = record.receive
        ctx = carrier.get_span_context()
        traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        if task.traceparent == traceparent:
            return msg
        return msgspec.structs.replace(
            msg, task=msgspec.structs.replace(task, traceparent=traceparent)
        )

    def forward_done(self, task_id: str) -> None:
        """The owner's TaskDone: its Result went to the producer."""
        if task_id in self._open:
            self._end(task_id, self._clock.monotonic(), outcome="forwarded")

    def refused(self, task_id: str, code: str) -> None:
        """No member took the task: the producer is answered ``code`` from here."""
        if task_id in self._open:
            self._end(task_id, self._clock.monotonic(), outcome=str(code), error=str(code))

    def refused_here(self, task: Task) -> None:
        """Ingress on_refused: routed here, refused by admission (or a cached Result)."""
        if task.id in self._open:
            self._end(task.id, self._clock.monotonic(), outcome="refused_or_cached")

    def released(self, task: Task) -> None:
        """Ingress on_released: withdrawn by its forwarder, or handed off (then its
        ``forward`` stays open until that member's TaskDone)."""
        record = self._open.get(task.id)
        if record is not None and record.forward is None:
            self._end(task.id, self._clock.monotonic(), outcome="withdrawn")

    def finished(self, owned: Owned, result: Result) -> None:
        """Ingress on_finished: the Result was handed to the reply sender just now."""
        now = self._clock.monotonic()
        record = self._open.get(owned.task.id)
        if record is None:
            self.received(owned.task, owned.received_at)
            record = self._open[owned.task.id]
        if not record.recording:
            del self._open[owned.task.id]
            return
        ctx, ns = record.context, self._ns
        attrs = {"gossipd.node": self._node, "gossipd.task.id": owned.task.id}
        t = result.timings
        engine_end = now
        if result.ok:
            # Timings count from received_at (for a forwarded task: the entry daemon's receipt,
            # so that the deadline holds across hops); the queue starts with our receipt.
            started = owned.received_at + t.queued_ms / 1e3
            engine_end = owned.received_at + t.total_ms / 1e3
            queue_from = min(max(owned.received_at, record.received_s), started)
            self._tracer.start_span(
                "queue", context=ctx, start_time=ns(queue_from), attributes=attrs
            ).end(end_time=ns(started))
            engine = self._tracer.start_span(
                "engine",
                context=ctx,
                start_time=ns(started),
                attributes={
                    **attrs,
                    "gossipd.chunks": result.chunks,
                    "gossipd.first_token_ms": round(t.first_token_ms, 3),
                },
            )
            engine.end(end_time=ns(engine_end))
        reply = self._tracer.start_span(
            "reply", context=ctx, start_time=ns(min(engine_end, now)), attributes=attrs
        )
        reply.end(end_time=ns(now))
        code = "" if result.error is None else result.error.code
        self._end(owned.task.id, now, outcome="ok" if result.ok else code, error=code)

    # -- helpers ---------------------------------------------------------------------------

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    def _end(
        self, task_id: str, now: float, *, outcome: str, error: str = "", evicted: bool = False
    ) -> None:
        record = self._open.pop(task_id)
        end_ns = self._ns(now)
        for span in (record.forward, record.receive):
            if span is None:
                continue
            span.set_attribute("gossipd.outcome", outcome)
            if evicted:
                span.set_attribute("gossipd.evicted", True)
            if error:
                span.set_status(self._status(self._error, error))
            span.end(end_time=end_ns)
