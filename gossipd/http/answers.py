"""The HTTP door's waiting requests and the answers that come back to them.

Every request the door turned into a task waits here by task id until its Result: Chunks
become server-sent events (in ``seq`` order: one that comes early is held until the gap
fills, a copy is dropped), the Result becomes the one JSON answer or the stream's last
events.  Answers arrive two ways: as frames (``deliver``) from an owner on another member, at
this door's own ZeroMQ PULL socket (the task's ``reply_to``, bound here) or relayed on the
fan-out connection, or in-process from this daemon's runner as the messages themselves,
never encoded (``deliver_message``; ReplySender.deliver_locally, send_message).  A failure
to answer one request never reaches the runner or the socket reader (logged, counted).

Cancels: a client gone, a stream past its byte bound, a request past its deadline are
cancelled through the intake, wherever the task runs.

A request of several choices (prompts x n) is one task a choice, each waiting here with its
index and the ``Choices`` they share: a stream writes each choice's deltas with its index
as they come, the answer (or ``[DONE]``) goes once every choice has its Result, and the
first error answers the request and cancels the choices still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import msgspec
import zmq

from gossipd.clock import Clock
from gossipd.core.codec import REPLY_FRAME_BYTES_MAX, decode_replies
from gossipd.core.messages import (
    Chunk,
    ErrorCode,
    ErrorInfo,
    Result,
    TokenUsage,
    logprobs_of,
    prompt_logprobs_of,
)
from gossipd.core.sampling import TokenLogprob
from gossipd.errors import RemoteProtocolError
from gossipd.http.exchange import Exchange
from gossipd.http.openai_answers import (
    StreamWriter,
    choices_answer,
    error_body,
    error_of,
    total_usage,
    usage_of,
    whole_answer,
)
from gossipd.http.openai_api import Call
from gossipd.http.tools import content_part
from gossipd.looppull import LoopPullServer
from gossipd.zmqloop import SocketReader

log = logging.getLogger("gossipd.http.answers")

MEMBER_HEADER = "x-gossipd-member"  # the member that ran the task
SWEEP_INTERVAL_S = 0.5
HELD_CHUNKS_MAX = 256  # chunks held for a gap in seq; past it the gap is skipped


@dataclass(slots=True, eq=False)
class Choices:
    """The tasks of a request of several choices: choice i is ``task_ids[i]``."""

    task_ids: list[str]
    taken: int = 0  # tasks handed to the intake so far (in order): those to cancel
    writer: StreamWriter | None = None  # the stream's, once it began
    ended: bool = False  # answered (or abandoned): the others are cancelled
    # Sized to the choices (__post_init__):
    texts: list[str] = field(init=False)  # by choice, as Results come
    usages: list[TokenUsage | None] = field(init=False)
    logprobs: list[list[TokenLogprob] | None] = field(init=False)  # (when asked)
    scored: list[bool] = field(init=False)  # an echo's: the first entry is its prompt's first
    nodes: list[str] = field(init=False)  # the member that ran each ("": none yet)
    left: int = field(init=False)  # choices without their Result

    def __post_init__(self) -> None:
        count = len(self.task_ids)
        self.texts = [""] * count
        self.usages = [None] * count
        self.logprobs = [None] * count
        self.scored = [False] * count
        self.nodes = [""] * count
        self.left = count


class Waiting(msgspec.Struct):
    """A request whose task is out: where and how its answer goes.  (A Struct: one is
    made per request, and msgspec builds it in C; its empty defaults are copied per
    instance.)"""

    exchange: Exchange
    call: Call
    response_id: str
    created: int
    deadline: float
    request_id: str
    writer: StreamWriter | None = None
    next_seq: int = 0
    held: dict[int, Chunk] = {}  # early chunks by seq
    streamed_chars: int = 0  # of the answer's text written as deltas so far, in order
    streamed_logprobs: int = 0  # of its tokens' log probabilities (when asked), in order
    # An answer read for tool calls ("auto"): text held back (it may begin a call), and
    # whether a call began (nothing more streams until the Result).
    held_text: str = ""
    calling: bool = False
    gap: bool = False  # a chunk was skipped (never came): the deltas are not a prefix
    choices: Choices | None = None  # a request of several choices: this is choice ``index``
    index: int = 0
    echo_due: bool = False  # completions' echo: the prompt is still to be written first


def _echoed(
    waiting: Waiting,
    text: str,
    logprobs: list[TokenLogprob] | None,
    prompt_entries: list[TokenLogprob] | None,
) -> tuple[str, list[TokenLogprob] | None, bool]:
    """Completions' echo, once a choice: its prompt before ``text`` (with max_tokens 0,
    instead of it: the token generated is not shown), and with log probabilities the
    prompt's tokens before ``logprobs``; and whether the first entry is the prompt's first
    token, which has no log probability (written null)."""
    waiting.echo_due = False
    call = waiting.call
    if call.token_prompts:  # (its text is its tokens': echo asks logprobs with token ids)
        prompt = "".join(entry.token for entry in prompt_entries or ())
    else:
        prompt = call.prompts[waiting.index // call.n] if call.prompts else call.prompt
    if call.echo_only:
        text, logprobs = "", None if logprobs is None else []
    if logprobs is None or not prompt_entries:
        return prompt + text, logprobs, False
    return prompt + text, [*prompt_entries, *logprobs], True


@dataclass(slots=True)
class AnswerCounters:
    responses: dict[int, int] = field(default_factory=dict)  # by status
    disconnect_cancels: int = 0  # clients gone before their answer: task cancelled
    slow_client_cancels: int = 0  # streams past stream_buffer_bytes_max: cancelled
    deadline_answers: int = 0  # answered 504 by the door's own sweep
    replies_unknown: int = 0  # answers for no waiting request (its client had gone)
    replies_invalid: int = 0  # undecodable frames on the reply socket
    answer_failures: int = 0  # answers that raised while written (a bug: logged)

    def count(self, status: int) -> None:
        self.responses[status] = self.responses.get(status, 0) + 1


class Answers:
    def __init__(
        self,
        *,
        node: str,
        cancel: Callable[[str], None],
        stream_buffer_bytes_max: int,
        request_timeout_s: float,
        clock: Clock,
        streams_unsent_bytes_max: int = 1 << 62,
        streams_open: Callable[[], int] = lambda: 1,
    ) -> None:
        self._node = node
        self._cancel = cancel  # a task id: cancel the task wherever it runs
        self._stream_bytes_max = stream_buffer_bytes_max
        # Every stream's unsent bytes together: each open stream gets its share of it.
        self._streams_bytes_max = streams_unsent_bytes_max
        self._streams_open = streams_open
        self._timeout_s = request_timeout_s
        self._clock = clock
        self._waiting: dict[str, Waiting] = {}
        self.counters = AnswerCounters()
        self.reply_to = ""
        self._sock: zmq.Socket | None = None
        self._sender_allowed: Callable[[str], bool] | None = None
        self._reader: SocketReader | None = None
        self._receiver: LoopPullServer | None = None

    def __len__(self) -> int:
        """Tasks waiting for their answer (a request of several choices: one a choice)."""
        return len(self._waiting)

    def requests(self) -> int:
        """Requests waiting (a request of several choices once).  A walk: for metrics."""
        waiting = self._waiting.values()
        groups = {id(w.choices) for w in waiting if w.choices is not None}
        return sum(1 for w in waiting if w.choices is None) + len(groups)

    # -- the reply address ---------------------------------------------------------------

    def bind(
        self,
        ctx: zmq.Context,
        endpoint: str,
        serve_curve: Callable[[zmq.Socket], None] | None,
        sender_allowed: Callable[[str], bool] | None = None,
        receiver: LoopPullServer | None = None,
    ) -> str:
        """Bind the reply PULL socket at ``endpoint``; owners' answers arrive there.  With
        CURVE, ``sender_allowed`` says whether a frame's User-Id (the member that sent it) is
        still authorised: a key removed or replaced since its connection opened is not.
        ``receiver``: the loop's PULL (http.reply_receiver "loop": what it holds bounded in
        bytes; it brings its own CURVE), else libzmq's."""
        self._sender_allowed = sender_allowed
        if receiver is not None:
            self._receiver = receiver
            self.reply_to = receiver.bind(endpoint)
            return self.reply_to
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # A reply larger than any a daemon sends closes its sender's connection, unread
        # (without it one message could take any amount of memory).
        sock.setsockopt(zmq.MAXMSGSIZE, REPLY_FRAME_BYTES_MAX)
        if serve_curve is not None:
            serve_curve(sock)
        sock.bind(endpoint)
        self._sock = sock
        self.reply_to = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.reply_to

    def start_receiving(self) -> None:
        if self._receiver is not None:
            self._receiver.receive(self._on_loop_frames, self._on_loop_malformed)
            return
        assert self._sock is not None, "bind() first"
        if self._sender_allowed is None:
            self._reader = SocketReader(self._sock, self._sock.recv, 256, self._on_frames)
        else:  # (read as zmq.Frame, for its User-Id)
            recv = partial(self._sock.recv, copy=False)
            self._reader = SocketReader(self._sock, recv, 256, self._on_checked_frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.deliver(frame)

    def _on_loop_frames(self, frames: list[bytes], sender: str) -> None:
        """The loop's PULL: the frames of one read of one owner's connection."""
        allowed = self._sender_allowed
        if allowed is not None and not allowed(sender):  # (counted by security: revoked)
            return
        self._on_frames(frames)

    def _on_loop_malformed(self) -> None:
        self.counters.replies_invalid += 1  # a message of several frames: no reply is

    @property
    def connections_closed(self) -> dict[str, int]:
        """Owners' connections the loop's PULL closed, by reason; empty under libzmq's."""
        return {} if self._receiver is None else dict(self._receiver.refused)

    def _on_checked_frames(self, frames: list[zmq.Frame]) -> None:
        allowed = self._sender_allowed
        assert allowed is not None
        for frame in frames:
            if allowed(frame.get(b"User-Id")):  # (refusals counted by security: revoked)
                self.deliver(frame.bytes)

    def deliver(self, frame: bytes) -> None:
        """One reply frame for one of our tasks: a Chunk, a Result or a Replies pack."""
        try:
            messages = decode_replies(frame)
        except RemoteProtocolError as exc:
            self.counters.replies_invalid += 1
            log.warning("undecodable answer on the HTTP reply socket", extra={"error": str(exc)})
            return
        for message in messages:
            self.deliver_message(message)

    def deliver_message(self, message: Chunk | Result) -> None:
        """One reply, decoded (or, of a task run in this daemon, never encoded)."""
        waiting = self._waiting.get(message.id)  # (a Result's leaves the table at once)
        try:
            self._on_reply(message, waiting)
        except Exception:  # one request's answer must not stop the others (or the runner)
            self.counters.answer_failures += 1
            log.exception("answering an HTTP request failed", extra={"task_id": message.id})
            self._waiting.pop(message.id, None)
            if waiting is None:
                return
            if waiting.choices is not None:
                self._end_choices(waiting.choices)
            exchange = waiting.exchange
            try:
                if not exchange.done and not exchange.streaming:  # nothing of it went out
                    exchange.respond(
                        500,
                        error_body("internal error", "server_error"),
                        headers=self.headers(waiting, message.node),
                    )
                    self.counters.count(500)
                elif not exchange.done:  # a stream cut short: the client sees it end
                    exchange.abort()
            except Exception:  # the connection itself is broken
                exchange.abort()
            if type(message) is Chunk:  # the task still runs, for nobody now
                self._cancel(message.id)

    # -- waiting requests ----------------------------------------------------------------

    def wait(self, task_id: str, waiting: Waiting) -> None:
        """``task_id``'s answer goes to ``waiting`` (before the task is taken: a refusal or
        a task run here at once answers within that call)."""
        self._waiting[task_id] = waiting
        waiting.echo_due = waiting.call.echo
        waiting.exchange.on_close = lambda: self._client_gone(task_id)

    def forget(self, task_id: str) -> None:
        """``task_id`` was never taken (the intake raised: a bug): nothing to answer later,
        nor to cancel."""
        waiting = self._waiting.pop(task_id, None)
        if waiting is not None:
            waiting.exchange.on_close = None

    def wait_choices(self, task_ids: list[str], first: Waiting) -> Choices:
        """A request of several choices: choice i's answer comes as ``task_ids[i]``'s.  The
        door hands the tasks to the intake in order, counting ``taken``, and stops once the
        request is ``ended`` (a refusal answers it within the take)."""
        choices = Choices(task_ids)
        for index, task_id in enumerate(task_ids):
            self._waiting[task_id] = (
                first
                if index == 0
                else Waiting(
                    exchange=first.exchange,
                    call=first.call,
                    response_id=first.response_id,
                    created=first.created,
                    deadline=first.deadline,
                    request_id=first.request_id,
                )
            )
            self._waiting[task_id].choices = choices
            self._waiting[task_id].index = index
            self._waiting[task_id].echo_due = first.call.echo
        first.exchange.on_close = lambda: self._choices_gone(choices)
        return choices

    def forget_choices(self, choices: Choices) -> None:
        """The intake raised (a bug) on a take: the tasks taken are cancelled, the others
        were never out."""
        choices.taken -= 1  # (the one that raised: not taken)
        first = self._waiting.get(choices.task_ids[0])
        if first is not None:
            first.exchange.on_close = None
        self._end_choices(choices)

    def _client_gone(self, task_id: str) -> None:
        if self._waiting.pop(task_id, None) is None:
            return
        self.counters.disconnect_cancels += 1
        self._cancel(task_id)

    def _choices_gone(self, choices: Choices) -> None:
        if choices.ended:
            return
        self.counters.disconnect_cancels += 1
        self._end_choices(choices)

    def _end_choices(self, choices: Choices) -> None:
        """The request is answered or abandoned: every choice leaves the table, and those
        taken and still running are cancelled."""
        choices.ended = True
        for index, task_id in enumerate(choices.task_ids):
            if self._waiting.pop(task_id, None) is not None and index < choices.taken:
                self._cancel(task_id)

    def _on_reply(self, message: Chunk | Result, waiting: Waiting | None) -> None:
        """``waiting``: the request waiting for ``message`` (the table's entry for its id)."""
        if waiting is None:
            self.counters.replies_unknown += 1
            return
        if waiting.choices is not None:
            self._on_choice_reply(waiting, waiting.choices, message)
            return
        if type(message) is Chunk:
            if waiting.call.stream:
                self._on_chunk(message.id, waiting, message)
            return  # (a Chunk for a whole answer: the Result has all of its text)
        assert isinstance(message, Result)
        del self._waiting[message.id]
        exchange = waiting.exchange
        if waiting.writer is not None or (waiting.call.stream and message.ok):
            writer = self._stream(waiting, message.node)
            if message.ok:
                self._end_choice(writer, waiting, message, writer.end(usage_of(message.usage)))
            else:
                # The chunks still held wait behind a gap that is open (in-order ones were
                # written as they came, also after a gap given up): not written, the text
                # would have a hole.
                assert message.error is not None
                exchange.write(writer.error(message.error))
            exchange.end_stream()
            self.counters.count(200)
            return
        if message.ok:
            text, logprobs, scored = message.text, logprobs_of(message), False
            if waiting.echo_due:
                text, logprobs, scored = _echoed(
                    waiting, text, logprobs, prompt_logprobs_of(message)
                )
            body = whole_answer(
                waiting.call, waiting.response_id, waiting.created, text, message.usage, logprobs,
                scored,
            )  # fmt: skip
            exchange.respond(200, body, headers=self.headers(waiting, message.node))
            self.counters.count(200)
            return
        assert message.error is not None
        status, body, headers = error_of(message.error, chat=waiting.call.chat)
        exchange.respond(status, body, headers=headers + self.headers(waiting, message.node))
        self.counters.count(status)

    def _on_choice_reply(self, waiting: Waiting, choices: Choices, message: Chunk | Result) -> None:
        """One reply of a request of several choices (see the module's docstring)."""
        if type(message) is Chunk:
            if waiting.call.stream:
                self._on_chunk(message.id, waiting, message)
            return
        assert isinstance(message, Result)
        del self._waiting[message.id]
        exchange = waiting.exchange
        index = waiting.index
        if not message.ok:
            assert message.error is not None
            self._end_choices(choices)
            if choices.writer is not None:  # the stream began: its last event says it
                exchange.write(choices.writer.error(message.error))
                exchange.end_stream()
                self.counters.count(200)
            else:
                status, body, headers = error_of(message.error, chat=waiting.call.chat)
                headers += self.headers(waiting, message.node)
                exchange.respond(status, body, headers=headers)
                self.counters.count(status)
            return
        choices.usages[index] = message.usage
        if not waiting.call.stream:  # (a stream sent them with its deltas)
            text, logprobs, scored = message.text, logprobs_of(message), False
            if waiting.echo_due:
                text, logprobs, scored = _echoed(
                    waiting, text, logprobs, prompt_logprobs_of(message)
                )
            choices.texts[index], choices.logprobs[index] = text, logprobs
            choices.scored[index] = scored
        choices.nodes[index] = message.node or self._node
        choices.left -= 1
        if waiting.call.stream:
            writer = self._stream(waiting, message.node)
            self._end_choice(writer, waiting, message)
            if choices.left == 0:
                choices.ended = True
                exchange.write(writer.end(total_usage(choices.usages, waiting.call.n)))
                exchange.end_stream()
                self.counters.count(200)
            return
        if choices.left == 0:
            choices.ended = True
            call = waiting.call
            body = choices_answer(
                call, waiting.response_id, waiting.created, choices.texts, choices.usages,
                choices.logprobs, choices.scored,
            )  # fmt: skip
            # Every member that ran a choice, in choice order, once each.
            headers = self.headers(waiting, ",".join(dict.fromkeys(choices.nodes)))
            exchange.respond(200, body, headers=headers)
            self.counters.count(200)

    def _on_chunk(self, task_id: str, waiting: Waiting, chunk: Chunk) -> None:
        """In seq order: a copy dropped, an early one held until the gap fills (bounded)."""
        if chunk.seq < waiting.next_seq:
            return
        if chunk.seq > waiting.next_seq:
            waiting.held[chunk.seq] = chunk
            if len(waiting.held) < HELD_CHUNKS_MAX:
                return
            waiting.next_seq = min(waiting.held)  # the gap will not fill: go on after it
            waiting.gap = True
            chunk = waiting.held.pop(waiting.next_seq)
        writer = self._stream(waiting, chunk.node)
        waiting_bytes = 0
        while True:
            if chunk.seq == waiting.next_seq:
                delta = chunk.delta
                if writer.reads_calls:  # only what cannot begin a tool call
                    delta = self._content_part(waiting, delta)
                if delta and waiting.echo_due and chunk.seq:
                    # An echo's first chunk (the prompt's scores come on it) was skipped
                    # (a gap): nothing streams until the Result, which has it all.
                    delta = ""
                if delta:
                    logprobs = chunk.logprobs
                    if waiting.echo_due:  # (the first delta: the prompt before it)
                        waiting_bytes = self._echo_first(writer, waiting, chunk, delta)
                    elif logprobs:  # (UNSET, None: none asked)
                        waiting.streamed_logprobs += len(logprobs)
                        out = writer.delta(delta, waiting.index, logprobs)
                        waiting_bytes = waiting.exchange.write(out)
                    else:
                        waiting_bytes = waiting.exchange.write(writer.delta(delta, waiting.index))
                    waiting.streamed_chars += len(delta)
                waiting.next_seq += 1
            nxt = waiting.held.pop(waiting.next_seq, None)
            if nxt is None:
                break
            chunk = nxt
        if waiting_bytes > self._stream_bytes_max or (
            waiting_bytes > self._streams_bytes_max // max(1, self._streams_open())
        ):
            # The client reads slower than the task writes: give up on it (past its own
            # bound, or past its share of what all streams may hold together).
            self.counters.slow_client_cancels += 1
            waiting.exchange.abort()
            if waiting.choices is not None:
                self._end_choices(waiting.choices)
                return
            self._waiting.pop(task_id, None)
            self._cancel(task_id)

    def _end_choice(
        self, writer: StreamWriter, waiting: Waiting, result: Result, tail: bytes = b""
    ) -> None:
        """A streamed choice's end, its Result ok: the text (and log probabilities) no chunk
        brought in order, or after a gap that never filled the chunks still held; then its
        finish reason, in one write with ``tail`` (the stream's end, when this choice ends
        it).  A choice read for tool calls: its content's rest and its calls (after a gap
        none of its content: what streamed is no prefix of it)."""
        if writer.reads_calls:
            streamed = None if waiting.gap else waiting.streamed_chars
            read = writer.read_choice(result.text, result.usage, waiting.index, streamed)
            waiting.exchange.write(read + tail)
            return
        if waiting.gap and not waiting.echo_due:
            self._write_held(writer, waiting)
        else:  # (an echo not written yet: nothing was, the Result has it all)
            self._rest(writer, waiting, result)
        waiting.exchange.write(writer.finish_choice(result.usage, waiting.index) + tail)

    @staticmethod
    def _write_held(writer: StreamWriter, waiting: Waiting) -> None:
        """The chunks still held behind a gap that never filled, in seq order."""
        for seq in sorted(waiting.held):
            held = waiting.held[seq]
            waiting.exchange.write(writer.delta(held.delta, waiting.index, logprobs_of(held)))

    @staticmethod
    def _rest(writer: StreamWriter, waiting: Waiting, result: Result) -> None:
        """A stream's last delta: the Result's text (and log probabilities) no chunk
        brought in order."""
        rest = result.text[waiting.streamed_chars :]
        logprobs = logprobs_of(result)
        if logprobs is not None:
            logprobs = logprobs[waiting.streamed_logprobs :]
        first_none = False
        if waiting.echo_due:  # (no chunk came in order: the prompt goes first, here)
            rest, logprobs, first_none = _echoed(
                waiting, rest, logprobs, prompt_logprobs_of(result)
            )
        if rest or logprobs:
            waiting.exchange.write(writer.delta(rest, waiting.index, logprobs, first_none))

    @staticmethod
    def _echo_first(writer: StreamWriter, waiting: Waiting, chunk: Chunk, delta: str) -> int:
        """A stream's first delta with an echo: the prompt (and its tokens' log
        probabilities, on this first Chunk) before it, in one event, as vLLM writes it."""
        logprobs = logprobs_of(chunk)
        if logprobs is not None:
            waiting.streamed_logprobs += len(logprobs)
        text, entries, first_none = _echoed(waiting, delta, logprobs, prompt_logprobs_of(chunk))
        return waiting.exchange.write(writer.delta(text, waiting.index, entries, first_none))

    @staticmethod
    def _content_part(waiting: Waiting, delta: str) -> str:
        if waiting.calling:
            return ""
        part, waiting.held_text, waiting.calling = content_part(
            waiting.held_text, delta, waiting.streamed_chars > 0
        )
        return part

    def _stream(self, waiting: Waiting, node: str) -> StreamWriter:
        writer = waiting.writer
        if writer is None:
            choices = waiting.choices
            if choices is not None and choices.writer is not None:  # (another choice's)
                writer = waiting.writer = choices.writer
                return writer
            writer = waiting.writer = StreamWriter(
                waiting.call, waiting.response_id, waiting.created
            )
            if choices is not None:
                choices.writer = writer
            # (Of several choices: the member of the first to speak.)
            waiting.exchange.start_stream(headers=self.headers(waiting, node))
        return writer

    def headers(self, waiting: Waiting, node: str) -> list[tuple[str, str]]:
        headers = [(MEMBER_HEADER, node or self._node)]
        if waiting.request_id:
            headers.append(("x-request-id", waiting.request_id))
        return headers

    # -- the door's own deadline and shutdown ------------------------------------------

    def sweep(self, now: float) -> int:
        """Answer 504 to requests past their deadline and its grace (their answer was lost:
        an owner that died with no member left to migrate to); returns how many."""
        late = [tid for tid, w in self._waiting.items() if w.deadline <= now]
        why = f"no answer within http.request_timeout_s ({self._timeout_s:g} s)"
        answered = 0
        for task_id in late:
            answered += self._give_up_guarded(task_id, ErrorCode.DEADLINE_EXCEEDED, why)
        self.counters.deadline_answers += answered
        return answered

    def give_up_all(self, why: str) -> int:
        """Answer every waiting request ``shutting_down`` (503) and cancel its task: the
        daemon stops and its answers could no longer reach the clients."""
        return sum(
            self._give_up_guarded(task_id, ErrorCode.SHUTTING_DOWN, why)
            for task_id in list(self._waiting)
        )

    def _give_up_guarded(self, task_id: str, code: ErrorCode, message: str) -> bool:
        """``_give_up``, its failure (a bug) counted and logged and that one connection
        aborted: the sweep runs in the daemon's task group, which one exception ends."""
        waiting = self._waiting.get(task_id)
        try:
            return self._give_up(task_id, code, message)
        except Exception:
            self.counters.answer_failures += 1
            log.exception("giving up on an HTTP request failed", extra={"task_id": task_id})
            if waiting is not None and not waiting.exchange.done:
                waiting.exchange.abort()
            return False

    def _give_up(self, task_id: str, code: ErrorCode, message: str) -> bool:
        """Answer ``task_id``'s request with an error and cancel it; False where it was
        answered already (a choice of a request given up before)."""
        waiting = self._waiting.pop(task_id, None)
        if waiting is None:
            return False
        choices = waiting.choices
        if choices is not None:
            self._waiting[task_id] = waiting  # (cancelled with the rest below)
            self._end_choices(choices)
            if choices.writer is not None and waiting.writer is None:
                waiting.writer = choices.writer
        error = ErrorInfo(code=code, message=message)
        if waiting.writer is not None:
            waiting.exchange.write(waiting.writer.error(error))
            waiting.exchange.end_stream()
            self.counters.count(200)
        else:
            status, body, headers = error_of(error, chat=waiting.call.chat)
            waiting.exchange.respond(status, body, headers=headers + self.headers(waiting, ""))
            self.counters.count(status)
        if choices is None:
            self._cancel(task_id)
        return True

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            if self._waiting:
                self.sweep(self._clock.monotonic())

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
