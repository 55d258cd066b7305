"""The benchmarks' PNG figures share one frame: a y axis in percent (0-100), a small title and
legend, 120 dpi.  matplotlib (the ``plot`` extra) is imported only when a figure is drawn."""

from __future__ import annotations

from typing import Any


def percent_figure(height_in: float) -> tuple[Any, Any]:
    """A new 6.4-inch-wide figure and its axes, drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6.4, height_in))


def save_percent_figure(fig: Any, ax: Any, title: str, path: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
