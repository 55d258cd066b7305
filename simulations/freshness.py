"""How fresh is the load state placement decisions use (issue 17, part 2)?

`python -m simulations freshness --nodes 64,1000 --json`

A virtual-time driver of the load channel alone (no SWIM failure detection, no engines): N
members whose load changes every ``change_s`` (each at its own phase), each sampling it into
a ``LoadRecord`` when it changes (core/loadstate.py ``LoadSampler``); every
``gossip_interval_s`` each member sends ``fanout`` random peers one load message, a real
``GossipOnly`` carrying the newest records of its ``LoadRumors`` within ``bytes_max`` (its
bytes are what it costs: header included, counted as encoded); receivers keep the newest
per member (``LoadView``) and pass new ones on, each at most ``transmits`` times.

Entry points place tasks (Poisson, ``tasks_per_member_s`` each) on an owner drawn uniformly
(what rendezvous hashing gives for uniform keys; the entry point itself included, whose
state is its own).  Every decision is counted, by the oldest state it used:
- ``age``: the time since that state was sampled;
- ``staleness``: the time since it stopped being the owner's current load (0 while current);
- ``never``: no state of that owner at all (a miss: sorted last, as infinitely old).

With ``owner_check`` (the daemon's default, docs/PROTOCOL.md "Fresh where placement looks")
the entry point passes a member over as saturated only on a record at most ``trust_s`` old
(that record's age is the decision's); otherwise it forwards with ``if_free`` and the owner
reads its own current load as the Forward arrives: saturated, it refuses at once with its
record (the entry point tries the next member, one round trip later); else it accepts, and
the decision's state is the owner's current one, one one-way hop old (``latency_s``) by the
time the entry point hears of it.  When every member tried refused, the first is asked
plainly.  ``saturated_share`` of the members are saturated at each change of load.  Without
``owner_check`` (``--no-owner-check``) the decision uses the entry point's freshest record
of the owner alone (gossip or replies), as before.
With ``replies`` on, the owner's ForwardReply (one round trip later) and TaskDone (after
``service_s``) carry its latest record, as gossipd's owners do.

Each link's latency is ``latency_s`` (one way); loss ``loss``.  Deterministic for a seed.
A percentile is null when more decisions than its tail had no state at all (``never``).

The bound (why the view alone misses p99 <= 1 s at N=1,000 within 100 kbit/s): with
decisions spread over every member, each member must receive every other member's record
about once a second, N records a second of ~28 bytes (a 14-character node id, a 9-byte
seq): 1,000 x 28 B = 224 kbit/s with no redundancy at all, and push gossip sends each record
to a member several times.  Compact records (a 4-byte id hash, a 2-byte load, a 1-byte seq
delta: 10 B as a MessagePack array, measured) would bring that to 80 kbit/s at N=1,000 with
no redundancy at all, 800 kbit/s at N=10,000: no record format scales with N.  The owner check needs
no record of the owner at all: its cost is round trips, not bytes.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from dataclasses import dataclass

from gossipd.config import FanoutConfig
from gossipd.core.gossip_messages import GossipOnly, LoadRecord, encode_gossip, encode_update
from gossipd.core.loadstate import LoadRumors, LoadSampler, LoadView, with_age
from gossipd.core.placer import record_saturated

CHANGE, GOSSIP, RECEIVE, TASK, REPLY, CONFIRM, ANSWER, CHECK, REFUSED = range(9)
# Saturation as the daemon's placer judges a record, at the daemon's defaults
# (fanout.engine_waiting_saturated, engine_kv_cache_saturated_ratio).
FANOUT_DEFAULTS = FanoutConfig()


@dataclass
class FreshRun:
    nodes: int = 64
    seconds: float = 20.0  # simulated, after warm_s
    warm_s: float = 5.0
    seed: int = 1
    change_s: float = 1.0  # every member's load changes this often
    confirm_s: float = 0.0  # a member re-sends its unchanged record this long after (0: never)
    # The daemon's defaults (gossip.load_*): at most (500 + ~90) B x 20 = 94 kbit/s a member.
    gossip_interval_s: float = 0.05
    fanout: int = 1
    bytes_max: int = 500  # load records per message
    transmits: int = 5  # times a member passes on one record
    age_max_s: float = 3.0  # records older than this are not passed on
    tasks_per_member_s: float = 20.0
    service_s: float = 0.5
    latency_s: float = 0.0003
    loss: float = 0.0
    replies: bool = True
    gossip: bool = True
    decisions_max: int = 400_000  # decisions recorded (then sampled)
    # The owner's check (docs/PROTOCOL.md "Fresh where placement looks"): the entry point
    # passes over a member as saturated only on a record at most trust_s old; otherwise it
    # forwards with if_free and the owner refuses at once (code "saturated", with its record)
    # when its own current load is saturated; the entry point then tries the next member.
    owner_check: bool = True
    trust_s: float = 0.5
    attempts_max: int = 4
    saturated_share: float = 0.05  # of members saturated at any time (KV cache >= 95%)


def _pct(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Member:
    __slots__ = ("addr", "name", "rumors", "sampler", "view")

    def __init__(self, i: int, run: FreshRun) -> None:
        self.name = f"gpu-node-{i:05d}"
        self.addr = f"tcp://10.0.{i // 250}.{i % 250}:7946"
        self.sampler = LoadSampler(self.name, 1_764_500_000_000 + i)
        self.view = LoadView()
        self.rumors = LoadRumors(transmits=run.transmits, age_max_s=run.age_max_s)


class _Decision:
    """One task's placement under the owner check: its attempts and the state it used."""

    __slots__ = (
        "age_s",
        "attempts",
        "checked",
        "entry",
        "first_refuser",
        "forced",
        "record",
        "ring_owner",
        "round_trips",
        "skipped",
        "stale_s",
        "started_at",
        "tried",
    )

    def __init__(self, entry: int, ring_owner: int, at: float, record: bool) -> None:
        self.entry = entry
        self.ring_owner = ring_owner
        self.started_at = at
        self.record = record
        self.age_s = 0.0  # the oldest state the decision used
        self.stale_s = 0.0
        self.attempts = 0
        self.tried: set[int] = set()
        self.round_trips = 0
        self.first_refuser = -1
        self.skipped = 0
        self.checked = False
        self.forced = False


