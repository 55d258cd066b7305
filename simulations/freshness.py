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
state is its own).  Each decision records the state it used, the freshest the entry point
has of that owner (gossip or the owner's replies):
- ``age``: the time since the owner sampled it;
- ``staleness``: the time since it stopped being the owner's current load (0 while current);
- ``never``: no state of that owner at all.
With ``replies`` on, the owner's ForwardReply (one round trip later) and TaskDone (after
``service_s``) carry its latest record, as gossipd's owners do.

Each link's latency is ``latency_s`` (one way); loss ``loss``.  Deterministic for a seed.
A percentile is null when more decisions than its tail had no state at all (``never``).

The bound (why N=1,000 misses p99 <= 1 s at 100 kbit/s): with decisions spread over every
member, each member must receive every other member's record about once a second, N records
a second of ~28 bytes (a 14-character node id, a 9-byte seq): 1,000 x 28 B = 224 kbit/s
with no redundancy at all, and push gossip sends each record to a member several times.  The
byte budget caps load gossip whatever N is ((load_bytes_max + ~90) x messages a second), so
past ~100 members it covers a shrinking share of the (observer, subject) pairs; the owners'
replies keep fresh only the members an entry point sent to lately.
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

from gossipd.core.loadstate import LoadRumors, LoadSampler, LoadView, with_age
from gossipd.core.messages import GossipOnly, LoadRecord, encode_gossip, encode_update

CHANGE, GOSSIP, RECEIVE, TASK, REPLY, CONFIRM, ANSWER = range(7)


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
    by_source = {"self": 0, "known": 0}
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

    while heap:
        at, _, kind, i, payload = heapq.heappop(heap)
        if at > end:
            break
        m = members[i]
        measuring = at >= run.warm_s
        if kind == CHANGE:
            rec = m.sampler.sample(
                inflight=rng.randrange(64), waiting=rng.randrange(8), kv_ratio=rng.random()
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
            if measuring:
                decisions += 1
                if decisions % record_every == 0:
                    if owner == i:
                        by_source["self"] += 1
                        ages.append(0.0)  # its own load, read as it decides
                        stales.append(0.0)
                    else:
                        known = m.view.get(members[owner].name)
                        if known is None:
                            never += 1
                        else:
                            by_source["known"] += 1
                            ages.append(known.age_s(at))
                            stales.append(staleness(owner, known.record.seq, at))
            if owner != i and run.replies:  # its ForwardReply, then its TaskDone
                push(at + run.latency_s, ANSWER, owner, i)
                push(at + run.latency_s + run.service_s, ANSWER, owner, i)
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
    ages.sort()
    stales.sort()
    recorded = len(ages) + never
    per_member_s = n * run.seconds
    return {
        "nodes": n,
        "simulated_s": run.seconds,
        "wall_s": round(wall_s, 1),
        "decisions": decisions,
        "decisions_recorded": recorded,
        "never_share": round(never / recorded, 5) if recorded else 0.0,
        "age_p50_s": round(_pct(ages, 0.50), 3),
        "age_p90_s": round(_pct(ages, 0.90), 3) if never / max(1, recorded) < 0.1 else None,
        "age_p99_s": round(_pct(ages, 0.99), 3) if not never or never / recorded < 0.01 else None,
        "staleness_p50_s": round(_pct(stales, 0.50), 3),
        "staleness_p99_s": (
            round(_pct(stales, 0.99), 3) if not never or never / recorded < 0.01 else None
        ),
        "age_over_1s_share": round((sum(1 for a in ages if a > 1.0) + never) / recorded, 4)
        if recorded
        else 0.0,
        "gossip_kbit_s_per_member": round(gossip_bytes * 8 / 1000 / per_member_s, 1),
        "gossip_messages_per_member_s": round(gossip_messages / per_member_s, 2),
        "reply_load_kbit_s_per_member": round(reply_load_bytes * 8 / 1000 / per_member_s, 1),
        "self_share": round(by_source["self"] / recorded, 4) if recorded else 0.0,
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
                f"wall {report['wall_s']} s",
                flush=True,
            )
    if args.json:
        print(json.dumps({"runs": reports}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
