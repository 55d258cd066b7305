"""SWIM measurements in virtual time: dissemination, detection, false positives, cost,
partition healing.  Every figure comes from member events seen by the simulated members.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from gossipd.core.swim_config import SwimConfig
from gossipd.tools.progress import summarize
from simulations.netsim import NetworkModel, Simulation


@dataclass
class SwimRun:
    nodes: int
    loss: float
    seed: int
    warmup_s: float = 5.0
    dissemination_trials: int = 10
    crash_trials: int = 10
    trial_gap_s: float = 3.0
    detect_window_s: float = 10.0
    quiet_s: float = 30.0
    stallers: int = 0
    stall_s: float = 2.0
    stall_every_s: float = 10.0
    partition_s: float = 0.0
    extra_s: float = 0.0
    config: SwimConfig = field(default_factory=SwimConfig.sim)
    progress: bool = True


def _say(run: SwimRun, text: str) -> None:
    if run.progress:
        print(text, file=sys.stderr, flush=True)


def run_swim(run: SwimRun) -> dict[str, Any]:
    wall0 = time.monotonic()
    sim = Simulation(
        run.nodes, seed=run.seed, config=run.config, network=NetworkModel(loss=run.loss)
    )
    rng = sim.rng
    crashed: set[str] = set()
    crashed_at: dict[str, float] = {}
    stalling: dict[str, float] = {}
    report: dict[str, Any] = {"nodes": run.nodes, "loss": run.loss, "seed": run.seed}

    # Stalling members pause stall_s out of every stall_every_s, at random phases, all run long.
    stall_idx = rng.sample(range(run.nodes), run.stallers) if run.stallers else []
    for i in stall_idx:
        stalling[sim.members[i].name] = rng.random() * run.stall_every_s

    def advance(to: float) -> None:
        while sim.now < to:
            step = min(to, sim.now + 0.5)
            for i in stall_idx:
                m = sim.members[i]
                phase = stalling[m.name]
                # Pause at each phase + k * every that falls in (now, step].
                k = math.floor((step - phase) / run.stall_every_s)
                start = phase + k * run.stall_every_s
                if sim.now < start <= step and m.up:
                    sim.run_until(start)
                    sim.pause(i, run.stall_s)
            sim.run_until(step)

    # Warm-up, then a quiet window for steady-state cost.
    advance(run.warmup_s)
    m0, b0 = sim.cost()
    advance(run.warmup_s + run.quiet_s)
    m1, b1 = sim.cost()
    live = len(sim.live())
    report["cost_steady"] = {
        "messages_per_member_s": round((m1 - m0) / run.quiet_s / live, 3),
        "kbit_per_member_s": round((b1 - b0) * 8 / 1000 / run.quiet_s / live, 3),
        "bytes_per_message": round((b1 - b0) / max(1, m1 - m0), 1),
    }
    _say(run, f"steady cost: {report['cost_steady']}")

    # Dissemination: a member re-announces itself (new incarnation); who learns it, when.
    curves: list[list[float]] = []
    t100: list[float] = []
    learn: list[float] = []
    incomplete = 0
    for trial in range(run.dissemination_trials):
        candidates = [m for m in sim.live() if m.name not in stalling]
        origin = rng.choice(candidates)
        origin.core.announce(sim.now)
        sim._schedule(origin)
        inc = origin.core.table.incarnation
        start = sim.now
        mark = len(sim.trace.events)
        advance(start + run.trial_gap_s)
        seen: dict[str, float] = {}
        for observer, event in sim.trace.events[mark:]:
            if (
                event.node == origin.name
                and event.kind in ("alive", "joined")
                and event.incarnation >= inc
            ):
                seen.setdefault(observer, event.at - start)
        receivers = [m.name for m in sim.live() if m.name != origin.name]
        times = sorted(seen[r] for r in receivers if r in seen)
        learn.extend(times)
        curves.append(times)
        if len(times) == len(receivers):
            t100.append(times[-1])
        else:
            incomplete += 1
        _say(
            run,
            f"dissemination {trial + 1}/{run.dissemination_trials}: "
            f"{len(times)}/{len(receivers)} in {times[-1] if times else float('nan'):.3f} s",
        )
    report["dissemination"] = {
        "time_to_100pct_s": summarize(t100),
        "member_learn_s": summarize(learn),
        "trials_incomplete": incomplete,
        "receivers": run.nodes - 1,
    }

    # Detection: crash one member at a time; first declaration and everyone knowing.
    first: list[float] = []
    everyone: list[float] = []
    first_suspect: list[float] = []
    missed = 0
    for trial in range(run.crash_trials):
        candidates = [m for m in sim.live() if m.name not in stalling]
        victim = rng.choice(candidates)
        sim.crash(victim.index)
        crashed.add(victim.name)
        crashed_at[victim.name] = sim.now
        start = sim.now
        mark = len(sim.trace.events)
        advance(start + run.detect_window_s)
        dead_at: dict[str, float] = {}
        suspect_at: list[float] = []
        for observer, event in sim.trace.events[mark:]:
            if event.node == victim.name and event.kind == "dead":
                dead_at.setdefault(observer, event.at - start)
            if event.node == victim.name and event.kind == "suspect":
                suspect_at.append(event.at - start)
        observers = [m.name for m in sim.live()]
        if dead_at:
            first.append(min(dead_at.values()))
        if suspect_at:
            first_suspect.append(min(suspect_at))
        if all(o in dead_at for o in observers):
            everyone.append(max(dead_at[o] for o in observers))
        else:
            missed += 1
        _say(
            run,
            f"crash {trial + 1}/{run.crash_trials}: first dead "
            f"{min(dead_at.values()) if dead_at else float('nan'):.3f} s, "
            f"{len(dead_at)}/{len(observers)} know",
        )
    report["detection"] = {
        "first_suspect_s": summarize(first_suspect),
        "first_declared_s": summarize(first),
        "all_members_know_s": summarize(everyone),
        "trials_not_all_know": missed,
    }

    # Partition: two halves cannot talk; after healing, how long until every view agrees.
    if run.partition_s > 0:
        live_idx = [m.index for m in sim.live()]
        rng.shuffle(live_idx)
        half = len(live_idx) // 2
        sim.partition([live_idx[:half], live_idx[half:]])
        partition_window = (sim.now, sim.now + run.partition_s)
        advance(sim.now + run.partition_s)
        sim.heal()
        healed_at = sim.now
        agreed = None
        while sim.now < healed_at + 60:
            advance(sim.now + 0.1)
            live_now = sim.live()
            if len(sim.checksums()) == 1 and all(
                m.core.table.live_count() == len(live_now) for m in live_now
            ):
                agreed = sim.now - healed_at
                break
        report["partition"] = {
            "length_s": run.partition_s,
            "agree_after_heal_s": None if agreed is None else round(agreed, 3),
        }
        _say(run, f"partition of {run.partition_s} s healed; views agree after {agreed} s")

    if run.extra_s:
        advance(sim.now + run.extra_s)

    # False positives: a member declared dead while it was up (crashed ones excluded, and
    # during a partition each side rightly declares the other side dead: counted apart).
    window = locals().get("partition_window")
    in_partition = [
        (o, e)
        for o, e in sim.trace.events
        if e.kind == "dead" and window and window[0] <= e.at <= window[1]
    ]
    false_dead = [
        (o, e)
        for o, e in sim.trace.events
        if e.kind == "dead"
        and e.node not in crashed
        and not (window and window[0] <= e.at <= window[1])
    ]
    suspected = [
        (o, e) for o, e in sim.trace.events if e.kind == "suspect" and e.node not in crashed
    ]
    # Per member per minute: suspicion events (an observer learning that a healthy member is
    # suspect) and accusations (distinct suspicions raised of healthy members).
    member_min = sum(crashed_at.get(m.name, sim.now) for m in sim.members) / 60.0  # while up
    accusations = {(e.node, e.incarnation) for _, e in suspected}
    report["false_positives"] = {
        "declared_dead_events": len(false_dead),
        "members_declared_dead": len({e.node for _, e in false_dead}),
        "suspicions_of_healthy_members": len(suspected),
        "suspicion_events_per_member_min": round(len(suspected) / member_min, 4),
        "accusations_per_member_min": round(len(accusations) / member_min, 4),
        "refutations": sum(m.core.stats.refutations for m in sim.members),
        "dead_declarations_across_partition": len(in_partition),
    }
    _total_msgs, _total_bytes = sim.cost()
    report["simulated_s"] = round(sim.now, 1)
    report["wall_s"] = round(time.monotonic() - wall0, 2)
    report["messages_delivered"] = sim.trace.delivered
    report["messages_lost"] = sim.trace.lost
    report["_curves"] = curves
    report["_detections"] = first
    report["swim_paper"] = paper_comparison(run, report)
    return report


def paper_comparison(run: SwimRun, report: dict[str, Any]) -> dict[str, Any]:
    """SWIM's analysis: with random probing, expected time to first detection is
    T' / (1 - e^-1) for protocol period T' (the first *failed probe*), and the load is about
    two protocol messages per member per period."""
    period = run.config.probe_interval_s
    expected_first_probe = period / (1 - math.exp(-1))
    fs = report["detection"]["first_suspect_s"]["p50"]
    measured_probe = None if fs is None else round(fs - run.config.probe_deadline_s, 3)
    return {
        "expected_first_probe_s_random_probing": round(expected_first_probe, 3),
        "measured_first_failed_probe_s_p50": measured_probe,
        "expected_messages_per_member_period": 2.0,
        "measured_messages_per_member_period": round(
            report["cost_steady"]["messages_per_member_s"] * period, 3
        ),
    }


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    receivers = report["dissemination"]["receivers"]
    for times in report["_curves"]:
        if times:
            a.step(
                [0, *times],
                [0, *[(i + 1) / receivers for i in range(len(times))]],
                where="post",
                alpha=0.6,
            )
    a.set_xlabel("seconds since the update")
    a.set_ylabel("fraction of members informed")
    a.set_title(f"dissemination, N={report['nodes']}, loss={report['loss']:.0%}")
    a.grid(alpha=0.3)
    det = report["_detections"]
    if det:
        b.hist(det, bins=max(5, min(30, len(det))), color="tab:red", alpha=0.8)
    b.set_xlabel("seconds from crash to first 'dead' declaration")
    b.set_ylabel("crashes")
    b.set_title("detection time")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary_lines(report: dict[str, Any]) -> list[str]:
    d, det, fp, cost = (
        report["dissemination"],
        report["detection"],
        report["false_positives"],
        report["cost_steady"],
    )
    lines = [
        f"N={report['nodes']} loss={report['loss']:.0%} seed={report['seed']}: "
        f"{report['simulated_s']} s simulated in {report['wall_s']} s",
        f"dissemination: 100% informed p50 {d['time_to_100pct_s']['p50']} s, p99 {d['time_to_100pct_s']['p99']} s, "
        f"max {d['time_to_100pct_s']['max']} s (incomplete trials {d['trials_incomplete']}); "
        f"per member p50 {d['member_learn_s']['p50']} s",
        f"detection: first declared p50 {det['first_declared_s']['p50']} s, p99 {det['first_declared_s']['p99']} s; "
        f"all know p50 {det['all_members_know_s']['p50']} s, p99 {det['all_members_know_s']['p99']} s",
        f"false positives: {fp['declared_dead_events']} dead declarations of healthy members; "
        f"{fp['suspicions_of_healthy_members']} suspicions "
        f"({fp['suspicion_events_per_member_min']} per member per minute; "
        f"{fp['accusations_per_member_min']} accusations), {fp['refutations']} refutations",
        f"cost (steady): {cost['messages_per_member_s']} msg/s and {cost['kbit_per_member_s']} kbit/s per member",
    ]
    if "partition" in report:
        lines.append(
            f"partition {report['partition']['length_s']} s: views agree "
            f"{report['partition']['agree_after_heal_s']} s after healing"
        )
    return lines
