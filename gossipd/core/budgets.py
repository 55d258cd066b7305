"""What a task or a result costs in memory, for the byte budgets (sans-IO).

The budgets (``ingress.pending_bytes_max``, ``ingress.results_cache_bytes_max``,
``ingress.reply_queue_bytes_max``, ``fanout.forwarded_bytes_max``) bound memory by what the
big fields hold, not by message counts: a task is its prompt (and a structured output's
form, as large), a result its text.  Each figure
is O(1) to compute (``sys.getsizeof`` of a str reads its length and width; nothing is walked
or encoded), so the accounting costs a few hundred nanoseconds per task.  The fixed part of
each figure is what the rest of the object and its bookkeeping take (measured with
tracemalloc, see ``tests/test_budgets.py``), so that a flood of tiny tasks also counts.
"""

from __future__ import annotations

import sys

from gossipd.core.messages import Result, Task
from gossipd.core.sampling import LOGPROB_ENTRIES_MAX

# The Task struct, its params, id, reply_to and the entries that point at it (admission, the
# task book, the run queue): tracemalloc measured 610 bytes for a small task in a TaskBook.
TASK_OVERHEAD_BYTES = 700
# The Result struct, its Timings, id and the results cache's entry: measured 296 bytes (352
# with an ErrorInfo).
RESULT_OVERHEAD_BYTES = 350

# A token's log probability in a Result (TokenLogprob, its token and float, the list's slot)
# and each of its top ones (a tuple, its str and float): measured in tests/test_budgets.py.
LOGPROB_BYTES = 200
LOGPROB_TOP_BYTES = 150
# A prompt's token id beside its list slot: an int object (28 bytes) and its allocation.
TOKEN_ID_BYTES = 32
# A logit_bias entry beside the dict's table: its int and float objects (32 + 24 bytes).
LOGIT_BIAS_ENTRY_BYTES = 56

_sizeof = sys.getsizeof
# A str's size beside its characters (an empty ASCII one's): TASK_OVERHEAD_BYTES holds the
# objects of a task's short strings; their characters count on top (up to 6 KB of them).
_STR_HEAD_BYTES = sys.getsizeof("")
_STRINGS_HEADS_BYTES = 5 * _STR_HEAD_BYTES


def task_bytes(task: Task) -> int:
    """Memory a task holds: its prompt and its other strings (in memory: 1, 2 or 4 bytes
    a character), its stop strings, a structured output's form where it has one (rare: a schema or grammar may be as large),
    the log probabilities it may gather where it asks them (its max_tokens' worth, and
    with prompt_logprobs its prompt's, a token at most a byte of it and a BOS: the member running it
    keeps them until its Result), and the rest."""
    params = task.params
    form = params.structured
    ids = params.prompt_token_ids
    # The characters of its strings beside the prompt (id, key, reply_to, model,
    # traceparent) at their width in memory: inline, no call (the request path's count).
    held = (
        TASK_OVERHEAD_BYTES
        + _sizeof(task.prompt)
        + _sizeof(task.id)
        + _sizeof(task.key)
        + _sizeof(task.reply_to)
        + _sizeof(task.model)
        + _sizeof(task.traceparent)
        - _STRINGS_HEADS_BYTES
    )
    if (
        form is None
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not ids
        and params.logit_bias is None
        and params.stop_token_ids is None
        and not params.stop
    ):
        return held
    if stop := params.stop:  # (at most 8 of 64 characters)
        held += _sizeof(stop) + sum(map(_sizeof, stop))
    if ids:  # (a list's slots, and an int object each: the small ones are shared, few ids)
        held += _sizeof(ids) + TOKEN_ID_BYTES * len(ids)
    if (bias := params.logit_bias) is not None:  # (a dict's table, an int and a float each)
        held += _sizeof(bias) + LOGIT_BIAS_ENTRY_BYTES * len(bias)
    if (stop_ids := params.stop_token_ids) is not None:
        held += _sizeof(stop_ids) + TOKEN_ID_BYTES * len(stop_ids)
    if form is not None:
        held += sum(map(_sizeof, form.texts()))
    if params.logprobs is not None:
        held += params.max_tokens * (LOGPROB_BYTES + params.logprobs * LOGPROB_TOP_BYTES)
    if (top := params.prompt_logprobs) is not None:
        tokens = len(ids) if ids else len(task.prompt.encode()) + 1
        tokens = min(tokens, LOGPROB_ENTRIES_MAX // (top + 1))
        held += tokens * (LOGPROB_BYTES + top * LOGPROB_TOP_BYTES)
    return held


def result_bytes(result: Result) -> int:
    """Memory a final Result holds: its text (or error message), its log probabilities
    when the task asked them (counted by entries: O(1) a token), and the rest."""
    error = result.error
    if error is None:
        logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        if logprobs or prompt_logprobs:  # (rare: a walk of their entries is affordable then)
            entries = [*(logprobs or ()), *(prompt_logprobs or ())]
            tops = sum(len(entry.top) for entry in entries)
            return (
                RESULT_OVERHEAD_BYTES
                + _sizeof(result.text)
                + len(entries) * LOGPROB_BYTES
                + tops * LOGPROB_TOP_BYTES
            )
        return RESULT_OVERHEAD_BYTES + _sizeof(result.text)
    return RESULT_OVERHEAD_BYTES + _sizeof(result.text) + _sizeof(error.message)
