"""Which release a member runs (its gossiped GpuState ``software_version``), and so which peer
messages it understands: a message a member's release does not know makes it refuse the
whole message it travels in, so it is sent only to members of a release that knows it."""

from __future__ import annotations

# The release from which members read Task params' presence_penalty, frequency_penalty,
# repetition_penalty, min_p, min_tokens and structured (sampling.release_asked): a task
# that asks one is placed only on such members, and refused unavailable where none serves its
# model (core/placer.py).
PENALTIES_FROM_VERSION = (0, 3, 2)
# The release from which members read Task params' logprobs (and write Chunk's and Result's).
LOGPROBS_FROM_VERSION = (0, 3, 3)
# The release from which members read Task params' prompt_logprobs (and write Chunk's and
# Result's).
PROMPT_LOGPROBS_FROM_VERSION = (0, 3, 4)
# The release from which members read Task params' prompt_token_ids (a prompt as token ids).
TOKEN_IDS_FROM_VERSION = (0, 3, 4)
# The release from which members read Task params' logit_bias and stop_token_ids.
TOKEN_BIAS_FROM_VERSION = (0, 3, 5)
# The release from which members read Task params' add_special_tokens (the HTTP door's
# chats set it false).
SPECIAL_TOKENS_FROM_VERSION = (0, 3, 6)
# The newest of these: members before it are the "older" ones a placer keeps apart.
NEWEST_PARAMS_VERSION = max(
    PROMPT_LOGPROBS_FROM_VERSION,
    TOKEN_IDS_FROM_VERSION,
    TOKEN_BIAS_FROM_VERSION,
    SPECIAL_TOKENS_FROM_VERSION,
)


def release_of(software_version: str) -> tuple[int, int, int] | None:
    """``software_version``'s first three dot-separated parts ("0.3.0.dev1" is (0, 3, 0));
    None where they are not three integers ("0.3.0rc1", "")."""
    parts = software_version.split(".")[:3]
    try:
        numbers = tuple(int(p) for p in parts)
    except ValueError:
        return None
    return (numbers[0], numbers[1], numbers[2]) if len(numbers) == 3 else None


def release_at_least(software_version: str, first: tuple[int, int, int]) -> bool:
    """True when ``software_version``'s first three dot-separated parts are integers at least
    ``first`` ("0.3.0.dev1" counts as 0.3.0; "0.3.0rc1", "", or unreadable: no)."""
    release = release_of(software_version)
    return release is not None and release >= first
