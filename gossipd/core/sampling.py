"""How a task asks to be sampled (``SamplingParams``, vLLM's names and meanings), the forms
its output may be held to (``StructuredOutput``), the log probabilities its answers carry
(``TokenLogprob``), and their bounds: the parts of a Task that its engine reads.  The Task
and the other messages are in messages.py, and codec.py decodes these with them (the same rules:
decoding validates everything; a struct that passes is well formed).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from gossipd.core.releases import (
    LOGPROBS_FROM_VERSION,
    PENALTIES_FROM_VERSION,
    PROMPT_LOGPROBS_FROM_VERSION,
    SPECIAL_TOKENS_FROM_VERSION,
    TOKEN_BIAS_FROM_VERSION,
    TOKEN_IDS_FROM_VERSION,
)

STRUCTURED_TEXT_MAX = 65536  # a JSON Schema's or a grammar's text, in code points
STRUCTURED_JSON_DEPTH_MAX = 64  # a JSON Schema's nesting (vLLM's own bound)


class StructuredOutput(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    forbid_unknown_fields=True,
    omit_defaults=True,
):
    """Output held to a form, as vLLM's structured outputs hold it: exactly one of these."""

    json: Annotated[str, msgspec.Meta(max_length=STRUCTURED_TEXT_MAX)] = ""  # a JSON Schema
    json_object: bool = False  # any JSON object
    regex: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    choice: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]],
        msgspec.Meta(max_length=256),
    ] = msgspec.field(default_factory=list)
    grammar: Annotated[str, msgspec.Meta(max_length=STRUCTURED_TEXT_MAX)] = ""  # EBNF

    def __post_init__(self) -> None:
        asked = bool(self.json) + self.json_object + bool(self.regex) + bool(self.choice)
        if asked + bool(self.grammar) != 1:
            raise ValueError("structured: exactly one of json, json_object, regex, choice, grammar")
        if self.json:
            try:
                schema = msgspec.json.decode(self.json)
            except (msgspec.DecodeError, RecursionError):  # (how deep it may go depends on
                schema = None  # the caller's stack: refused either way, below)
            if not isinstance(schema, dict):
                raise ValueError("structured: json must be a JSON Schema, an object as JSON text")
            if _nesting(schema) > STRUCTURED_JSON_DEPTH_MAX:
                raise ValueError(f"structured: json nests deeper than {STRUCTURED_JSON_DEPTH_MAX}")

    def texts(self) -> tuple[str, ...]:
        """Its strings (the unset ones empty): what it holds in memory, and what the engine
        compiles (core/budgets.task_bytes, ingress/budgets: its token cost)."""
        return (self.json, self.regex, self.grammar, *self.choice)


def _nesting(doc: object) -> int:
    """How deep objects and arrays nest in decoded JSON (a walk, not a recursion)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


LOGPROBS_TOP_MAX = 20  # (vLLM's max_logprobs, OpenAI's top_logprobs)
# Log probabilities one task's Result carries at most (tokens x (1 + the top ones)): a
# Result must fit a frame between daemons (fanout.message_bytes_max, 4 MiB by default).
LOGPROB_ENTRIES_MAX = 32768
LOGPROB_TOKEN_CHARS_MAX = 1024  # a token's text in an entry (engines cut longer ones)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A generated token, its log probability, and the most likely tokens at its place with
    theirs, most likely first (OpenAI's logprobs; -9999 stands for minus infinity)."""

    token: Annotated[str, msgspec.Meta(max_length=LOGPROB_TOKEN_CHARS_MAX)]
    logprob: float
    top: Annotated[
        tuple[tuple[Annotated[str, msgspec.Meta(max_length=LOGPROB_TOKEN_CHARS_MAX)], float], ...],
        msgspec.Meta(max_length=LOGPROBS_TOP_MAX + 1),
    ] = ()


Logprobs = Annotated[list[TokenLogprob], msgspec.Meta(max_length=LOGPROB_ENTRIES_MAX)]


def check_logprobs(logprobs: list[TokenLogprob]) -> None:
    """At most LOGPROB_ENTRIES_MAX entries, the top ones counted: what a decoded list may
    hold (a frame of tiny entries would take many times its bytes in memory)."""
    if len(logprobs) + sum(len(entry.top) for entry in logprobs) > LOGPROB_ENTRIES_MAX:
        raise ValueError(f"logprobs: more than {LOGPROB_ENTRIES_MAX} entries, the top ones counted")


# A prompt given as token ids: at most this many (a long context's), each a vocabulary index.
PROMPT_TOKEN_IDS_MAX = 131072
TOKEN_ID_MAX = 2**31 - 1
# OpenAI's logit_bias: at most its 300 token ids, each biased by -100..100.
LOGIT_BIAS_MAX = 300
LOGIT_BIAS_BOUND = 100.0
# vLLM's stop_token_ids: at most this many.
STOP_TOKEN_IDS_MAX = 256

_TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_ID_MAX)]


# The defaults of the params added in release 0.3.2: a value equal to one is replaced
# by the object itself, because omit_defaults leaves out only the default object (not an
# equal float decoded from a frame), and a member from before them refuses the key.
_NO_PENALTY = 0.0
_NO_REPETITION_PENALTY = 1.0


