"""Progress output for long work: a redrawn bar on a terminal, a line every few seconds
otherwise (so CI logs show progress without a wall of carriage returns), with an ETA.

``Progress`` counts items (tasks); ``Steps`` follows work made of a few long steps (a
benchmark's runs), with a heartbeat line while a step runs, so nothing long is silent.
Both write to stderr: a benchmark's stdout is its report.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def duration(seconds: float) -> str:
    """A short human duration: 42s, 3m05s, 1h02m."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class Progress:
    def __init__(
        self,
        total: int | None,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        """``total`` None: not known ahead (a pipe read as it comes): counts, no bar."""
        self.total = total
        self.label = label
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._tty = self._stream.isatty()
        self._interval_s = 0.1 if self._tty else 2.0
        self._started = time.monotonic()
        self._last = 0.0
        self._shown: tuple[int, str] | None = None  # (done, extra) of the last line written

    def update(self, done: int, extra: str = "", *, force: bool = False) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self._interval_s:
            return
        self._last = now
        self._shown = (done, extra)
        elapsed = max(now - self._started, 1e-9)
        rate = done / elapsed
        if self.total is None:
            line = f"{self.label} {done} {rate:8.0f}/s {extra}"
        else:
            width = 30
            filled = int(width * done / self.total) if self.total else width
            bar = "#" * filled + "-" * (width - filled)
            eta = (
                f" ETA {duration((self.total - done) / rate)}"
                if 0 < done < self.total and elapsed > 1.0
                else ""
            )
            line = f"{self.label} [{bar}] {done}/{self.total} {rate:8.0f}/s{eta} {extra}"
        if self._tty:
            self._stream.write("\r" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def close(self, done: int, extra: str = "") -> None:
        if self._shown != (done, extra):  # else the last line already says it
            self.update(done, extra, force=True)
        if self._enabled and self._tty:
            self._stream.write("\n")
            self._stream.flush()


class Steps:
    """Work made of ``total`` steps of similar cost: a line as each step starts, with the time
    so far and an ETA from the steps done (none before the first ends), and a heartbeat line
    every ``heartbeat_s`` while a step runs (a background thread), to ``stream`` (stderr)::

        [bench prefix 2/6 +1m52s, ETA ~9m20s] tight/key: starting 3 engines
        [bench prefix 2/6 +2m07s] ... tight/key: starting 3 engines (15s in this step)

    Use as a context manager, or call ``close``."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        heartbeat_s: float = 15.0,
    ) -> None:
        self.total = total
        self.label = label
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._heartbeat_s = heartbeat_s
        self._started = time.monotonic()
        self._step = 0
        self._step_started = self._started
        self._what = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if enabled and heartbeat_s > 0:
            self._thread = threading.Thread(target=self._beat, name="progress", daemon=True)
            self._thread.start()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, what: str) -> None:
        """Step ``what`` begins (the one before it has ended)."""
        now = time.monotonic()
        with self._lock:
            done = self._step
            self._step += 1
            self._step_started = now
            self._what = what
        elapsed = now - self._started
        eta = f", ETA ~{duration(elapsed / done * (self.total - done))}" if done else ""
        self._write(f"[{self.label} {self._step}/{self.total} +{duration(elapsed)}{eta}] {what}")

    def note(self, text: str) -> None:
        """A line about the current step."""
        elapsed = time.monotonic() - self._started
        self._write(f"[{self.label} {self._step}/{self.total} +{duration(elapsed)}] {text}")

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._write(f"[{self.label}] done in {duration(time.monotonic() - self._started)}")

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            with self._lock:
                what, since = self._what, self._step_started
            if what:
                now = time.monotonic()
                self.note(f"... {what} ({duration(now - since)} in this step)")

    def _write(self, line: str) -> None:
        if self._enabled:
            with self._lock:
                self._stream.write(line + "\n")
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
