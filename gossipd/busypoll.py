"""Busy-polling: the event loop keeps turning for a moment after a read instead of sleeping.

A loop that sleeps in epoll pays for every wake-up.  On a virtual machine whose idle vCPU
halts (these machines: the guest's halt-polling is off), the next packet wakes it through
the hypervisor, tens of microseconds of CPU and latency each time, and the woken code runs
cold.  At one connection a forwarded request crosses four such wake-ups (client, entry,
owner, entry).  So after each read on a client's or a peer's connection (``poke``) the loop
keeps turning without sleeping (a ``call_soon`` that renews itself: uvloop then polls with
a zero timeout) until ``node.busy_poll_us`` has passed with no read, yielding its CPU on
each turn (``sched_yield``) so that a thread waiting for this core runs first.

It polls only while the CPUs have time to spare.  When some task waited for a CPU more
than ``node.busy_poll_cpu_pressure_max`` of the last interval (Linux's pressure stall
information, /proc/pressure/cpu, read at most every PRESSURE_INTERVAL_S), a poll stops
and none starts: under load the turns are full anyway, and a polling loop would take a
core that a waiting thread needs.  Measured in bench/README, "Busy-polling after a read".

Only the connections that carry requests poke (the HTTP door, the ingress, the peer
channel): membership's traffic does not, so an idle member never polls.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("gossipd.busypoll")

PRESSURE_PATH = "/proc/pressure/cpu"
PRESSURE_INTERVAL_S = 0.1  # how often a poll reads the pressure again
# A reading this long after the last one says nothing of now (an idle spell): the file's own
# 10 s average stands in until the next reading.
PRESSURE_STALE_S = 2 * PRESSURE_INTERVAL_S
# Turns of one poll with no read before it ends whatever the clock says: with the real
# clock a 300 us window takes a few hundred; a clock that stands still (a test's) must not
# keep the loop turning for ever.
TURNS_WITHOUT_READ_MAX = 10_000
_READ_BYTES = 512  # the file's two lines are about 130 bytes


def ignore_read() -> None:
    """The ``on_read`` of a connection that no busy-polling watches."""


@dataclass(frozen=True, slots=True)
class StallReading:
    """The "some" line of a PSI file: its 10 s average (a share, 0..1) and its total
    (microseconds in which some task waited, since boot)."""

    avg10: float
    total_us: int


def parse_stall(data: bytes) -> StallReading | None:
    """The "some" line of a PSI file (``some avg10=1.25 avg60=... total=N``); None when it
    has none, or not both of those fields."""
    for line in data.split(b"\n"):
        if not line.startswith(b"some "):
            continue
        fields = dict(f.partition(b"=")[::2] for f in line.split()[1:])
        avg10, total = fields.get(b"avg10", b""), fields.get(b"total", b"")
        try:
            share = float(avg10) / 100.0
        except ValueError:
            return None
        if not total.isdigit() or not 0.0 <= share <= 1.0:  # (a NaN fails both)
            return None
        return StallReading(share, int(total))
    return None


class CpuPressure:
    """The share of recent time in which some task waited for a CPU, read from a PSI file
    (opened at the first reading and kept open: a read is one ``pread``, about 2 us here)
    at most every PRESSURE_INTERVAL_S: the share of the interval since the last reading,
    or the file's 10 s average after a longer pause.  Where the file is missing or
    unreadable (a kernel without PSI, or booted with psi=0) the share stays 0: polling is
    not held back."""

    __slots__ = ("_at", "_fd", "_path", "_total_us", "share")

    def __init__(self, path: str = PRESSURE_PATH) -> None:
        self._path = path
        self._fd = -2  # -2: not opened yet; -1: closed, or unreadable
        self._at = 0.0
        self._total_us = -1
        self.share = 0.0  # of the last interval read

    def _read(self) -> StallReading | None:
        if self._fd == -2:
            try:
                self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                self._fd = -1
                log.info("busy-polling is not held back by CPU pressure: %s unreadable (%s)",
                         self._path, exc)  # fmt: skip
                return None
        try:
            reading = parse_stall(os.pread(self._fd, _READ_BYTES, 0))
        except OSError:
            reading = None
        if reading is None:
            log.info("busy-polling is not held back by CPU pressure: %s has no 'some' line",
                     self._path)  # fmt: skip
            self.close()
        return reading

    def update(self, now: float) -> float:
        """The share as of ``now`` (monotonic seconds), read again when the last reading is
        PRESSURE_INTERVAL_S old; at most 1 (the file is read an instant after our clock)."""
        if self._fd == -1 or now - self._at < PRESSURE_INTERVAL_S:
            return self.share
        reading = self._read()
        if reading is None:
            self.share = 0.0
            return 0.0
        waited_us = reading.total_us - self._total_us
        if self._total_us < 0 or now - self._at > PRESSURE_STALE_S or waited_us < 0:
            self.share = reading.avg10
        else:
            self.share = min(1.0, waited_us / 1e6 / (now - self._at))
        self._total_us, self._at = reading.total_us, now
        return self.share

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1


@dataclass(frozen=True, slots=True)
class BusyPollStatistics:
    polls: int  # polls begun
    polled_s: float  # the time of ended polls: the loop kept from sleeping (requests too)
    declined: int  # pressure readings that cut a poll short or held polls back


class BusyPoll:
    """``poke()`` after each read; the loop then polls until ``window_s`` passes with none.

    ``clock``: monotonic seconds at microsecond resolution or better (uvloop's
    ``loop.time()`` moves in milliseconds), the same clock as the pressure file's, so the
    real one (a clock that stands still ends a poll after TURNS_WITHOUT_READ_MAX turns);
    ``yield_cpu``: os.sched_yield unless a test says otherwise; ``pressure``: None polls
    whatever the CPUs' load; ``pressure_max``: a share above it holds polling back."""

    __slots__ = (
        "_clock",
        "_held_until",
        "_loop",
        "_pressure",
        "_pressure_max",
        "_reads",
        "_seen",
        "_since",
        "_turns_left",
        "_until",
        "_window_s",
        "_yield",
        "declined",
        "polled_s",
        "polling",
        "polls",
    )

    def __init__(
        self,
        window_s: float,
        *,
        clock: Callable[[], float],
        pressure: CpuPressure | None = None,
        pressure_max: float = 1.0,
        yield_cpu: Callable[[], None] = os.sched_yield,
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._pressure = pressure
        self._pressure_max = pressure_max
        self._yield = yield_cpu
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reads = 0  # pokes, ever
        self._seen = 0  # pokes the running poll has seen
        self._since = 0.0  # when the running poll began
        self._until = 0.0  # when it ends unless poked again
        self._turns_left = 0  # ... or after this many more turns without one
        self._held_until = 0.0  # under pressure: no poll before the next reading
        self.polling = False
        self.polls = 0  # polls begun
        self.polled_s = 0.0  # their time, ended ones
        # Polls cut short, or readings that held polls back: the CPUs were under pressure
        # (at most one a PRESSURE_INTERVAL_S: until the next reading no read asks again).
        self.declined = 0

    def poke(self) -> None:
        self._reads += 1
        if self.polling or self._window_s <= 0:
            return
        now = self._clock()
        if now < self._held_until:
            return
        pressure = self._pressure
        if pressure is not None and pressure.update(now) > self._pressure_max:
            self._hold(now)
            return
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self.polling = True
        self.polls += 1
        self._seen = self._reads
        self._since = now
        self._until = now + self._window_s
        self._turns_left = TURNS_WITHOUT_READ_MAX
        loop.call_soon(self._turn)

    def _turn(self) -> None:
        now = self._clock()
        if self._reads != self._seen:
            self._seen = self._reads
            self._until = now + self._window_s
            self._turns_left = TURNS_WITHOUT_READ_MAX
        elif now >= self._until or self._turns_left <= 0:
            self._end(now)
            return
        self._turns_left -= 1
        pressure = self._pressure
        try:
            if pressure is not None and pressure.update(now) > self._pressure_max:
                self._end(now)
                self._hold(now)
                return
            self._yield()
        except Exception:  # (a bug: polling must not stop for the process's life with it)
            self._end(now)
            log.exception("busy-polling failed: it stops until the next read")
            return
        assert self._loop is not None
        self._loop.call_soon(self._turn)

    def _hold(self, now: float) -> None:
        self.declined += 1
        self._held_until = now + PRESSURE_INTERVAL_S

    def _end(self, now: float) -> None:
        self.polling = False
        self.polled_s += now - self._since

    def statistics(self) -> BusyPollStatistics:
        return BusyPollStatistics(self.polls, self.polled_s, self.declined)

    def close(self) -> None:
        """Stops the reads of the pressure file (a poll under way ends at its next turn)."""
        self._window_s = self._until = 0.0
        if self._pressure is not None:
            self._pressure.close()