# The messages made per task (a Task and its params, its Result, the fan-out messages) are
# gc=False structs: they never hold a reference cycle, so the cyclic collector need not
# track them (fewer objects on each young-generation pass, fewer passes).
class SamplingParams(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    gc=False,
    forbid_unknown_fields=True,
    # A field at its default is not written: a member from before a field was added reads
    # every task that does not ask it (unknown params are refused: PROTOCOL.md).
    omit_defaults=True,
):
    """How to sample.  The names and meanings follow vLLM's ``SamplingParams``."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=32768)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=100_000)] = -1
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=64)]],
        msgspec.Meta(max_length=8),
    ] = msgspec.field(default_factory=list)
    # Generate max_tokens tokens even past the end-of-sequence token (benchmarks).
    ignore_eos: bool = False
    # Penalties (OpenAI's two, vLLM's repetition_penalty: 1 is none), min_p, min_tokens.
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = _NO_PENALTY
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = _NO_PENALTY
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = _NO_REPETITION_PENALTY
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = _NO_PENALTY
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=32768)] = 0
    # Output held to a JSON Schema, any JSON object, a regex, a choice or a grammar.
    structured: StructuredOutput | None = None
    # Each generated token's log probability and the `logprobs` most likely tokens at its
    # place, with theirs (Chunk's and Result's logprobs).  Release 0.3.3.
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=LOGPROBS_TOP_MAX)] | None = None
    # Each prompt token's log probability and the `prompt_logprobs` most likely tokens at its
    # place (Result's prompt_logprobs, and the first Chunk's): OpenAI's completions `echo`
    # with `logprobs`.  Release 0.3.4.
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=LOGPROBS_TOP_MAX)] | None = None
    # The prompt as token ids of the model's tokenizer, instead of the Task's ``prompt``
    # (then ""): OpenAI's completions prompt of integers.  Here, not on the Task, so that a
    # member before release 0.3.4 refuses it (unknown params are refused; a Task's unknown
    # keys are ignored: it would run an empty prompt).
    prompt_token_ids: (
        Annotated[list[_TokenId], msgspec.Meta(min_length=1, max_length=PROMPT_TOKEN_IDS_MAX)]
        | None
    ) = None
    # OpenAI's logit_bias: each token id's bias, added to its logit before sampling (-100
    # bans it, 100 all but forces it).  Release 0.3.5.
    logit_bias: (
        Annotated[
            dict[
                _TokenId,
                Annotated[float, msgspec.Meta(ge=-LOGIT_BIAS_BOUND, le=LOGIT_BIAS_BOUND)],
            ],
            msgspec.Meta(min_length=1, max_length=LOGIT_BIAS_MAX),
        ]
        | None
    ) = None
    # vLLM's stop_token_ids: generation ends at any of these tokens (its text not shown),
    # as at the end-of-sequence token.  Release 0.3.5.
    stop_token_ids: (
        Annotated[list[_TokenId], msgspec.Meta(min_length=1, max_length=STOP_TOKEN_IDS_MAX)] | None
    ) = None
    # The engine tokenizes the prompt's text with the model's special tokens (a BOS) unless
    # false: a prompt rendered through a chat template, which writes them itself (vLLM's chat
    # endpoint tokenizes without them).  A prompt of token ids is taken as it is either way.
    # Release 0.3.6.
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, not 0")
        if (
            self.logprobs is not None
            and self.max_tokens * (self.logprobs + 1) > LOGPROB_ENTRIES_MAX
        ):
            raise ValueError(
                f"logprobs ({self.logprobs}) with max_tokens ({self.max_tokens}): max_tokens x "
                f"(logprobs + 1) must be at most {LOGPROB_ENTRIES_MAX} (a Result carries them "
                "all); ask fewer"
            )
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        # (Identity tests first, unrolled: the usual params carry the default objects, and
        # this runs for every task decoded.)
        if self.presence_penalty is not _NO_PENALTY and self.presence_penalty == 0.0:
            msgspec.structs.force_setattr(self, "presence_penalty", _NO_PENALTY)  # 0, -0.0
        if self.frequency_penalty is not _NO_PENALTY and self.frequency_penalty == 0.0:
            msgspec.structs.force_setattr(self, "frequency_penalty", _NO_PENALTY)
        if self.min_p is not _NO_PENALTY and self.min_p == 0.0:
            msgspec.structs.force_setattr(self, "min_p", _NO_PENALTY)
        if self.repetition_penalty is not _NO_REPETITION_PENALTY and self.repetition_penalty == 1.0:
            msgspec.structs.force_setattr(self, "repetition_penalty", _NO_REPETITION_PENALTY)


# Task.model_defaults: which sampling fields take the model's own default.  MAX_TOKENS: at
# most the model's max_new_tokens (vLLM's chat default: the smaller of it and the context).
MODEL_DEFAULT_TEMPERATURE = 1
MODEL_DEFAULT_TOP_P = 2
MODEL_DEFAULT_TOP_K = 4
MODEL_DEFAULT_MAX_TOKENS = 8


def release_asked(params: SamplingParams) -> tuple[int, int, int] | None:
    """The release a member needs to read ``params`` where it asks a field added after
    0.3.1 (members before it refuse the field: core/releases.py); None: any member reads it.
    Identity tests: the neutral values are the default objects (SamplingParams.__post_init__)."""
    if not params.add_special_tokens:
        return SPECIAL_TOKENS_FROM_VERSION
    if params.logit_bias is not None or params.stop_token_ids is not None:
        return TOKEN_BIAS_FROM_VERSION
    if params.prompt_token_ids is not None:
        return TOKEN_IDS_FROM_VERSION
    if params.prompt_logprobs is not None:
        return PROMPT_LOGPROBS_FROM_VERSION
    if params.logprobs is not None:
        return LOGPROBS_FROM_VERSION
    if (
        params.presence_penalty is not _NO_PENALTY
        or params.frequency_penalty is not _NO_PENALTY
        or params.min_p is not _NO_PENALTY
        or params.repetition_penalty is not _NO_REPETITION_PENALTY
        or params.min_tokens != 0
        or params.structured is not None
    ):
        return PENALTIES_FROM_VERSION
    return None
