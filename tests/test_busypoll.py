"""Busy-polling (gossipd/busypoll.py): after a read the loop keeps turning, without sleeping,
until its window passes with no read; never while the CPUs are under pressure; never for
membership's traffic alone."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gossipd.busypoll import (
    PRESSURE_STALE_S,
    TURNS_WITHOUT_READ_MAX,
    BusyPoll,
    CpuPressure,
    StallReading,
    parse_stall,
)
from gossipd.clock import ManualClock
from gossipd.ops.scrape import scrape
from simulations.cluster import Cluster, DaemonProcess
from tests.helpers import RawProducer, key_owned_by, running, wait_until

WINDOW_S = 0.001


def _psi(total_us: int, avg10: float = 1.25) -> bytes:
    return (
        f"some avg10={avg10:.2f} avg60=3.50 avg300=0.00 total={total_us}\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    ).encode()


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_read_keeps_the_loop_turning_until_its_window_passes_without_one() -> None:
    clock = ManualClock()
    yields: list[float] = []
    poll = BusyPoll(WINDOW_S, clock=clock.monotonic, yield_cpu=lambda: yields.append(0))

    async def main() -> None:
        poll.poke()
        await _turns(5)
        assert poll.polling and len(yields) >= 4  # turning, yielding its core each turn
        clock.advance(0.0008)
        poll.poke()  # a read 0.8 ms in: the window runs from the turn after it
        await _turns(1)
        clock.advance(0.0008)
        await _turns(3)
        assert poll.polling  # 1.6 ms after the first read, 0.8 after the last
        clock.advance(0.0003)
        await _turns(3)
        assert not poll.polling  # 1.1 ms without a read
        quiet = len(yields)
        await _turns(5)
        assert len(yields) == quiet  # asleep: no more turns of its own

    asyncio.run(main())
    assert poll.polls == 1 and poll.declined == 0
    assert abs(poll.polled_s - 0.0019) < 1e-9


def test_a_clock_that_stands_still_ends_a_poll_after_its_turns() -> None:
    yields: list[int] = []
    poll = BusyPoll(WINDOW_S, clock=ManualClock().monotonic, yield_cpu=lambda: yields.append(0))

    async def main() -> None:
        poll.poke()
        await _turns(TURNS_WITHOUT_READ_MAX + 10)

    asyncio.run(main())
    assert not poll.polling and len(yields) == TURNS_WITHOUT_READ_MAX


def test_a_yield_that_fails_ends_the_poll_and_the_next_read_polls_again() -> None:
    def broken() -> None:
        raise OSError("no")

    poll = BusyPoll(WINDOW_S, clock=ManualClock().monotonic, yield_cpu=broken)

    async def main() -> None:
        poll.poke()
        await _turns(2)
        assert not poll.polling
        poll.poke()
        assert poll.polling and poll.polls == 2
        await _turns(2)

    asyncio.run(main())


def test_a_window_of_zero_never_polls() -> None:
    yields: list[int] = []
    poll = BusyPoll(0.0, clock=ManualClock().monotonic, yield_cpu=lambda: yields.append(0))

    async def main() -> None:
        for _ in range(3):
            poll.poke()
            await _turns(3)

    asyncio.run(main())
    assert (poll.polls, poll.polling, yields) == (0, False, [])


def test_cpu_pressure_over_its_max_cuts_a_poll_short_and_starts_none(tmp_path: Path) -> None:
    psi = tmp_path / "cpu"
    psi.write_bytes(_psi(5_000_000))
    clock = ManualClock()
    poll = BusyPoll(
        1.0,
        clock=clock.monotonic,
        pressure=CpuPressure(str(psi)),
        pressure_max=0.15,
        yield_cpu=lambda: None,
    )

    async def main() -> None:
        poll.poke()  # the first reading: no interval yet, so no pressure
        await _turns(2)
        assert poll.polling
        psi.write_bytes(_psi(5_000_000 + 30_000))  # 30 ms of waiting in 0.1 s: 0.3
        clock.advance(0.1)
        await _turns(2)
        assert not poll.polling and poll.declined == 1
        clock.advance(0.05)
        poll.poke()  # held back until the next reading, not asked again
        await _turns(2)
        assert not poll.polling and poll.declined == 1
        psi.write_bytes(_psi(5_000_000 + 30_000 + 5_500))  # 5.5 ms in the next 0.11 s
        clock.advance(0.06)
        poll.poke()
        await _turns(2)
        assert poll.polling and poll.polls == 2

    asyncio.run(main())


def test_without_psi_the_pressure_holds_nothing_back(tmp_path: Path) -> None:
    clock = ManualClock()
    for path in (tmp_path / "missing", tmp_path / "garbled"):
        if path.name == "garbled":
            path.write_bytes(b"not a pressure file\n")
        pressure = CpuPressure(str(path))
        for _ in range(3):
            assert pressure.update(clock.monotonic()) == 0.0
            clock.advance(0.2)
        poll = BusyPoll(1.0, clock=clock.monotonic, pressure=pressure, yield_cpu=lambda: None)

        async def main(poll: BusyPoll = poll) -> None:
            poll.poke()
            await _turns(2)
            assert poll.polling
            poll.close()
            clock.advance(0.001)
            await _turns(2)
            assert not poll.polling  # closed: its running poll ends at the next turn

        asyncio.run(main())


@pytest.mark.parametrize(
    ("first", "second", "after_s", "share"),
    [
        # (total us, avg10 %) at the first and the second reading, seconds between, share
        ((5_000_000, 1.25), (5_030_000, 1.25), 0.1, 0.3),  # 30 ms of waiting in 0.1 s
        ((5_000_000, 1.25), (5_000_000, 1.25), 0.15, 0.0),  # none
        ((5_000_000, 1.25), (5_100_002, 1.25), 0.1, 1.0),  # a hair over the interval: 1
        ((5_000_000, 1.25), (4_000_000, 40.0), 0.1, 0.4),  # gone back (a new file?): avg10
        ((5_000_000, 1.25), (5_200_000, 7.5), 0.5, 0.075),  # after a pause: avg10, not 0.4
        (
            (5_000_000, 1.25),
            (5_040_000, 7.5),
            PRESSURE_STALE_S - 0.01,
            0.04 / (PRESSURE_STALE_S - 0.01),
        ),
    ],
)
def test_the_share_of_time_some_task_waited(
    tmp_path: Path,
    first: tuple[int, float],
    second: tuple[int, float],
    after_s: float,
    share: float,
) -> None:
    psi = tmp_path / "cpu"
    psi.write_bytes(_psi(*first))
    clock = ManualClock()
    pressure = CpuPressure(str(psi))
    assert pressure.update(clock.monotonic()) == pytest.approx(first[1] / 100)  # no interval
    psi.write_bytes(_psi(*second))
    clock.advance(after_s)
    assert pressure.update(clock.monotonic()) == pytest.approx(share)
    psi.write_bytes(_psi(second[0] + 1_000_000))  # within the interval: not read again
    clock.advance(0.01)
    assert pressure.update(clock.monotonic()) == pytest.approx(share)


@given(
    total=st.integers(min_value=0, max_value=2**63),
    avgs=st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=3, max_size=3),
)
def test_the_stall_line_is_read_from_any_psi_text(total: int, avgs: list[float]) -> None:
    a, b, c = avgs
    text = (
        f"some avg10={a:.2f} avg60={b:.2f} avg300={c:.2f} total={total}\nfull avg10=0.00 total=7\n"
    )
    assert parse_stall(text.encode()) == StallReading(float(f"{a:.2f}") / 100, total)


@given(st.binary(max_size=300))
def test_any_bytes_parse_to_a_reading_or_none(data: bytes) -> None:
    reading = parse_stall(data)
    assert reading is None or (0.0 <= reading.avg10 <= 1.0 and reading.total_us >= 0)


def _polls(d: DaemonProcess) -> float:
    return scrape(d.metrics_port)["gossipd_busy_polls_total"]


def _membership_received(d: DaemonProcess) -> float:
    m = scrape(d.metrics_port)
    return sum(v for k, v in m.items() if k.startswith("gossipd_gossip_messages_received_total"))


def test_each_request_path_polls_and_membership_alone_does_not(tmp_path: Path) -> None:
    """Two members (the pressure not considered: this test must not depend on the machine's
    load).  Idle while they gossip, neither polls.  Then each kind of read, alone: a task
    pushed to the entry's ingress for a key it owns (the ingress), a GET /health (the door),
    completions for a key the other member owns (the peer channel); and
    once the requests stop, the polling stops."""
    import openai

    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=[
            'http.bind="127.0.0.1:0"',
            'metrics.bind="127.0.0.1:0"',
            "engine.token_delay_s=0",
            "node.busy_poll_cpu_pressure_max=1.0",
        ],
    )
    with running(c):
        entry, owner = c.daemons
        before = [_polls(d) for d in c.daemons]
        heard = [_membership_received(d) for d in c.daemons]
        wait_until(
            lambda: all(
                _membership_received(d) >= h + 6 for d, h in zip(c.daemons, heard, strict=True)
            ),
            30,
            "six membership messages more at each member",
        )
        assert [_polls(d) for d in c.daemons] == before

        producer = RawProducer(entry.endpoint)
        try:
            producer.send_task("pushed", key=key_owned_by(c, entry.name))
            assert [r["ok"] for r in producer.results(1, timeout_s=10)] == [True]
        finally:
            producer.close()
        pushed = [_polls(d) for d in c.daemons]
        assert pushed[0] > before[0] and pushed[1] == before[1]

        client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)

        def complete(session: str) -> None:
            done = client.completions.create(
                model="echo", prompt="poll", max_tokens=1, extra_headers={"x-session-id": session}
            )
            assert done.choices[0].text == "poll"

        with urllib.request.urlopen(f"{entry.http_url}/health", timeout=5) as answer:
            assert answer.status == 200  # an HTTP read, and no peer's
        local = [_polls(d) for d in c.daemons]
        assert local[0] > pushed[0] and local[1] == pushed[1]
        for _ in range(5):
            complete(key_owned_by(c, owner.name))
        forwarded = [_polls(d) for d in c.daemons]
        assert forwarded[0] > local[0] and forwarded[1] > local[1]

        def seconds() -> list[float]:
            return [scrape(d.metrics_port)["gossipd_busy_poll_seconds_total"] for d in c.daemons]

        settled = wait_until(
            lambda: (lambda a, b: a if a == b else None)(seconds(), seconds()),
            10,
            "the polls to end once the requests stopped",
        )
        # Each poll ends within its window after its last read: a few requests, far below 1 s.
        assert all(0 < s < 1.0 for s in settled)
