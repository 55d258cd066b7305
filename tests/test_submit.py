"""`gossipd submit`'s rough edges: no daemon at the endpoint, --out, the summary of a run
where every task failed, and --stream's final status line (real daemon processes)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from gossipd.tools.client import Client, NotConnected
from gossipd.tools.launcher import free_tcp_port
from tests.helpers import gossipd_cli


def test_a_client_fails_fast_naming_the_endpoint_when_nothing_listens() -> None:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"

    async def main() -> None:
        async with Client([endpoint], connect_timeout_s=1.5):
            raise AssertionError("connected to nothing")

    started = time.monotonic()
    with pytest.raises(NotConnected) as info:
        asyncio.run(main())
    assert time.monotonic() - started < 2.0
    assert endpoint in str(info.value) and "gossipd run" in str(info.value)


def test_a_client_with_a_connect_timeout_connects_at_once_to_a_daemon(daemon_factory) -> None:
    daemon = daemon_factory()

    async def main() -> float:
        started = time.monotonic()
        async with Client([daemon.endpoint], connect_timeout_s=1.5) as client:
            waited = time.monotonic() - started
            assert (await client.run("a b", max_tokens=2)).ok
        return waited

    assert asyncio.run(main()) < 1.0


@pytest.mark.parametrize("how", ["prompt", "file"])
def test_submit_with_no_daemon_fails_within_2_s_naming_the_endpoint(
    tmp_path: Path, how: str
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    args = ["hello"] if how == "prompt" else ["--file", str(path), "--no-progress"]
    started = time.monotonic()
    proc = gossipd_cli("submit", "-e", endpoint, *args, timeout_s=30)
    elapsed_s = time.monotonic() - started
    assert proc.returncode == 1
    assert f"no daemon at {endpoint}" in proc.stderr, proc.stderr
    assert "deadline_exceeded" not in proc.stderr
    # 1.5 s of waiting plus the interpreter's start (imports): far from the 32 s it was.
    assert elapsed_s < 10, elapsed_s


def test_submit_file_out_writes_every_result_with_its_line(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("engine.token_delay_s=0.01")  # 50 tokens: 0.5 s, over 0.1 s
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "results.jsonl"
    tasks.write_text(
        json.dumps({"id": "one", "prompt": "a b c", "params": {"max_tokens": 3}})
        + "\n\n"  # a blank line: skipped, but it counts in the numbering
        + json.dumps(
            {"id": "two", "prompt": "slow", "params": {"max_tokens": 50}, "timeout_ms": 100}
        )
        + "\n"
        + "this is not json\n"
        + json.dumps({"prompt": "no id"})
        + "\n"
    )
    proc = gossipd_cli(
        "submit", "-e", daemon.endpoint, "--file", str(tasks), "--out", str(out), "--no-progress"
    )
    assert proc.returncode == 1, proc.stderr
    rows = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == [1, 3, 4, 5]
    assert rows[1]["id"] == "one" and rows[1]["ok"] and rows[1]["text"] == "a b c"
    assert rows[3]["id"] == "two" and rows[3]["error"]["code"] == "deadline_exceeded"
    assert rows[4]["error"]["code"] == "bad_request" and rows[4]["id"].endswith(":4")
    assert rows[5]["ok"] and rows[5]["id"]


def test_submit_file_where_every_task_fails_reports_no_latency(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "bad", "params": {"top_p": 0}}) + "\n")  # refused
    text = gossipd_cli("submit", "-e", daemon.endpoint, "--file", str(tasks), "--no-progress")
    assert text.returncode == 1
    assert "latency n/a (no task succeeded)" in text.stdout and "0.0 ms" not in text.stdout
    as_json = gossipd_cli(
        "submit", "-e", daemon.endpoint, "--file", str(tasks), "--no-progress", "--json"
    )
    assert json.loads(as_json.stdout)["latency_ms"] == {"p50": None, "p99": None}


def test_submit_stream_ends_with_a_status_line(daemon_factory) -> None:
    daemon = daemon_factory()
    proc = gossipd_cli("submit", "-e", daemon.endpoint, "a b c", "--stream", "--max-tokens", "4")
    assert proc.returncode == 0 and proc.stdout == "a b c a\n"
    status = proc.stderr.strip().splitlines()[-1]
    assert status.startswith("[ok: 4 chunks from ") and "total" in status, proc.stderr


def test_submit_file_does_not_send_lines_whose_id_the_daemon_would_refuse(
    daemon_factory,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Issue 24: a 146-character id was sent, refused bad_request (answered with another id)
    and resubmitted for 32 s; an empty id was accepted. Ids are 1..128 characters."""
    port = free_tcp_port()
    daemon = daemon_factory(f"metrics.bind=127.0.0.1:{port}")
    tasks, out = tmp_path / "tasks.jsonl", tmp_path / "results.jsonl"
    lines = [
        {"id": "x" * 146, "prompt": "too long an id"},
        {"id": "", "prompt": "an empty id"},
        {"id": "y" * 128, "prompt": "a b", "params": {"max_tokens": 2}},
    ]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    started = time.monotonic()
    proc = gossipd_cli(
        "submit", "-e", daemon.endpoint, "--file", str(tasks), "--out", str(out), "--no-progress"
    )
    elapsed_s = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert elapsed_s < 10, elapsed_s
    rows = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows[1]["error"]["code"] == "bad_request" and "128" in rows[1]["error"]["message"]
    assert (
        rows[2]["error"]["code"] == "bad_request" and "length >= 1" in rows[2]["error"]["message"]
    )
    assert rows[3]["ok"] and rows[3]["id"] == "y" * 128
    assert "2 tasks" not in proc.stdout and "failed: bad_request=2" in proc.stdout
    from gossipd.ops.scrape import scrape

    assert scrape(port)["gossipd_messages_received_total"] == 1  # the invalid lines: not sent


