"""Busy-polling (gossipd/busypoll.py): after a read the loop keeps turning, without sleeping,
until its window passes with no read; never while the CPUs are under pressure; never for
membership's traffic alone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gossipd.busypoll import BusyPoll, CpuPressure, parse_stall_us
from gossipd.clock import ManualClock
from gossipd.ops.scrape import scrape
from simulations.cluster import Cluster
from tests.helpers import key_owned_by, running, wait_until

WINDOW_S = 0.001


def _psi(total_us: int) -> bytes:
    return (
        f"some avg10=1.25 avg60=3.50 avg300=0.00 total={total_us}\n"
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


@given(
    total=st.integers(min_value=0, max_value=2**63),
    avgs=st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=3, max_size=3),
)
def test_the_stall_total_is_read_from_any_psi_text(total: int, avgs: list[float]) -> None:
    a, b, c = avgs
    text = (
        f"some avg10={a:.2f} avg60={b:.2f} avg300={c:.2f} total={total}\nfull avg10=0.00 total=7\n"
    )
    assert parse_stall_us(text.encode()) == total


@given(st.binary(max_size=300))
def test_any_bytes_parse_to_a_total_or_none(data: bytes) -> None:
    total = parse_stall_us(data)
    assert total is None or (isinstance(total, int) and total >= 0)


def _polls(port: int) -> tuple[float, float]:
    m = scrape(port)
    return m["gossipd_busy_polls_total"], m["gossipd_busy_poll_seconds_total"]


def test_requests_make_the_daemons_poll_and_membership_alone_does_not(tmp_path: Path) -> None:
    """Two members (pressure not considered: this test must not depend on the machine's
    load).  Idle, gossiping, neither polls; requests through the entry to a key the other
    owns make both poll (the entry after the HTTP reads, the owner after the peer reads),
    and once they stop the polling stops: its seconds stay put."""
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
        idle_before = [_polls(d.metrics_port)[0] for d in c.daemons]
        time.sleep(3)  # membership probes and gossips meanwhile (every 0.5-1 s)
        assert [_polls(d.metrics_port)[0] for d in c.daemons] == idle_before
        client = openai.OpenAI(base_url=f"{entry.http_url}/v1", api_key="none", max_retries=0)
        session = key_owned_by(c, owner.name)
        for _ in range(20):
            done = client.completions.create(
                model="echo",
                prompt="poll",
                max_tokens=1,
                extra_headers={"x-session-id": session},
            )
            assert done.choices[0].text == "poll"
        after = [_polls(d.metrics_port) for d in c.daemons]
        assert all(polls > before for (polls, _), before in zip(after, idle_before, strict=True))
        settled = wait_until(
            lambda: (lambda a, b: a if a == b else None)(
                [_polls(d.metrics_port) for d in c.daemons],
                [_polls(d.metrics_port) for d in c.daemons],
            ),
            10,
            "the polls to end once the requests stopped",
        )
        # Each poll ends within its window after the last read: 20 requests, well under 1 s.
        assert all(0 < seconds < 1.0 for _, seconds in settled)
