"""The OpenAI-compatible HTTP door: requests to tasks through the one intake, answers back to
the client that holds the connection (docs/PROTOCOL.md "HTTP").

    HTTP request (gossipd/http/server.py) -> route, API key -> openai_api.decode_call ->
    Task (reply_to: this door's reply address) -> Intake.take (budgets, ids, routing,
    admission: the same path as a ZeroMQ producer's task) ... Chunks and the Result come back
    to the reply address (gossipd/http/answers.py) -> SSE events or one JSON answer

Answers come back the way a producer's do: to the task's reply address.  That address is this
door's own ZeroMQ PULL socket, so an owner on another member streams to it exactly as it
streams to a producer (under CURVE the task's producer key is this daemon's own, the key the
PULL socket serves with); a task run here is handed over in-process (ReplySender.
deliver_locally), with no socket between.  Migration, deadlines and dedup are the intake's
and the forwarder's, as for any task.  A client that goes away cancels its task wherever it
runs (a Cancel through the intake, as a producer's).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

import msgspec

from gossipd.clock import SYSTEM_CLOCK, Clock
from gossipd.config import HttpConfig
from gossipd.core.messages import PROTOCOL_VERSION, Task, reply_route
from gossipd.core.sampling import LOGPROB_ENTRIES_MAX, MODEL_DEFAULT_MAX_TOKENS, SamplingParams
from gossipd.http.answers import MEMBER_HEADER, Answers, Waiting
from gossipd.http.chat import ChatTemplate, TemplateBroken, TemplateFailed
from gossipd.http.exchange import (
    WANTED_HEADERS,
    DateField,
    Exchange,
    HttpCounters,
    HttpLimits,
    Request,
)
from gossipd.http.keys import ApiKeys
from gossipd.http.openai_answers import error_body
from gossipd.http.openai_api import (
    CHAT_MAX_TOKENS_DEFAULT,
    SEED_END,
    BadRequest,
    Call,
    decode_call,
    header_text,
    placement_key,
)
from gossipd.http.sampling_fields import MAX_TOKENS_MAX
from gossipd.ingress.intake import Intake

log = logging.getLogger("gossipd.http.door")

# Past its deadline a request waits this much longer for the owner's deadline_exceeded
# before the door answers 504 itself (a Result lost with a dead owner and no migration).
DEADLINE_GRACE_S = 2.0
MODELS_TTL_S = 1.0  # how stale the door's list of the cluster's models may be
# GET /v1/models waits this long at most for members' cards asked for (core/modelcards.py)
# before it answers with max_model_len null for those that have not come.
MODELS_WAIT_S = 0.5
_MODELS_POLL_S = 0.01
# The echoed prompts' log probabilities one request of several choices may carry (its
# generated ones: LOGPROB_ENTRIES_MAX): about 26 MB held at the door for a whole answer.
ECHO_ENTRIES_MAX = 4 * LOGPROB_ENTRIES_MAX
# ...streamed, at most http.stream_buffer_bytes_max / this: what one counted entry takes in
# the stream's JSON at most, about (each choice's prompt goes in its first event, at once).
ECHO_ENTRY_EVENT_BYTES = 64
_OK_JSON = b"application/json"
_TASK_PATHS = ("/v1/completions", "/v1/chat/completions")
_READ_METHODS = ("GET", "HEAD")
_msgpack_encode = msgspec.msgpack.Encoder().encode


class RandomIds:
    """Unguessable ids (12 random bytes in hex) drawn from the OS 4 KiB at a time: two ids
    a request, one getrandom call per 170 requests instead of two a request."""

    __slots__ = ("_at", "_hex")

    POOL_BYTES = 4080  # 340 ids

    def __init__(self) -> None:
        self._hex = ""
        self._at = 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._hex):
            self._hex = os.urandom(self.POOL_BYTES).hex()
            at = 0
        self._at = at + 24
        return self._hex[at : at + 24]


def _model_card(name: str, max_model_len: int | None, created: int) -> dict[str, object]:
    """One model as /v1/models lists it (vLLM's fields)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "gossipd",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
    }


# The OpenAI error type of what the wire itself answers (docs/PROTOCOL.md's table).
_WIRE_ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def _wire_error(message: str, status: int) -> bytes:
    return error_body(message, _WIRE_ERROR_TYPES.get(status, "invalid_request_error"))


