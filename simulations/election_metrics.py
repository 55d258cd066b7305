"""What the election simulator measures, computed from the daemons' JSON logs alone.

Pure functions over parsed log lines (no processes, no clocks), so the judgement that decides
whether a run was safe is unit-tested on synthetic logs (tests/test_election_sim.py).

Inputs: one ``Incarnation`` per daemon process (a restarted daemon is a new incarnation: a new
process remembers nothing of the old one's terms), holding that process's JSON log lines and the
wall time the harness saw it die (SIGKILL, or exit after SIGTERM).  The events read (see
docs/PROTOCOL.md and the leadership contract) are ``leader_elected`` {token, node, t_wall},
``leader_stepped_down`` {token, node, reason, t_wall} and ``term_observed`` {token, leader,
node, t_wall}, named by the line's ``msg`` (or ``event``) field.  All daemons run on one host,
so their wall clocks compare.

Rules:
- A leadership interval opens at ``leader_elected`` and closes at the same process's next
  ``leader_stepped_down``, or at its death, or at the end of the run.  A step-down closes it at
  its ``lease_until_wall`` when that is earlier than its ``t_wall`` (a daemon paused past its
  lease logs the step-down late; it no longer acts as leader from that moment:
  ``is_leader`` is false once its lease is not believed valid); ``lease_until=False`` reads
  ``t_wall`` alone.  A second
  ``leader_elected`` with the same token while open continues the interval (etcd keeps leases
  across its own restart: the same leader may re-confirm its term); with another token it
  closes the open interval and opens a new one.
- ``overlapping_terms``: pairs of intervals of different nodes that overlap in time at all.
- ``token_regressions``: a process observing (term_observed or leader_elected) a token lower
  than one it observed before; and a token claimed for two different leaders anywhere.
- failover: from a fault's wall time to the first ``leader_elected`` anywhere after it.
- new terms: elections with a token not elected before (the others resume a term).
- unprovoked elections: ``leader_elected`` events inside quiet windows (no fault in progress):
  needless failovers, what too short a TTL costs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gossipd.tools.launcher import json_lines

ELECTED = "leader_elected"
STEPPED_DOWN = "leader_stepped_down"
OBSERVED = "term_observed"
EVENTS = frozenset({ELECTED, STEPPED_DOWN, OBSERVED})


@dataclass
class Incarnation:
    """One daemon process: its node id, its log lines, when it died (None: alive at the end)."""

    node: str
    events: list[dict[str, Any]] = field(default_factory=list)
    died_at: float | None = None


@dataclass(frozen=True)
class Interval:
    node: str
    token: int
    start: float
    end: float


def event_name(entry: dict[str, Any]) -> str:
    """The leadership event a log line records, or "" for any other line."""
    for key in ("event", "msg"):
        value = entry.get(key)
        if value in EVENTS:
            return str(value)
    return ""


def event_time(entry: dict[str, Any]) -> float:
    return float(entry.get("t_wall", entry.get("ts", 0.0)))


parse_log = json_lines  # the launcher's reader of a daemon's JSON log lines


def leadership_intervals(
    incarnations: Iterable[Incarnation], end_wall: float, *, lease_until: bool = True
) -> list[Interval]:
    out: list[Interval] = []
    for inc in incarnations:
        stop = end_wall if inc.died_at is None else inc.died_at
        open_token: int | None = None
        open_start = 0.0
        for entry in inc.events:
            name = event_name(entry)
            t = event_time(entry)
            if name == ELECTED:
                token = int(entry["token"])
                if open_token is not None and token == open_token:
                    continue
                if open_token is not None:
                    out.append(Interval(inc.node, open_token, open_start, t))
                open_token, open_start = token, t
            elif name == STEPPED_DOWN and open_token is not None:
                if lease_until and "lease_until_wall" in entry:
                    t = max(open_start, min(t, float(entry["lease_until_wall"])))
                out.append(Interval(inc.node, open_token, open_start, t))
                open_token = None
        if open_token is not None:
            out.append(Interval(inc.node, open_token, open_start, max(open_start, stop)))
    return sorted(out, key=lambda i: (i.start, i.node))


def overlaps(a: Interval, b: Interval) -> bool:
    """Whether two terms share any time: one ending as the other starts does not; a term of
    no length (elected and stepped down at once) strictly inside another does."""
    lo, hi = max(a.start, b.start), min(a.end, b.end)
    return lo < hi or (lo == hi and (a.start < lo < a.end or b.start < lo < b.end))


def overlapping_terms(intervals: Sequence[Interval]) -> list[tuple[Interval, Interval]]:
    """Pairs of intervals of different nodes that overlap (``overlaps``)."""
    pairs = []
    ordered = sorted(intervals, key=lambda i: (i.start, i.end))
    for k, a in enumerate(ordered):
        for b in ordered[k + 1 :]:
            if b.start > a.end:
                break
            if b.node != a.node and overlaps(a, b):
                pairs.append((a, b))
    return pairs


def token_regressions(incarnations: Iterable[Incarnation]) -> list[str]:
    """Descriptions of every regression (empty: none)."""
    problems: list[str] = []
    leaders: dict[int, str] = {}
    for inc in incarnations:
        highest = 0
        for entry in inc.events:
            name = event_name(entry)
            if name not in (ELECTED, OBSERVED):
                continue
            token = int(entry["token"])
            leader = str(entry.get("leader", inc.node) if name == OBSERVED else inc.node)
            if token < highest:
                problems.append(
                    f"{inc.node} observed token {token} after {highest} at {event_time(entry):.3f}"
                )
            highest = max(highest, token)
            other = leaders.setdefault(token, leader)
            if other != leader:
                problems.append(f"token {token} claimed for two leaders: {other} and {leader}")
    return problems


def elections(incarnations: Iterable[Incarnation]) -> list[tuple[float, str, int]]:
    """(t_wall, node, token) of every leader_elected, in time order."""
    out = [
        (event_time(e), inc.node, int(e["token"]))
        for inc in incarnations
        for e in inc.events
        if event_name(e) == ELECTED
    ]
    return sorted(out)


def failover_s(fault_wall: float, elected: Sequence[tuple[float, str, int]]) -> float | None:
    """Seconds from a fault to the first election after it; None if there was none."""
    for t, _node, _token in elected:
        if t >= fault_wall:
            return t - fault_wall
    return None


def new_terms(elected: Sequence[tuple[float, str, int]]) -> list[tuple[float, str, int]]:
    """Elections with a token never elected before: a leader change.  The others are a leader
    resuming its own term (etcd kept its lease: it had stepped down only because it could not
    renew it in time)."""
    seen: set[int] = set()
    out = []
    for e in sorted(elected):
        if e[2] not in seen:
            out.append(e)
        seen.add(e[2])
    return out


def unprovoked_elections(
    elected: Sequence[tuple[float, str, int]], quiet: Sequence[tuple[float, float]]
) -> list[tuple[float, str, int]]:
    """Elections inside quiet windows [start, end): nothing was done to the cluster then."""
    return [e for e in elected if any(a <= e[0] < b for a, b in quiet)]
