"""Progress output for long work: a redrawn bar on a terminal, a line every few seconds
otherwise (so CI logs show progress without a wall of carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self, total: int, label: str, *, stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.total = total
        self.label = label
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._tty = self._stream.isatty()
        self._interval_s = 0.1 if self._tty else 2.0
        self._started = time.monotonic()
        self._last = 0.0

    def update(self, done: int, extra: str = "", *, force: bool = False) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self._interval_s:
            return
        self._last = now
        elapsed = max(now - self._started, 1e-9)
        width = 30
        filled = int(width * done / self.total) if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        line = f"{self.label} [{bar}] {done}/{self.total} {done / elapsed:8.0f}/s {extra}"
        if self._tty:
            self._stream.write("\r" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self, done: int, extra: str = "") -> None:
        self.update(done, extra, force=True)
        if self._enabled and self._tty:
            self._stream.write("\n")
            self._stream.flush()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100); 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), int(-(-q * len(sorted_values) // 100))))
    return sorted_values[rank - 1]


def summarize(values: list[float]) -> dict[str, float | None]:
    """{"n", "p50", "p99", "max"} of unsorted values (3 decimals); None fields when empty."""
    s = sorted(values)
    if not s:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {
        "n": len(s),
        "p50": round(percentile(s, 50), 3),
        "p99": round(percentile(s, 99), 3),
        "max": round(s[-1], 3),
    }
