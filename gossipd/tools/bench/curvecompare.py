"""What `bench ingress --curve` and `bench route --curve` compare: two producers, each with and
without CURVE, in alternating runs.

The cost of CURVE to a daemon depends on how its producers send: libzmq encrypts and
authenticates every frame on its own (about 1 us of CPU per small frame at each end on the
2-core VM), and the daemon reads every frame's producer key (about 0.6 us).  So the benches
measure both kinds of producer side by side:

- ``client``: sends as gossipd's Client does by default: the tasks of one turn packed into
  Tasks frames, replies asked for as Replies frames (docs/PROTOCOL.md, "Tasks", "Replies");
- ``frame_per_task``: one frame per task each way (the simplest third-party producer).

The ratio for ``client`` is the headline ``ratio_curve_vs_plain``; the other is reported
beside it, never hidden.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

SIDES = ("plain", "curve")


@dataclass(frozen=True)
class Producer:
    batch_replies: bool
    batch_tasks: bool
    says: str

    def opts(self) -> dict[str, bool]:
        return {"batch_replies": self.batch_replies, "batch_tasks": self.batch_tasks}


PRODUCERS = {
    "client": Producer(
        True, True, "packs as gossipd's Client does: Tasks frames in, Replies frames out"
    ),
    "frame_per_task": Producer(False, False, "one frame per task each way"),
}


def producers_of(choice: str) -> list[str]:
    """``--producer``: ``both`` (client first: the headline), ``client`` or
    ``frame-per-task``."""
    if choice == "both":
        return list(PRODUCERS)
    return [choice.replace("-", "_")]


def round_order(round_index: int, producers: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(producer, side) pairs of one round; every other round in reverse, so that a drift of
    the machine's load over a round weighs on both sides alike."""
    pairs = [(p, s) for p in producers for s in SIDES]
    return iter(pairs if round_index % 2 == 0 else pairs[::-1])


def paired_median(curve: Sequence[float], plain: Sequence[float]) -> float:
    """The median of each round's own curve/plain throughput: steadier than the ratio of
    medians on a shared machine whose load drifts between rounds."""
    return round(statistics.median(c / p for c, p in zip(curve, plain, strict=True)), 3)


def round_note(producers: Sequence[str], last: Callable[[str, str], float]) -> str:
    """One round's throughputs for the progress line; ``last(producer, side)``: that run's
    tasks/s."""
    return ", ".join(
        f"{p}: plain {last(p, 'plain'):,.0f}/s, curve {last(p, 'curve'):,.0f}/s" for p in producers
    )


def report_producers(
    report: dict[str, Any],
    producers: Sequence[str],
    figure: str,
    side_figures: Callable[[str, str], dict[str, Any]],
    throughputs: Callable[[str, str], list[float]],
) -> None:
    """Add each producer's entry to ``report["producers"]`` (its batching, both sides'
    figures, ``ratio_curve_vs_plain`` of the sides' ``figure``, ``ratio_paired_median`` of the
    rounds' ``throughputs``), every producer's ratio as ``ratio_curve_vs_plain_<producer>``,
    and the first producer's at the top (``ratio_curve_vs_plain``, ``ratio_paired_median``,
    ``headline_producer``, ``plain``, ``curve_on``).  ``side_figures(producer, side)``,
    ``throughputs(producer, side)``: side is "plain" or "curve"."""
    report["producers"] = {}
    for name in producers:
        plain, curve = side_figures(name, "plain"), side_figures(name, "curve")
        report["producers"][name] = entry = {
            **PRODUCERS[name].opts(),
            "plain": plain,
            "curve_on": curve,
            "ratio_curve_vs_plain": round(curve[figure] / plain[figure], 3),
            "ratio_paired_median": paired_median(
                throughputs(name, "curve"), throughputs(name, "plain")
            ),
        }
        report[f"ratio_curve_vs_plain_{name}"] = entry["ratio_curve_vs_plain"]
    first = report["producers"][producers[0]]
    report["headline_producer"] = producers[0]
    report["plain"], report["curve_on"] = first["plain"], first["curve_on"]
    report["ratio_curve_vs_plain"] = first["ratio_curve_vs_plain"]
    report["ratio_paired_median"] = first["ratio_paired_median"]
    report["goal_ratio"] = 0.9


def print_ratios(report: dict[str, Any]) -> None:
    for name, entry in report["producers"].items():
        print(
            f"{name:15} ({PRODUCERS[name].says}): ratio_curve_vs_plain = "
            f"{entry['ratio_curve_vs_plain']}, paired median {entry['ratio_paired_median']} "
            "(goal >= 0.9)"
        )
