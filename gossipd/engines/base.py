"""The engine interface: what the daemon needs from an inference engine.

An engine streams text deltas for one request, reports its health and load, and is started
and stopped by the daemon.  Cancelling the task that iterates ``generate`` aborts the request
inside the engine (an engine must guarantee this; vLLM's AsyncLLM does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import msgspec

from gossipd.core.sampling import LOGPROB_ENTRIES_MAX, SamplingParams, TokenLogprob


class EngineError(Exception):
    """The engine failed while serving a request (answered with engine_error)."""


class EngineDead(EngineError):
    """The engine is gone (its process died): nothing more can run here.  A task that fails
    this way was not the task's fault, so the daemon hands it to another member."""


class EngineNotRunning(EngineDead):
    """The engine was dead already when the request came to it: the request never ran in
    it, so that engine's death is not counted against the task (engine.deaths_per_task_max)."""


class InvalidRequest(Exception):
    """The engine refuses the request's parameters (answered with bad_request)."""


# How an engine's refusal of a prompt longer than its context begins: OpenAI's words, which
# clients match (LiteLLM's ContextWindowExceededError and its fallbacks); the HTTP door
# answers it with code context_length_exceeded.
CONTEXT_EXCEEDED_PREFIX = "This model's maximum context length is"


def context_exceeded(max_model_len: int, prompt_tokens: int, detail: str) -> InvalidRequest:
    return InvalidRequest(
        f"{CONTEXT_EXCEEDED_PREFIX} {max_model_len} tokens. However, your prompt is "
        f"{prompt_tokens} tokens, and at least 1 more is asked for the answer. Shorten the "
        f"prompt. ({detail})"
    )


def check_prompt_logprobs(prompt_tokens: int, top: int) -> None:
    """Refuse (InvalidRequest) a prompt whose scores a Result cannot carry: prompt tokens x
    (prompt_logprobs + 1) over LOGPROB_ENTRIES_MAX.  Engines check it before they build
    them (a long context with 20 top ones would be millions of entries)."""
    if prompt_tokens * (top + 1) > LOGPROB_ENTRIES_MAX:
        raise InvalidRequest(
            f"prompt_logprobs: the prompt's {prompt_tokens} tokens x (prompt_logprobs {top} "
            f"+ 1) is more than the {LOGPROB_ENTRIES_MAX} log probabilities a Result carries; "
            "ask fewer top ones or send a shorter prompt"
        )


class Usage(msgspec.Struct):
    """What one request took, filled in by the engine as it generates (the OpenAI door's
    ``usage`` and ``finish_reason``): "length" when max_tokens ended it, "stop" else."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""


# Made for every task: a Struct (built in C; a dataclass's __init__ took 0.3 us, a frozen
# one's 0.62-0.71).  Nothing reassigns its fields.
class GenerateRequest(msgspec.Struct, eq=False):
    request_id: str
    prompt: str
    params: SamplingParams
    usage: Usage = msgspec.field(default_factory=Usage)
    model_defaults: int = 0  # Task.model_defaults: fields that take the model's own default
    # When the task asks params.logprobs: the engine appends each generated token's here
    # as it goes, before the delta its text is in (the runner sends them with the delta).
    logprobs: list[TokenLogprob] | None = None
    # When the task asks params.prompt_logprobs: the engine appends each prompt token's
    # here, the first with logprob 0 and no top ones, before its first delta.
    prompt_logprobs: list[TokenLogprob] | None = None
    # The prompt as token ids (params.prompt_token_ids; ``prompt`` is then "").
    prompt_token_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Load figures that placement and gossip use.  Units are in the names."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage_ratio: float = 0.0
    generated_tokens_total: int = 0
    queued_tokens: int = 0  # prompt tokens waiting for their first step
    unfinished_requests: int = 0  # requests the engine holds (running, waiting, aborting)
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # ...and found there
    # Steps the engine has made (any count that grows while it works): engines/stall.py.
    steps_total: int = 0


class Engine(Protocol):
    name: str

    async def start(self) -> None:
        """Load the model; return when requests can be served."""

    async def stop(self) -> None:
        """Release the engine; requests still running are aborted."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[str]:
        """Stream the output text of one request as deltas.  Raises ``InvalidRequest`` or
        ``EngineError``; cancelling the consuming task aborts the request."""
        ...

    def healthy(self) -> bool:
        """False once the engine cannot serve any more (the daemon then stops taking tasks)."""
        ...

    def stats(self) -> EngineStats: ...

    def abandon(self, reason: str) -> None:
        """The engine is hung (engines/stall.py): end it, its process killed where it has
        one.  ``healthy`` is False from now on; its running requests end with EngineDead
        once it is gone."""