def test_submit_file_that_cannot_be_read_says_so_without_a_traceback(tmp_path: Path) -> None:
    proc = gossipd_cli("submit", "--file", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr and "missing.jsonl" in proc.stderr
    assert "No such file" in proc.stderr and "Traceback" not in proc.stderr


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`gossipd check-config | head`: the reader gone, the command ends without a traceback,
    with 141 (128 + SIGPIPE) as a shell reports a tool killed by SIGPIPE."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader before the command starts: every write fails with EPIPE
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gossipd", "check-config"],
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(write_end)
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=30) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


@pytest.mark.parametrize("task_id", ["", "z" * 129])
def test_a_client_refuses_an_id_the_daemon_would_refuse_before_sending(task_id: str) -> None:
    from gossipd.errors import LocalProtocolError

    async def main() -> None:
        async with Client(["tcp://127.0.0.1:9"]) as client:
            with pytest.raises(LocalProtocolError, match=r"1\.\.128 characters"):
                await client.submit("p", task_id=task_id)
            assert client.statistics().submitted == 0

    asyncio.run(main())


def test_a_daemon_started_without_a_log_dir_writes_nothing_into_tmp_under_pytest() -> None:
    """Issue 24: test runs left gossipd-* directories in /tmp (tests/conftest.py points
    TMPDIR at pytest's own base temp for the session, subprocesses included)."""
    import tempfile

    from gossipd.tools.launcher import DaemonProcess

    root = Path(tempfile.gettempdir())
    assert root != Path("/tmp") and "pytest" in str(root), root
    daemon = DaemonProcess()
    assert daemon.log_path.parent.parent == root, daemon.log_path
    code = "import tempfile; print(tempfile.gettempdir())"
    import subprocess
    import sys

    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert Path(seen.stdout.strip()) == root


