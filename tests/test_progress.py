"""Progress lines for long work: durations, the ETA, and the heartbeat of a long step."""

from __future__ import annotations

import io

import pytest

from gossipd.tools.progress import Progress, Steps, duration
from tests.helpers import wait_until


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.4, "0s"), (42, "42s"), (59.6, "1m00s"), (185, "3m05s"), (3720, "1h02m")],
)
def test_duration(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_steps_print_each_step_with_an_eta_from_the_steps_done() -> None:
    out = io.StringIO()
    with Steps(3, "bench x", stream=out, heartbeat_s=0) as steps:
        steps.start("one")
        steps.start("two")
        steps.note("a figure")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[bench x 1/3 +0s] one")  # no ETA before a step has ended
    assert lines[1].startswith("[bench x 2/3 +0s, ETA ~0s] two")
    assert lines[2] == "[bench x 2/3 +0s] a figure"


def test_a_long_step_is_never_silent() -> None:
    out = io.StringIO()
    steps = Steps(2, "bench y", stream=out, heartbeat_s=0.05)
    steps.start("starting engines")
    wait_until(lambda: "... starting engines (" in out.getvalue(), 5, "a heartbeat line")
    steps.close()
    assert out.getvalue().splitlines()[-1].startswith("[bench y] done in ")


def test_disabled_steps_print_nothing() -> None:
    out = io.StringIO()
    with Steps(2, "z", stream=out, enabled=False) as steps:
        steps.start("a")
    assert out.getvalue() == ""


def test_progress_shows_an_eta_while_items_remain() -> None:
    out = io.StringIO()
    progress = Progress(100, "submit", stream=out)
    progress._started -= 10.0  # 10 s ago: 25 done, so 75 more take about 30 s
    progress.update(25, force=True)
    assert "25/100" in out.getvalue() and "ETA 30s" in out.getvalue()


@pytest.mark.parametrize("tty", [False, True])
def test_progress_prints_its_last_line_once(tty: bool) -> None:
    """Issue 24: close() after the last update used to write the same line again."""

    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return tty

    out = Stream()
    progress = Progress(3, "submit", stream=out)
    progress.update(1, "ok=1", force=True)
    progress.update(3, "ok=3", force=True)
    progress.close(3, "ok=3")
    lines = [x for x in out.getvalue().replace("\r", "\n").splitlines() if x]
    assert [x.split()[2] for x in lines] == ["1/3", "3/3"], lines
    assert out.getvalue().endswith("\n")
    # A close that says more than the last line does write it.
    out = Stream()
    progress = Progress(3, "submit", stream=out)
    progress.update(2, "ok=2", force=True)
    progress.close(3, "ok=3")
    assert out.getvalue().count("3/3") == 1


def test_progress_of_an_unknown_total_counts_without_a_bar_or_an_eta() -> None:
    """`gossipd submit --file` from a pipe: how many lines come is not known ahead."""
    out = io.StringIO()
    progress = Progress(None, "submit", stream=out)
    progress._started -= 10.0
    progress.update(25, "ok=25", force=True)
    line = out.getvalue()
    assert line.split()[:2] == ["submit", "25"] and "ok=25" in line
    assert "[" not in line and "ETA" not in line and "/None" not in line