@dataclass(frozen=True, slots=True)
class DoorLinks:
    """What the door reads from the rest of the daemon (built before it)."""

    # The models members serve, with our own (GET /v1/models), each with its longest
    # prompt + output where known (ours; None for the others').
    cluster_models: Callable[[], dict[str, int | None]]
    # "" when a request can be served, else why not (readiness, 503).
    not_ready: Callable[[], str]
    # True while a member's max_model_len was asked for and has not come (GET /v1/models
    # waits for it up to MODELS_WAIT_S).
    models_pending: Callable[[], bool] = lambda: False
    # Prometheus text for GET /metrics; None: not served here.
    metrics: Callable[[], bytes] | None = None
    # With metrics.bearer_token_file: the token GET /metrics needs (API keys do not serve).
    metrics_token: str = ""


class HttpDoor:
    def __init__(
        self,
        config: HttpConfig,
        *,
        intake: Intake,
        node: str,
        model: str,
        chat: ChatTemplate,
        links: DoorLinks,
        prompt_bytes_max: int,
        keys: ApiKeys | None = None,
        producer_key: str = "",
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._config = config
        self._intake = intake
        self._node = node
        self.model = model
        self._chat = chat
        self._links = links
        self.keys = keys
        # A prompt longer than a task may carry (ingress.message_bytes_max, less room for the
        # task's other fields) is refused here with 413, as the ingress refuses its frame.
        self._prompt_bytes_max = prompt_bytes_max
        # Under CURVE: this daemon's public key, which the reply socket serves with; owners
        # check it before they send our tasks' answers.
        self._producer_key = producer_key
        self._clock = clock
        self._session_header = config.session_header.lower()
        self._timeout_ms = int(config.request_timeout_s * 1000)
        wire_counters = HttpCounters()  # the wire's, shared: the answers read streams_open
        self.answers = Answers(
            node=node,
            cancel=lambda task_id: intake.handle_cancel(task_id, producer_key),
            stream_buffer_bytes_max=config.stream_buffer_bytes_max,
            request_timeout_s=config.request_timeout_s,
            clock=clock,
            streams_unsent_bytes_max=config.streams_unsent_bytes_max,
            streams_open=lambda: wire_counters.streams_open,
        )
        self.limits = HttpLimits(
            counters=wire_counters,
            body_bytes_max=config.body_bytes_max,
            connections_max=config.connections_max,
            idle_timeout_s=config.idle_timeout_s,
            wanted_headers=WANTED_HEADERS | {self._session_header.encode()},
            error_body=_wire_error,
            count_status=self.answers.counters.count,
            read_bytes_max=config.read_bytes_max,
            answers_unsent_bytes_max=config.answers_unsent_bytes_max,
            # With keys, a request whose key is refused has its body read and dropped (it
            # gets 401 below whatever it holds): clients without a key hold no memory here.
            keeps_body=None if keys is None else self._key_taken,
            date=DateField(clock.wall),
        )
        self._ids = RandomIds()
        self._models_cache: dict[str, int | None] = {}
        self._models_until = float("-inf")
        self.server: asyncio.Server | None = None
        self.unauthorized = 0  # requests without a valid API key (401)
        self._background: set[asyncio.Task[None]] = set()  # GET /v1/models waiting for cards
        self._settled = False  # stopping, past the grace (settle): requests get 503 at once

    # -- the reply address ---------------------------------------------------------------

    @property
    def reply_to(self) -> str:
        return self.answers.reply_to

    @property
    def route(self) -> str:
        """The route of this door's tasks (what ReplySender.deliver_locally is given)."""
        return reply_route(self.answers.reply_to, self._producer_key)

    # -- requests ------------------------------------------------------------------------

    def _key_taken(self, headers: dict[str, str]) -> bool:
        keys = self.keys
        return keys is None or keys.name_of(headers.get("authorization", "")) is not None

    def handle(self, request: Request, exchange: Exchange) -> None:
        path = request.path
        if "?" in path:
            path = path.partition("?")[0]
        method = request.method
        request_id = request.headers.get("x-request-id", "")[:256]
        echo = [("x-request-id", request_id)] if request_id else None
        if path == "/health" or path == "/v1/health/ready":  # (no key asked)
            if method not in _READ_METHODS:
                self._not_allowed(exchange, path, echo)
            elif path == "/health":
                self._json(exchange, 200, b'{"status":"ok"}', echo)
            elif why := self._links.not_ready():
                self._error(exchange, 503, why, "server_error", code="unavailable", headers=echo)
            else:
                self._json(exchange, 200, b'{"status":"ready"}', echo)
            return
        authorization = request.headers.get("authorization", "")
        if path == "/metrics" and self._links.metrics_token:
            expected = f"Bearer {self._links.metrics_token}".encode("latin-1", "replace")
            # In constant time, as the metrics port compares it (ops/metrics_server.py).
            if not hmac.compare_digest(authorization.encode("latin-1", "replace"), expected):
                self._unauthorized(exchange, "GET /metrics needs metrics.bearer_token_file's "
                                   "token", echo)  # fmt: skip
                return
            identity = ""
        elif self.keys is not None:
            name = None if request.key_refused else self.keys.name_of(authorization)
            if name is None:
                self._unauthorized(
                    exchange,
                    "send a valid API key as 'Authorization: Bearer KEY' (http.keys_dir)",
                    echo,
                )
                return
            identity = f"http:{name}"
        else:
            identity = ""  # every client: the budget a keyless task has (tokenbudgets)
        if path in _TASK_PATHS:
            if method != "POST":
                allow = [("allow", "POST"), *(echo or [])]
                self._error(exchange, 405, f"{path} takes POST", "invalid_request_error",
                            headers=allow)  # fmt: skip
                return
            self._take(request, exchange, path == "/v1/chat/completions", identity, request_id,
                       echo)  # fmt: skip
        elif path == "/v1/models" and method in _READ_METHODS:
            self._with_cards(lambda: self._json(exchange, 200, self._models(), echo))
        elif path.startswith("/v1/models/") and method in _READ_METHODS:
            name = unquote(path[len("/v1/models/") :])
            self._with_cards(lambda: self._one_model(exchange, name, echo))
        elif path == "/metrics" and self._links.metrics and method in _READ_METHODS:
            exchange.respond(
                200, self._links.metrics(), content_type=b"text/plain; version=0.0.4",
                headers=echo,
            )  # fmt: skip
            self.answers.counters.count(200)
        elif (
            path == "/v1/models"
            or path.startswith("/v1/models/")
            or (path == "/metrics" and self._links.metrics)
        ):
            self._not_allowed(exchange, path, echo)
        else:
            self._error(exchange, 404, f"no route {method} {path[:200]}", "invalid_request_error",
                        headers=echo)  # fmt: skip

    def _take(
        self,
        request: Request,
        exchange: Exchange,
        chat: bool,
        identity: str,
        request_id: str,
        echo: list[tuple[str, str]] | None,
    ) -> None:
        """``echo``: the x-request-id header to answer with (None: the client sent none)."""
        if self._settled:
            # A keep-alive client's request after the grace: its answer would find no door
            # (the daemon is closing it), so it is refused now and the connection closed.
            exchange.keep_alive = False
            self._error(exchange, 503, "this daemon is stopping: send the request to another "
                        "member", "server_error", code="shutting_down",
                        headers=[(MEMBER_HEADER, self._node), *(echo or [])])  # fmt: skip
            return
        try:
            call = decode_call(request.body, chat=chat)
            models = self._models_now()
            if call.model not in models:
                raise BadRequest(
                    f"the model {call.model!r} is not served in this cluster (GET /v1/models)",
                    param="model",
                    status=404,
                    code="model_not_found",
                )
            prompt = (
                self._chat.render(call.messages, call.tools.tools if call.tools else None)
                if call.messages is not None
                else call.prompt
            )
            room = self._prompt_bytes_max
            if call.params.structured is not None:  # (it rides in the task beside the prompt)
                room -= len(_msgpack_encode(call.params.structured))
                if room <= 0:
                    raise BadRequest(
                        "the form the output is held to (response_format, guided_*, "
                        "structured_outputs or tool_choice) alone is over what a task may carry "
                        f"({self._prompt_bytes_max} bytes: ingress.message_bytes_max)",
                        status=413,
                    )
            self._check_size(prompt, chat, room)
            if call.token_prompts:
                for ids in call.token_prompts:
                    self._check_ids_size(ids, room)
            if call.several:
                self._check_choices(call, room)
            params = call.params
            special = call.special_tokens
            if special is None:  # (a chat through the model's own template: it wrote them)
                special = not (chat and self._chat.own)
            if not special:
                params = msgspec.structs.replace(params, add_special_tokens=False)
            if chat and call.max_tokens_default:
                params = self._chat_max_tokens(params, models[call.model], call.choices)
            if params.logprobs is not None and call.choices > 1:
                self._check_logprobs(params, call)
        except BadRequest as exc:
            # (OpenAI's type for an unknown model too: the status says 404)
            self._error(exchange, exc.status, exc.message, "invalid_request_error", param=exc.param,
                        code=exc.code, headers=echo)  # fmt: skip
            return
        except TemplateFailed as exc:
            self._error(exchange, 400, f"messages: the chat template failed: {exc}",
                        "invalid_request_error", param="messages", headers=echo)  # fmt: skip
            return
        except TemplateBroken as exc:  # the model's, not the request's
            self._error(exchange, 500, str(exc), "server_error", headers=echo)
            return
        # What the request left out takes the model's own default where its owner's engine
        # has one (its generation config), as `vllm serve` reads it.
        model_defaults = call.unset_sampling
        if chat and call.max_tokens_default:
            model_defaults |= MODEL_DEFAULT_MAX_TOKENS
        # Ids no client can guess (a ZeroMQ producer without CURVE shares our producer key
        # "": a guessable id could be cancelled or read from the results cache by it), and a
        # response id that is not the task id.
        task_id = "http-" + self._ids.next()
        session = header_text(request.headers.get(self._session_header, "")) or call.user
        now = self._clock.monotonic()
        task = Task(
            v=PROTOCOL_VERSION,
            id=task_id,
            key=placement_key(session) if session else "",
            prompt=prompt,
            params=params,
            reply_to=self.answers.reply_to,
            timeout_ms=self._timeout_ms,
            # A chat whose answer is held to tool calls ("required", named) streams them at
            # its end: no Chunks.  "auto" streams what cannot begin a call (answers.py).
            # An echo of the prompt alone (max_tokens 0) shows no generated text: no Chunks.
            stream=call.stream
            and not call.echo_only
            and (call.tools is None or call.tools.choice in ("none", "auto")),
            model=call.model,
            producer_key=self._producer_key,
            # An owner's answers to this door that leave in one turn go as one frame.
            batch_replies=True,
            model_defaults=model_defaults,
        )
        response_id = ("chatcmpl-" if chat else "cmpl-") + self._ids.next()
        waiting = Waiting(
            exchange=exchange,
            call=call,
            response_id=response_id,
            created=int(self._clock.wall()),
            deadline=now + self._config.request_timeout_s + DEADLINE_GRACE_S,
            # As OpenAI, every answer to a task names a request id (the openai client's
            # _request_id): the client's, else the response's.
            request_id=request_id or response_id,
        )
        if call.several:
            self._take_choices(task, call, waiting, now, identity)
            return
        self.answers.wait(task_id, waiting)
        try:
            self._intake.take(task, now, identity)
        except Exception:
            self.answers.forget(task_id)  # (the wire answers it 500)
            raise

    def _check_size(self, prompt: str, chat: bool, room: int) -> None:
        if len(prompt) > room // 4 and (size := len(prompt.encode())) > room:
            most = self._prompt_bytes_max
            if room < most:
                what = (
                    f"the prompt ({size} bytes) and the form the output is held to "
                    f"({most - room} bytes: response_format, guided_*, structured_outputs or "
                    f"tool_choice) are over {most} bytes together"
                )
            else:
                what = f"the prompt is over {room} bytes"
            raise BadRequest(
                f"{what} (what a task may carry: ingress.message_bytes_max)",
                param="messages" if chat else "prompt",
                status=413,
            )

    def _check_ids_size(self, ids: list[int], room: int) -> None:
        """A prompt of token ids a task may carry (up to 5 bytes an id on the wire)."""
        if 5 * len(ids) > room and (size := len(_msgpack_encode(ids))) > room:
            raise BadRequest(
                f"the prompt's {len(ids)} token ids take {size} bytes, over the {room} a task "
                "may carry (ingress.message_bytes_max)",
                param="prompt",
                status=413,
            )

    def _check_choices(self, call: Call, room: int) -> None:
        most = self._config.choices_max
        if call.choices > most:
            raise BadRequest(
                f"{len(call.prompts) or len(call.token_prompts) or 1} prompt(s) x n={call.n} is "
                f"{call.choices} choices; "
                f"at most {most} are served in one request (http.choices_max): send fewer "
                "at once (LangChain's OpenAI: batch_size)",
                param="n" if call.n > 1 else "prompt",
            )
        for prompt in call.prompts:
            self._check_size(prompt, call.chat, room)

    def _take_choices(
        self, task: Task, call: Call, first: Waiting, now: float, identity: str
    ) -> None:
        """A request of several choices (prompts x n): one task each, placed and run as any
        task, answered together (answers.Choices).  Choice ``i * n + j`` is prompt i's j-th,
        its seed the request's + j as vLLM seeds its n (the same seed would give n copies)."""
        seed = task.params.seed
        tasks: list[Task] = []
        sources: list[tuple[str, list[int] | None]] = [(p, None) for p in call.prompts] or [
            ("", ids) for ids in call.token_prompts
        ]
        for prompt, ids in sources or [(task.prompt, task.params.prompt_token_ids)]:
            asked = task.params
            if ids is not asked.prompt_token_ids:
                asked = msgspec.structs.replace(asked, prompt_token_ids=ids)
            for j in range(call.n):
                params = asked
                if seed is not None and j:
                    params = msgspec.structs.replace(params, seed=(seed + j) % SEED_END)
                task_id = "http-" + self._ids.next() if tasks else task.id
                tasks.append(
                    msgspec.structs.replace(task, id=task_id, prompt=prompt, params=params)
                )
        choices = self.answers.wait_choices([t.id for t in tasks], first)
        try:
            if not self._intake.charge_together(tasks, now, identity):
                return  # (answered over_budget as the first choice's)
            for each in tasks:
                if choices.ended:  # refused within a take: the request has its answer
                    break
                choices.taken += 1
                self._intake.take(each, now, identity, charged=True)
        except Exception:
            self.answers.forget_choices(choices)  # (the wire answers it 500)
            raise

    def _check_logprobs(self, params: SamplingParams, call: Call) -> None:
        """A request's log probabilities, over all its choices, at most what one Result may
        carry (a whole answer holds every choice's)."""
        assert params.logprobs is not None
        if (top := params.prompt_logprobs) is not None:
            # An echo's: a token a byte at most, and one more (a BOS); more in one choice
            # than a Result carries: its owner refuses it.
            per = LOGPROB_ENTRIES_MAX // (top + 1)
            prompts = call.prompts or (call.prompt,)
            if call.token_prompts:
                tokens = call.n * sum(min(len(ids), per) for ids in call.token_prompts)
            else:
                tokens = call.n * sum(min(len(p.encode()) + 1, per) for p in prompts)
            bound = ECHO_ENTRIES_MAX
            if call.stream:
                bound = min(bound, self._config.stream_buffer_bytes_max // ECHO_ENTRY_EVENT_BYTES)
            if tokens * (top + 1) > bound:
                raise BadRequest(
                    f"echo with logprobs: {call.choices} choices' prompts may have up to "
                    f"{tokens} tokens (a token a byte at most) x (logprobs {top} + 1), over "
                    f"{bound} log probabilities in one request"
                    + (" streamed (http.stream_buffer_bytes_max)" if call.stream else "")
                    + ": send fewer or shorter prompts a request",
                    param="prompt",
                )
        entries = call.choices * params.max_tokens * (params.logprobs + 1)
        if entries > LOGPROB_ENTRIES_MAX:
            raise BadRequest(
                f"{call.choices} choices x max_tokens {params.max_tokens} x (logprobs "
                f"{params.logprobs} + 1) is {entries} log probabilities; at most "
                f"{LOGPROB_ENTRIES_MAX} in one request: ask fewer choices, tokens or top ones",
                param="n" if call.n > 1 else "prompt",
            )

    def _chat_max_tokens(
        self, params: SamplingParams, context: int | None, choices: int
    ) -> SamplingParams:
        """A chat that named no max_tokens: http.chat_max_tokens_default within the model's
        context, or (0) the whole context (the engine stops at it: finish_reason "length");
        with log probabilities, at most what one request may carry (``_check_logprobs``)."""
        asked = self._config.chat_max_tokens_default
        if context:
            n = min(asked, context) if asked else min(context, MAX_TOKENS_MAX)
        else:
            n = asked or CHAT_MAX_TOKENS_DEFAULT
        if params.logprobs is not None:
            n = max(1, min(n, LOGPROB_ENTRIES_MAX // ((params.logprobs + 1) * choices)))
        if n < params.min_tokens:
            bound = "http.chat_max_tokens_default within the model's context"
            if params.logprobs is not None:
                bound += " and what its log probabilities may take"
            raise BadRequest(
                f"min_tokens ({params.min_tokens}) is more than this chat's max_tokens ({n}: "
                f"{bound}): send max_tokens",
                param="min_tokens",
            )
        return params if n == params.max_tokens else msgspec.structs.replace(params, max_tokens=n)

    # -- stopping ------------------------------------------------------------------------

    def stop_listening(self) -> None:
        """Take no new connection (the daemon stops); waiting requests are still answered."""
        if self.server is not None:
            self.server.close()

    async def settle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every waiting request's answer; then answer the rest
        503 ``shutting_down`` and cancel their tasks.  Returns how many were cut."""
        deadline = self._clock.monotonic() + timeout_s
        while len(self.answers) and self._clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._settled = True  # from now on nothing carries an answer back: _take refuses
        return self.answers.give_up_all("this daemon stopped before the answer came")

    # -- small answers -------------------------------------------------------------------

    def _with_cards(self, answer: Callable[[], None]) -> None:
        """Answer GET /v1/models or /v1/models/{model} now, or, while members' cards asked
        for are on their way, once they have come or after MODELS_WAIT_S with what is known
        (null for the rest): both read the same cards."""
        self._models_now()  # asks members for the cards it lacks (a walk a second at most)
        if not self._links.models_pending():
            answer()
            return
        waiting = asyncio.get_running_loop().create_task(self._models_soon(answer))
        self._background.add(waiting)
        waiting.add_done_callback(self._background.discard)

    async def _models_soon(self, answer: Callable[[], None]) -> None:
        until = self._clock.monotonic() + MODELS_WAIT_S
        while self._links.models_pending() and self._clock.monotonic() < until:
            await asyncio.sleep(_MODELS_POLL_S)
        self._models_now(fresh=True)
        answer()

    def _models_now(self, *, fresh: bool = False) -> dict[str, int | None]:
        """The cluster's models, read again at most every MODELS_TTL_S (a member table walk
        per request would cost as much as the rest of the door), or now (``fresh``)."""
        now = self._clock.monotonic()
        if fresh or now >= self._models_until:
            self._models_cache = self._links.cluster_models()
            self._models_until = now + MODELS_TTL_S
        return self._models_cache

    def _models(self) -> bytes:
        created = int(self._clock.wall())
        data = [
            _model_card(name, max_model_len, created)
            for name, max_model_len in sorted(self._models_now().items())
        ]
        return msgspec.json.encode({"object": "list", "data": data})

    def _one_model(self, exchange: Exchange, name: str, echo: list[tuple[str, str]] | None) -> None:
        """GET /v1/models/{model} (OpenAI's "retrieve model"; the id may hold slashes):
        its card, as in the list, or 404 ``model_not_found``."""
        models = self._models_now(fresh=True)
        if name not in models:
            self._error(exchange, 404, f"the model {name[:200]!r} is not served in this "
                        "cluster (GET /v1/models)", "invalid_request_error", param="model",
                        code="model_not_found", headers=echo)  # fmt: skip
            return
        card = _model_card(name, models[name], int(self._clock.wall()))
        self._json(exchange, 200, msgspec.json.encode(card), echo)

    def _json(
        self, exchange: Exchange, status: int, body: bytes, headers: list[tuple[str, str]] | None
    ) -> None:
        exchange.respond(status, body, content_type=_OK_JSON, headers=headers)
        self.answers.counters.count(status)

    def _not_allowed(
        self, exchange: Exchange, path: str, echo: list[tuple[str, str]] | None
    ) -> None:
        self._error(exchange, 405, f"{path[:200]} takes GET or HEAD", "invalid_request_error",
                    headers=[("allow", "GET, HEAD"), *(echo or [])])  # fmt: skip

    def _unauthorized(
        self, exchange: Exchange, message: str, echo: list[tuple[str, str]] | None
    ) -> None:
        self.unauthorized += 1
        self._error(exchange, 401, message, "authentication_error", code="invalid_api_key",
                    headers=[("www-authenticate", 'Bearer realm="gossipd"'), *(echo or [])])  # fmt: skip

    def _error(
        self,
        exchange: Exchange,
        status: int,
        message: str,
        err_type: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        exchange.respond(
            status, error_body(message, err_type, param=param, code=code), headers=headers
        )
        self.answers.counters.count(status)

    def close(self) -> None:
        for waiting in self._background:
            waiting.cancel()
        self.answers.close()
        if self.server is not None:
            self.server.close()
