"""Members' engine load as this daemon knows it, and the load records it passes on (issue 17).

A member's load (in-flight tasks, engine queue, KV cache use) changes every second; its Meta
(addresses, model, prefixes, weight) rarely.  Load therefore travels apart, as a
``LoadRecord`` of about 20 bytes (core/gossip_messages.py), through three sources:

- the owner's own replies: every ForwardReply and TaskDone an owner sends carries its load as
  it answers, so an entry point knows the members it actually sends to (fresh exactly where
  placement looks);
- load gossip: records relayed with their own byte budget per message, newest first, each
  record passed on a bounded number of times (``LoadRumors``);
- the Meta (GpuState), the oldest: used only while no record is known.

``LoadView`` keeps, per member, the newest sample (by the member's ``seq``) whichever way it
came, with the local time it was taken at (receive time less the ``age_ms`` it carried), so
placement uses the freshest source per member and can say how old the state it used was.

Sans-IO: times are passed in (seconds on one monotonic clock); nothing here sends.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from gossipd.core.gossip_messages import (
    LOAD_COUNT_MAX,
    LOAD_RECORDS_MAX,
    QUEUED_TOKENS_MAX,
    LoadRecord,
    encode_update,
)

AGE_MS_MAX = 3_600_000  # the wire's bound on age_ms
# The same seq again counts as news (a confirmation that the figures still hold) only this
# much later than the copy held: relayed copies differ by rounding of age_ms, and must not.
CONFIRM_MIN_S = 0.1


@dataclass(slots=True)
class Known:
    """The newest sample of one member's load: the record and the local time it was taken."""

    record: LoadRecord
    sampled_at: float

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.sampled_at)


def with_age(record: LoadRecord, sampled_at: float, now: float) -> LoadRecord:
    """``record`` as it leaves at ``now``: its age is the time since it was sampled."""
    age_ms = min(AGE_MS_MAX, max(0, int((now - sampled_at) * 1000.0)))
    if age_ms == record.age_ms:
        return record
    return LoadRecord(
        record.node,
        record.seq,
        age_ms,
        record.inflight,
        record.waiting,
        record.queued_tokens,
        record.kv_pct,
    )


class LoadView:
    """The newest known load sample per member.  ``offer`` keeps a record only if it is
    newer than the one held (a replay or an older relay changes nothing)."""

    def __init__(self, members_max: int = 100_000) -> None:
        self.members_max = members_max
        self._known: dict[str, Known] = {}
        self.refused_full = 0  # new members not kept: members_max reached

    def __len__(self) -> int:
        return len(self._known)

    def offer(self, record: LoadRecord, now: float) -> Known | None:
        """A record received at ``now``: the new Known if it is newer than what we hold (a
        higher seq, or the same seq confirmed current at least ``CONFIRM_MIN_S`` later)."""
        held = self._known.get(record.node)
        sampled_at = now - record.age_ms / 1000.0
        if held is not None and (
            held.record.seq > record.seq
            or (held.record.seq == record.seq and sampled_at < held.sampled_at + CONFIRM_MIN_S)
        ):
            return None  # older, or the same sample confirmed no later (or a relayed copy)
        if held is None and len(self._known) >= self.members_max:
            self.refused_full += 1
            return None
        known = Known(record, sampled_at)
        self._known[record.node] = known
        return known

    def get(self, node: str) -> Known | None:
        return self._known.get(node)

    def age_s(self, node: str, now: float) -> float | None:
        known = self._known.get(node)
        return None if known is None else known.age_s(now)

    def forget(self, node: str) -> None:
        """The member is dead or left: its load means nothing now."""
        self._known.pop(node, None)


@dataclass(slots=True)
class _Rumor:
    record: LoadRecord
    sampled_at: float
    sends_left: int
    size_bytes: int