def run_freshness(run: FreshRun) -> dict[str, object]:
    rng = random.Random(run.seed)
    members = [_Member(i, run) for i in range(run.nodes)]
    n = len(members)
    # The truth: each member's sample times, by seq (to tell when a sample was superseded).
    first_seq = [m.sampler.seq + 1 for m in members]
    sampled: list[list[float]] = [[] for _ in members]
    current: list[LoadRecord | None] = [None] * n
    heap: list[tuple[float, int, int, int, object]] = []
    tie = 0

    def push(at: float, kind: int, node: int, payload: object = None) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(heap, (at, tie, kind, node, payload))

    for i in range(n):
        push(rng.uniform(0, run.change_s), CHANGE, i)
        if run.gossip:
            push(rng.uniform(0, run.gossip_interval_s), GOSSIP, i)
        if run.tasks_per_member_s > 0:
            push(rng.expovariate(run.tasks_per_member_s), TASK, i)
    end = run.warm_s + run.seconds
    gossip_bytes = 0
    gossip_messages = 0
    reply_load_bytes = 0
    ages: list[float] = []
    stales: list[float] = []
    never = 0
    decisions = 0
    rtts: list[int] = []  # the owner check: refusals each decision met
    waits: list[float] = []  # task to acceptance (the refusals' round trips included)
    checked = skipped_decisions = forced_decisions = check_refusals = 0
    record_every = max(1, int(n * run.tasks_per_member_s * run.seconds / run.decisions_max))
    started = time.perf_counter()

    def deliver(dst: int, records: list[LoadRecord], at: float) -> None:
        view, rumors = members[dst].view, members[dst].rumors
        for rec in records:
            known = view.offer(rec, at)
            if known is not None and rec.node != members[dst].name:
                rumors.add(rec, known.sampled_at)

    def staleness(owner: int, seq: int, now: float) -> float:
        times = sampled[owner]
        nxt = seq - first_seq[owner] + 1
        if nxt < len(times) and times[nxt] <= now:
            return now - times[nxt]
        return 0.0

    def is_saturated(rec: LoadRecord) -> bool:
        return record_saturated(rec, FANOUT_DEFAULTS)

    def finish(d: _Decision, done_at: float) -> None:
        nonlocal checked, skipped_decisions, forced_decisions
        if not d.record:
            return
        ages.append(d.age_s)
        stales.append(d.stale_s)
        rtts.append(d.round_trips)
        waits.append(done_at - d.started_at)
        checked += d.checked
        skipped_decisions += d.skipped > 0
        forced_decisions += d.forced

    def place(d: _Decision, at: float) -> None:
        """The entry point's next attempt for ``d`` (core/forwarder.py with the placer)."""
        m = members[d.entry]
        while True:
            if d.attempts >= run.attempts_max or len(d.tried) >= n:
                # Every member tried refused as saturated: the first is asked again plainly.
                owner = d.first_refuser if d.first_refuser >= 0 else d.ring_owner
                d.forced = True
                if owner == d.entry:  # our own load, read as we decide
                    finish(d, at)
                    return
                known = m.view.get(members[owner].name)
                if known is not None:
                    d.age_s = max(d.age_s, known.age_s(at))
                    d.stale_s = max(d.stale_s, staleness(owner, known.record.seq, at))
                d.forced = True
                push(at + run.latency_s, CHECK, owner, d)
                return
            if d.attempts == 0:
                owner = d.ring_owner
            else:  # the next member in the key's order: any untried one
                owner = rng.randrange(n)
                while owner in d.tried:
                    owner = rng.randrange(n)
            d.tried.add(owner)
            d.attempts += 1
            if owner == d.entry:
                own = current[owner]
                if own is not None and is_saturated(own) and d.attempts < run.attempts_max:
                    d.skipped += 1
                    continue  # its own load, read as it decides (age 0)
                finish(d, at)
                return
            known = m.view.get(members[owner].name)
            if known is not None and known.age_s(at) <= run.trust_s and is_saturated(known.record):
                d.age_s = max(d.age_s, known.age_s(at))  # passed over on a fresh record
                d.stale_s = max(d.stale_s, staleness(owner, known.record.seq, at))
                d.skipped += 1
                continue
            d.checked = True
            push(at + run.latency_s, CHECK, owner, d)
            return

    while heap:
        at, _, kind, i, payload = heapq.heappop(heap)
        if at > end:
            break
        m = members[i]
        measuring = at >= run.warm_s
        if kind == CHANGE:
            hot = rng.random() < run.saturated_share
            kv_ratio = 0.95 + 0.05 * rng.random() if hot else 0.94 * rng.random()
            rec = m.sampler.sample(
                inflight=rng.randrange(64), waiting=rng.randrange(8), kv_ratio=kv_ratio
            )
            sampled[i].append(at)
            current[i] = rec
            m.view.offer(rec, at)
            m.rumors.add(rec, at)
            push(at + run.change_s, CHANGE, i)
            if 0 < run.confirm_s < run.change_s:
                push(at + run.confirm_s, CONFIRM, i, rec.seq)
        elif kind == CONFIRM:
            rec = current[i]
            if rec is not None and rec.seq == payload:  # unchanged: confirmed as of now
                m.view.offer(rec, at)
                m.rumors.add(rec, at)
                if at + run.confirm_s < sampled[i][-1] + run.change_s:
                    push(at + run.confirm_s, CONFIRM, i, rec.seq)
        elif kind == GOSSIP:
            push(at + run.gossip_interval_s, GOSSIP, i)
            for _ in range(run.fanout):
                peer = rng.randrange(n - 1)
                peer += peer >= i
                records = m.rumors.take(at, run.bytes_max, exclude=members[peer].name)
                if not records:
                    continue
                msg = GossipOnly(
                    cluster="gossipd", src=m.name, src_addr=m.addr, updates=[], loads=records
                )
                if measuring:
                    gossip_bytes += len(encode_gossip(msg))
                    gossip_messages += 1
                if rng.random() >= run.loss:
                    push(at + run.latency_s, RECEIVE, peer, records)
        elif kind == RECEIVE:
            assert isinstance(payload, list)
            deliver(i, payload, at)
        elif kind == REPLY:
            assert isinstance(payload, LoadRecord)
            deliver(i, [payload], at)
        elif kind == TASK:
            push(at + rng.expovariate(run.tasks_per_member_s), TASK, i)
            owner = rng.randrange(n)
            record = False
            if measuring:
                decisions += 1
                record = decisions % record_every == 0
            if run.owner_check:
                place(_Decision(i, owner, at, record), at)
                continue
            if record:
                if owner == i:
                    ages.append(0.0)  # its own load, read as it decides
                    stales.append(0.0)
                else:
                    known = m.view.get(members[owner].name)
                    if known is None:
                        never += 1
                    else:
                        ages.append(known.age_s(at))
                        stales.append(staleness(owner, known.record.seq, at))
            if owner != i and run.replies:  # its ForwardReply, then its TaskDone
                push(at + run.latency_s, ANSWER, owner, i)
                push(at + run.latency_s + run.service_s, ANSWER, owner, i)
        elif kind == CHECK:
            # A Forward with if_free reaches owner i: it reads its own load as it admits.
            assert isinstance(payload, _Decision)
            d = payload
            rec = current[i]
            if rec is None:  # no sample yet (the warm-up's first instants): admitted
                d.age_s = max(d.age_s, run.latency_s)
                finish(d, at + run.latency_s)
                continue
            out = with_age(rec, 0.0, 0.0)
            if measuring and run.replies:
                reply_load_bytes += len(encode_update(out))  # type: ignore[arg-type]
            if not d.forced and is_saturated(rec):
                if measuring:
                    check_refusals += 1
                push(at + run.latency_s, REFUSED, d.entry, (d, i, out))
                continue
            # Accepted: the decision used the owner's current state, one one-way hop old
            # by the time the entry point hears of it (staleness 0: current as it decided).
            d.age_s = max(d.age_s, run.latency_s)
            finish(d, at + run.latency_s)
            if run.replies:
                push(at + run.latency_s, REPLY, d.entry, out)  # its ForwardReply
                push(at + run.service_s, ANSWER, i, d.entry)  # its TaskDone, later
        elif kind == REFUSED:
            d, refuser, out = payload  # type: ignore[misc]
            deliver(i, [out], at)
            d.round_trips += 1
            if d.first_refuser < 0:
                d.first_refuser = refuser
            place(d, at)
        elif kind == ANSWER:
            # The owner answers entry point ``payload`` with its load as of now (age 0).
            rec = current[i]
            if rec is not None:
                out = with_age(rec, 0.0, 0.0)
                if measuring:
                    reply_load_bytes += len(encode_update(out))  # type: ignore[arg-type]
                assert isinstance(payload, int)
                push(at + run.latency_s, REPLY, payload, out)
    wall_s = time.perf_counter() - started
    # ``never`` counts as a miss: an infinitely old state, sorted last.
    ages = sorted(ages) + [math.inf] * never
    stales = sorted(stales) + [math.inf] * never
    recorded = len(ages)
    per_member_s = n * run.seconds
    rtts.sort()
    waits.sort()

    def pct(ordered: list[float], q: float) -> float | None:
        value = _pct(ordered, q)
        return None if math.isinf(value) else round(value, 4)

    return {
        "nodes": n,
        "simulated_s": run.seconds,
        "wall_s": round(wall_s, 1),
        "decisions": decisions,
        "decisions_recorded": recorded,
        "never_share": round(never / recorded, 5) if recorded else 0.0,
        "age_p50_s": pct(ages, 0.50),
        "age_p90_s": pct(ages, 0.90),
        "age_p99_s": pct(ages, 0.99),
        "age_max_s": pct(ages, 1.0),
        "staleness_p50_s": pct(stales, 0.50),
        "staleness_p99_s": pct(stales, 0.99),
        "age_over_1s_share": round(sum(1 for a in ages if a > 1.0) / recorded, 4)
        if recorded
        else 0.0,
        # The owner check's cost: refusals met per decision, decisions whose owner checked,
        # passed over a member on a fresh record, or ended with a plain re-ask (all saturated).
        "owner_checked_share": round(checked / recorded, 4) if recorded else 0.0,
        "skipped_share": round(skipped_decisions / recorded, 4) if recorded else 0.0,
        "forced_share": round(forced_decisions / recorded, 5) if recorded else 0.0,
        "refusals_per_decision": round(sum(rtts) / len(rtts), 4) if rtts else 0.0,
        "refusals_p99": _pct([float(r) for r in rtts], 0.99) if rtts else 0.0,
        "placement_wait_p99_ms": round(_pct(waits, 0.99) * 1000, 3) if waits else 0.0,
        "check_refusals_per_member_s": round(check_refusals / per_member_s, 3),
        "gossip_kbit_s_per_member": round(gossip_bytes * 8 / 1000 / per_member_s, 1),
        "gossip_messages_per_member_s": round(gossip_messages / per_member_s, 2),
        "reply_load_kbit_s_per_member": round(reply_load_bytes * 8 / 1000 / per_member_s, 1),
        "settings": {k: v for k, v in vars(run).items() if k not in ("nodes", "seconds", "seed")},
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations freshness", description=__doc__)
    p.add_argument("--nodes", default="64,1000", help="comma-separated cluster sizes")
    p.add_argument("--seconds", type=float, default=FreshRun.seconds)
    p.add_argument("--warm-s", type=float, default=FreshRun.warm_s)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gossip-interval-s", type=float, default=FreshRun.gossip_interval_s)
    p.add_argument("--fanout", type=int, default=FreshRun.fanout)
    p.add_argument("--bytes-max", type=int, default=FreshRun.bytes_max)
    p.add_argument("--transmits", type=int, default=FreshRun.transmits)
    p.add_argument("--tasks-per-member-s", type=float, default=FreshRun.tasks_per_member_s)
    p.add_argument("--service-s", type=float, default=FreshRun.service_s)
    p.add_argument("--confirm-s", type=float, default=FreshRun.confirm_s)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--no-replies", action="store_true", help="no load on owners' replies")
    p.add_argument("--no-gossip", action="store_true", help="no load gossip")
    p.add_argument(
        "--no-owner-check",
        action="store_true",
        help="placement on the entry point's view alone (the state before the owner check)",
    )
    p.add_argument("--trust-s", type=float, default=FreshRun.trust_s)
    p.add_argument("--saturated-share", type=float, default=FreshRun.saturated_share)
    p.add_argument("--latency-s", type=float, default=FreshRun.latency_s)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    reports = []
    for n in (int(x) for x in args.nodes.split(",") if x):
        run = FreshRun(
            nodes=n,
            seconds=args.seconds,
            warm_s=args.warm_s,
            seed=args.seed,
            gossip_interval_s=args.gossip_interval_s,
            fanout=args.fanout,
            bytes_max=args.bytes_max,
            transmits=args.transmits,
            tasks_per_member_s=args.tasks_per_member_s,
            service_s=args.service_s,
            confirm_s=args.confirm_s,
            loss=args.loss,
            replies=not args.no_replies,
            gossip=not args.no_gossip,
            owner_check=not args.no_owner_check,
            trust_s=args.trust_s,
            saturated_share=args.saturated_share,
            latency_s=args.latency_s,
        )
        report = run_freshness(run)
        reports.append(report)
        if not args.json:
            print(
                f"N={n}: age p50 {report['age_p50_s']} s p99 {report['age_p99_s']} s, "
                f"staleness p50 {report['staleness_p50_s']} p99 {report['staleness_p99_s']} s, "
                f"never {report['never_share']}, gossip "
                f"{report['gossip_kbit_s_per_member']} kbit/s/member "
                f"(+{report['reply_load_kbit_s_per_member']} on replies), "
                f"owner checked {report['owner_checked_share']}, refusals/decision "
                f"{report['refusals_per_decision']}, wall {report['wall_s']} s",
                flush=True,
            )
    if args.json:
        print(json.dumps({"runs": reports}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