def test_a_connection_without_a_handshake_is_named_as_such_not_as_nothing_listening() -> None:
    """A daemon under CURVE met without keys (or with keys it does not know) accepts the
    connection and completes no handshake: the Client took the connection for a daemon, and
    every task waited out its deadline.  Now wait_connected waits for the handshake and says
    what is missing.  Stand-ins: a CURVE server met without keys, a plain one met with them."""
    import zmq

    from gossipd.tools.client import ProducerKeys

    public, secret = zmq.curve_keypair()
    server_public, server_secret = zmq.curve_keypair()
    ctx = zmq.Context()
    curve_server = ctx.socket(zmq.PULL)
    curve_server.setsockopt(zmq.CURVE_SERVER, 1)
    curve_server.setsockopt(zmq.CURVE_SECRETKEY, server_secret)
    plain_server = ctx.socket(zmq.PULL)
    at_curve = f"tcp://127.0.0.1:{curve_server.bind_to_random_port('tcp://127.0.0.1')}"
    at_plain = f"tcp://127.0.0.1:{plain_server.bind_to_random_port('tcp://127.0.0.1')}"

    async def attempt(endpoint: str, keys: ProducerKeys | None) -> str:
        try:
            async with Client([endpoint], ctx=ctx, connect_timeout_s=1.0, curve=keys):
                return "connected"
        except NotConnected as exc:
            return str(exc)

    keys = ProducerKeys(public=public, secret=secret, server_keys=[server_public])
    try:
        without_keys = asyncio.run(attempt(at_curve, None))
        with_keys = asyncio.run(attempt(at_plain, keys))
    finally:
        ctx.destroy(linger=0)
    assert "accepts connections but no handshake completed" in without_keys, without_keys
    assert "--secret-key" in without_keys
    assert "no CURVE handshake completed" in with_keys and "--server-key" in with_keys


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--window", "0", "--file", "F"], "--window: must be at least 1"),
        (["--resubmit-after", "0", "--file", "F"], "--resubmit-after: must be above 0"),
        (["-e", "10.0.0.5:5557", "hello"], "is not tcp://HOST:PORT"),
        (["--file", "F", "--out", "/nonexistent-dir/out.jsonl"], "cannot write --out"),
    ],
)
def test_submit_refuses_bad_options_with_a_message(
    tmp_path: Path, args: list[str], said: str
) -> None:
    """--window 0 waited for ever; --resubmit-after 0 resent every task at every loop turn;
    an endpoint ZeroMQ refuses was reported as the reply address's fault; an --out that
    cannot be written gave a traceback."""
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    args = [str(path) if a == "F" else a for a in args]
    proc = gossipd_cli("submit", *args, timeout_s=30)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_file_line_with_a_bad_deadline_or_an_id_taken_is_refused_not_sent(
    daemon_factory, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """README: a line that is no valid task is not sent.  A timeout_ms of 0 or past the
    Task's 3,600,000 was sent (ending deadline_exceeded, or refused by the daemon), and a
    second line with an id taken raised out of submit (or got the first line's Result)."""
    daemon = daemon_factory()
    path = tmp_path / "tasks.jsonl"
    lines = [
        {"prompt": "a", "id": "one"},
        {"prompt": "b", "id": "one"},
        {"prompt": "c", "timeout_ms": 0},
        {"prompt": "d", "timeout_ms": 3_600_001},
        {"prompt": "e", "id": "two"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    proc = gossipd_cli(
        "submit", "-e", daemon.endpoint, "--file", str(path), "--out", str(out), "--no-progress",
        "--json", timeout_s=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    results = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert results[1]["ok"] and results[5]["ok"]
    for line in (2, 3, 4):
        assert results[line]["error"]["code"] == "bad_request", results[line]
    assert "line 1's too" in results[2]["error"]["message"]


def test_submit_sends_a_files_tasks_as_it_reads_them_from_a_pipe(
    daemon_factory, tmp_path: Path
) -> None:
    """`gossipd submit --file` read the whole file before it sent a task: a file larger than
    memory could not be sent, and from a pipe no task left before the writer closed it.  Now
    the first line's Result is written while the pipe is still open."""
    import os
    import subprocess
    import sys

    from tests.helpers import wait_until

    daemon = daemon_factory()
    fifo, out = tmp_path / "tasks.fifo", tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossipd", "submit", "-e", daemon.endpoint, "--file", str(fifo),
         "--out", str(out), "--json", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with fifo.open("w") as writer:  # (opens once the command opens its end)
            writer.write(json.dumps({"id": "first", "prompt": "a b"}) + "\n")
            writer.flush()
            wait_until(
                lambda: out.exists() and '"first"' in out.read_text(),
                30,
                "the first line's Result while the pipe is open",
            )
            writer.write("\n" + json.dumps({"id": "second", "prompt": "c"}) + "\nnot json\n")
            writer.write(json.dumps({"id": "first", "prompt": "again"}))  # no newline at the end
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-2000:]
    report = json.loads(stdout)
    assert report["total"] == 4 and report["ok"] == 2, report
    assert report["failed"] == {"bad_request": 2}
    assert f"{fifo}:4" in stderr and f"{fifo}:5" in stderr and "line 1's too" in stderr
    rows = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows[1]["ok"] and rows[3]["ok"] and sorted(rows) == [1, 3, 4, 5]