class LoadRumors:
    """The load records this member passes on: one per member (the newest), sent newest
    first, each at most ``transmits`` times, within ``bytes_max`` per message and never
    once older than ``age_max_s`` (an old sample is not worth the bytes).

    Kept in a list sorted newest first: a message looks at the few records it carries, not
    at every member's."""

    def __init__(self, *, transmits: int, age_max_s: float) -> None:
        if transmits < 1:
            raise ValueError(f"transmits must be >= 1, got {transmits}")
        self.transmits = transmits
        self.age_max_s = age_max_s
        self._rumors: dict[str, _Rumor] = {}
        self._order: list[tuple[float, str]] = []  # (-sampled_at, node), ascending

    def __len__(self) -> int:
        return len(self._rumors)

    def _remove(self, node: str) -> None:
        rumor = self._rumors.pop(node)
        key = (-rumor.sampled_at, node)
        i = bisect.bisect_left(self._order, key)
        del self._order[i]

    def add(self, record: LoadRecord, sampled_at: float) -> None:
        """A newer sample of ``record.node`` to pass on (replaces the older one)."""
        if record.node in self._rumors:
            self._remove(record.node)
        size = len(encode_update(record))  # type: ignore[arg-type]
        self._rumors[record.node] = _Rumor(record, sampled_at, self.transmits, size)
        bisect.insort(self._order, (-sampled_at, record.node))

    def take(self, now: float, bytes_max: int, exclude: str = "") -> list[LoadRecord]:
        """Records for one message at ``now``: newest first while they fit ``bytes_max``
        (and ``LOAD_RECORDS_MAX``); each counts one send; ``exclude`` (the receiver's own
        record) is not sent to it."""
        order = self._order
        horizon = now - self.age_max_s
        while order and -order[-1][0] < horizon:
            del self._rumors[order.pop()[1]]
        out: list[LoadRecord] = []
        used = 0
        spent: list[str] = []
        for _neg, node in order:
            if node == exclude:
                continue
            rumor = self._rumors[node]
            if used + rumor.size_bytes > bytes_max or len(out) >= LOAD_RECORDS_MAX:
                break
            used += rumor.size_bytes
            out.append(with_age(rumor.record, rumor.sampled_at, now))
            rumor.sends_left -= 1
            if rumor.sends_left <= 0:
                spent.append(node)
        for node in spent:
            self._remove(node)
        return out


class LoadSampler:
    """A member's own records: ``seq`` starts at ``seq_start`` (the shell passes the wall
    clock in ms, so a restarted process's records still order after its old ones)."""

    def __init__(self, node: str, seq_start: int) -> None:
        self.node = node
        self.seq = seq_start
        self._last: LoadRecord | None = None

    def sample(
        self, *, inflight: int, waiting: int = 0, queued_tokens: int = 0, kv_ratio: float = 0.0
    ) -> LoadRecord:
        self.seq += 1
        kv_pct = min(100, max(0, round(kv_ratio * 100)))
        # (cut to the record's bounds: one figure past them would make peers refuse every
        # message carrying it, gossip and ForwardReplies alike)
        return LoadRecord(self.node, self.seq, 0, min(inflight, LOAD_COUNT_MAX),
                          min(waiting, LOAD_COUNT_MAX), min(queued_tokens, QUEUED_TOKENS_MAX),
                          kv_pct)  # fmt: skip

    def current(
        self,
        now: float,
        *,
        inflight: int,
        waiting: int = 0,
        queued_tokens: int = 0,
        kv_ratio: float = 0.0,
    ) -> LoadRecord:
        """Our load as we answer at ``now``: a new seq only when a figure changed; the same
        record (age 0: confirmed current now) while none did."""
        kv_pct = min(100, max(0, round(kv_ratio * 100)))
        # Compared as the record carries them (cut to its bounds: sample's rule): a figure
        # past a bound would otherwise differ from its record's on every call.
        inflight = min(inflight, LOAD_COUNT_MAX)
        waiting = min(waiting, LOAD_COUNT_MAX)
        queued_tokens = min(queued_tokens, QUEUED_TOKENS_MAX)
        last = self._last
        if last is not None and (last.inflight, last.waiting, last.queued_tokens, last.kv_pct) == (
            inflight,
            waiting,
            queued_tokens,
            kv_pct,
        ):
            return last
        self._last = self.sample(
            inflight=inflight, waiting=waiting, queued_tokens=queued_tokens, kv_ratio=kv_ratio
        )
        return self._last
