"""The producers, mixed into the world (simulations/fanout_world.py): tasks arrive at the
run's rate (a Poisson process), PUSH deals them round robin over the live daemons, and
producers resubmit as docs/PROTOCOL.md says (same id after a silence of ``resubmit_s``, after
``retry_after_ms`` for a busy refusal) and deduplicate final Results by id, counting what
they accept and drop."""

from __future__ import annotations

from dataclasses import dataclass

from gossipd.core.messages import Cancel, Chunk, ErrorCode, Result, Task, encode
from simulations.fanout_run import (
    ARRIVAL,
    CANCEL,
    INTRUDER_SRC,
    PEER_MSG,
    PRODUCER,
    PRODUCER_SRC,
    RESUBMIT,
    RETRYABLE,
)


@dataclass
class TaskState:
    task: Task
    first_sent: float
    entry: int = 0
    final: Result | None = None
    final_at: float = 0.0
    chunks_next: int = 0
    last_sent: float = 0.0
    cancelled_by_producer: bool = False
    refused_last: bool = False  # its latest answer was a refusal to retry (busy, unavailable)


class Producers:
    """The producers' side of the world: sends, resubmissions, what arrives back."""

    def arrival(self) -> None:
        run = self.run
        i = self.sent
        self.sent += 1
        key = f"k{self.rng.randrange(self.keys)}"
        task = Task(
            v=1,
            id=f"t{i:07d}",
            key=key,
            prompt="p",
            reply_to="tcp://producer:1",
            timeout_ms=run.timeout_ms,
            stream=run.stream_every > 0 and i % run.stream_every == 0,
        )
        self.tasks[task.id] = TaskState(task, self.now)
        self.send_task(task)
        if run.cancel_every:
            # Every n-th task: its producer and the intruder cancel it; as many others: the
            # intruder alone (any of these that ends cancelled obeyed another key).
            senders = {run.cancel_every // 2: (INTRUDER_SRC, PRODUCER_SRC), 0: (INTRUDER_SRC,)}
            for src in senders.get(i % run.cancel_every, ()):
                at = self.now + self.rng.uniform(0.0, 3 * run.service_s)
                self.push(at, CANCEL, -1, (task.id, src))
        if self.sent < run.tasks:
            self.push(self.now + self.rng.expovariate(self.rate), ARRIVAL, -1)

    def send_task(self, task: Task) -> None:
        """PUSH deals round robin over the daemons it is connected to (not the dead ones)."""
        n = self.run.nodes
        for _ in range(n):
            entry = self.next_entry
            self.next_entry = (entry + 1) % n
            if self.up[entry]:
                break
        self.tasks[task.id].entry = entry
        self.tasks[task.id].last_sent = self.now
        self.trace(task.id, PRODUCER, f"sends attempt {task.attempt} to d{entry:04d}")
        self.to_entry(PRODUCER_SRC, entry, encode(task))
        self.push(self.now + self.run.resubmit_s, RESUBMIT, -1, (task.id, task.attempt))

    def to_entry(self, src: int, entry: int, frame: bytes) -> None:
        """A frame from a producer's connection (``src``) to daemon ``entry``: one ZeroMQ
        connection keeps its order (a Cancel never overtakes its Task)."""
        link = (src, entry)
        at = max(self.now + self.latency(), self.link_last.get(link, 0.0) + 1e-7)
        self.link_last[link] = at
        self.push(at, PEER_MSG, entry, (src, 0, self.now, frame))

    def send_cancel(self, payload: tuple[str, int]) -> None:
        """A Cancel for a task not answered yet, to the daemon its latest attempt went to,
        from ``src`` (the producer, or the intruder: another key)."""
        task_id, src = payload
        state = self.tasks[task_id]
        if state.final is not None:
            return
        if src == PRODUCER_SRC:
            state.cancelled_by_producer = True
        self.cancels_sent += 1
        self.trace(
            task_id,
            PRODUCER,
            f"cancel from {'the producer' if src == PRODUCER_SRC else 'an intruder'} to d{state.entry:04d}",
        )
        self.to_entry(src, state.entry, encode(Cancel(v=1, id=task_id)))

    def resubmit_if_silent(self, payload: tuple[str, int | None]) -> None:
        """Resend a task still without a final Result: after a silence of resubmit_s since
        attempt ``attempt`` (None: now, after a busy refusal's retry_after_ms)."""
        task_id, attempt = payload
        state = self.tasks[task_id]
        if state.final is None and attempt in (None, state.task.attempt):
            self.resend(state)

    def resend(self, state: TaskState) -> None:
        if (self.now - state.first_sent) * 1000 >= self.run.timeout_ms:
            return  # the producer gives up: counted as lost at the end
        state.task = _with_attempt(state.task, state.task.attempt + 1)
        state.refused_last = False
        self.send_task(state.task)

    def producer_receives(self, msg: Chunk | Result) -> None:
        state = self.tasks.get(msg.id)
        if state is None:
            return
        if isinstance(msg, Chunk):
            if msg.seq == state.chunks_next and state.final is None:
                state.chunks_next += 1
            return
        self.trace(msg.id, PRODUCER, f"gets {'ok' if msg.ok else msg.error.code} from {msg.node}")  # type: ignore[union-attr]
        if state.final is not None:
            if self.now - state.final_at > self.run.producer_memory_s:
                self.duplicates_accepted += 1
            else:
                self.duplicates_dropped += 1
            if len(self.duplicate_ids) < 10:
                self.duplicate_ids.append(msg.id)
            for kind in self.faults_during(state.first_sent, self.now):
                self.duplicates_by_fault[kind] = self.duplicates_by_fault.get(kind, 0) + 1
            return
        if not msg.ok and msg.error is not None and msg.error.code in RETRYABLE:
            self.errors[msg.error.code] = self.errors.get(msg.error.code, 0) + 1
            state.refused_last = True
            delay = max(0.05, msg.error.retry_after_ms / 1000.0)
            self.push(self.now + delay, RESUBMIT, -1, (msg.id, None))
            return
        if msg.ok and msg.chunks and state.chunks_next < msg.chunks:
            self.violation("chunk_gap", msg.id, msg.node)
        cancelled = msg.error is not None and msg.error.code == ErrorCode.CANCELLED
        if cancelled and not state.cancelled_by_producer:
            self.violation("cancelled_by_another_key", msg.id, msg.node)
        state.final = msg
        state.final_at = self.now
        if msg.ok:
            self.served_at.append(self.now)
            self.latencies.append(self.now - state.first_sent)
            self.attempt_latencies.append(self.now - state.last_sent)
        else:
            code = msg.error.code if msg.error is not None else "?"
            self.errors[code] = self.errors.get(code, 0) + 1


def _with_attempt(task: Task, attempt: int) -> Task:
    import msgspec

    return msgspec.structs.replace(task, attempt=attempt)
