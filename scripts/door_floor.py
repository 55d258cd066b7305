"""Where the HTTP door's CPU goes under wrk: per thread, per system call and per layer.

``gossipd bench http``'s gossipd variant (2 daemons, echo engine, the load spread over both
doors, about half the requests forwarded), driven by the bench's own wrk at each concurrency
in turn, and for each window:

- per thread kind (the daemons' main threads, their ZeroMQ I/O threads): user and system
  CPU microseconds a request, voluntary and involuntary context switches a request
  (/proc/PID/task/TID/stat and status);
- with ``perf`` (tracepoints ``syscalls:sys_enter_*``): system calls a request per thread
  kind, among them ``epoll_pwait``, the event loop's turns;
- with ``py-spy`` and ``perf record`` (``--sample``, a separate window: sampling slows the
  daemons): the daemons' CPU samples by thread and binary (libpython, the kernel, uvloop,
  msgspec, libzmq...), and the main threads' Python samples by the frame they were in: the writes to clients
  (``respond`` and the turn end's writes, CLIENT_WRITES: uvloop writes at once, so the
  loopback TCP send and the client's wake-up count here), the event loop's own C code (``Runner.run`` on top: epoll, socket
  reads, callback dispatch), ZeroMQ's calls (``zmq/*`` on top: the mailbox signal that wakes
  the I/O thread), and gossipd's Python (the rest).  py-spy samples a thread that is not
  idle by the wall clock, so a thread preempted right after a call (runnable, waiting for a
  core) counts under that call: a write that wakes wrk, which then takes the core, counts
  under the write; perf's samples are CPU time only.

What it is for: how much of a request's CPU is Python that a change to gossipd could remove,
and how much is the kernel, the loop and ZeroMQ, which it cannot.  A measurement of this
machine, not a benchmark: compare its figures with each other.

    .venv/bin/python scripts/door_floor.py [--concurrency 16,64] [--seconds 4] [--sample]
        [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gossipd.tools.bench.http import _gossipd
from gossipd.tools.bench.http_peers import Window, Wrk, new_workdir

SYSCALLS = ("epoll_pwait", "epoll_wait", "read", "write", "recvfrom", "sendto", "poll",
            "getpid", "epoll_ctl", "futex")  # fmt: skip
TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")
# The frames that write to the client's socket (uvloop writes at once, in the call):
# gossipd/http/server.py's Exchange and HttpConnection, gossipd/http/turnwrites.py.
CLIENT_WRITES = frozenset({"respond", "write_now", "write_held", "_end_turn"})


def _kind(pid: int, tid: str) -> str:
    if tid == str(pid):
        return "main"
    try:
        name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "gone"
    return "zmq_io" if name.startswith("ZMQbg/IO") else "other"


def threads_now(pids: list[int]) -> dict[str, list[int]]:
    """Per thread kind: [utime ticks, stime ticks, voluntary, involuntary switches]."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
            except OSError:
                continue
            switches = {k: int(v) for k, _, v in (line.partition(":\t") for line in status)
                        if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}  # fmt: skip
            a = out[_kind(pid, tid)]
            a[0] += int(stat[11])
            a[1] += int(stat[12])
            a[2] += switches["voluntary_ctxt_switches"]
            a[3] += switches["nonvoluntary_ctxt_switches"]
    return out


def per_thread(before: dict[str, list[int]], after: dict[str, list[int]], requests: int) -> dict:
    out = {}
    for kind, b in after.items():
        a = before.get(kind, [0, 0, 0, 0])
        d = [y - x for x, y in zip(a, b, strict=True)]
        if kind == "other" and not any(d):
            continue
        out[kind] = {
            "user_us_per_req": round(d[0] * TICK_US / requests, 1),
            "sys_us_per_req": round(d[1] * TICK_US / requests, 1),
            "voluntary_switches_per_req": round(d[2] / requests, 3),
            "involuntary_switches_per_req": round(d[3] / requests, 3),
        }
    return out


def perf_syscalls(pids: list[int], seconds: float) -> subprocess.Popen[bytes] | None:
    if shutil.which("perf") is None:
        return None
    events = [arg for s in SYSCALLS for arg in ("-e", f"syscalls:sys_enter_{s}")]
    cmd = ["perf", "stat", "-x,", "--per-thread", "-p", ",".join(map(str, pids)), *events,
           "--", "sleep", str(seconds)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def read_perf(proc: subprocess.Popen[bytes], pids: list[int], requests: int) -> dict:
    err = proc.communicate()[1].decode()
    counts: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for line in err.splitlines():
        parts = line.split(",")
        if len(parts) < 4 or not parts[1].strip().isdigit():
            continue
        name_tid = parts[0].strip().rsplit("-", 1)
        if len(name_tid) != 2 or not name_tid[1].isdigit():
            continue
        tid = name_tid[1]
        pid = next((p for p in pids if Path(f"/proc/{p}/task/{tid}").exists()), None)
        kind = "gone" if pid is None else _kind(pid, tid)
        call = parts[3].split("sys_enter_")[-1]
        counts[kind][call] = counts[kind].get(call, 0) + int(parts[1])
    return {
        kind: {c: round(n / requests, 2) for c, n in sorted(calls.items()) if n}
        for kind, calls in counts.items()
    }


def spy_layers(paths: list[Path]) -> dict[str, float]:
    """Shares of the main threads' samples by the frame on top (see the module's text)."""
    layers: collections.Counter[str] = collections.Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            # a frame reads "Class.function (path:line)"
            name, _, where = stack.split(";")[-1].partition(" (")
            function = name.rsplit(".", 1)[-1]
            if function in CLIENT_WRITES and "gossipd/http/" in where:
                layer = "client_write"
            elif function == "run" and "asyncio/runners.py" in where:
                layer = "event_loop_c"
            elif where.startswith("zmq/") or "/zmq/" in where:
                layer = "zeromq_calls"
            else:
                layer = "gossipd_python"
            layers[layer] += int(n)
    total = sum(layers.values()) or 1
    return {k: round(v / total, 3) for k, v in layers.most_common()}


def window(wrk: Wrk, urls: list[str], pids: list[int], c: int, seconds: int) -> dict[str, Any]:
    perf = perf_syscalls(pids, seconds + 1)
    time.sleep(0.3)  # perf attached before the load starts
    before = threads_now(pids)
    w: Window = wrk.run(urls, c, seconds, pids)
    after = threads_now(pids)
    out: dict[str, Any] = {
        "concurrency": c,
        "req_per_s": round(w.req_per_s),
        "cpu_us_per_req": round(w.cpu_us_per_req or 0.0, 1),
        "threads": per_thread(before, after, w.requests),
    }
    if perf is not None:
        # perf's window holds wrk's (0.3 s before it, about 0.7 after, the daemons idle then)
        out["syscalls_per_req"] = read_perf(perf, pids, w.requests)
    return out


def _spy(pid: int, out: Path, seconds: int) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [spy, "record", "-p", str(pid), "-d", str(seconds), "-r", "250", "-f", "raw",
           "-o", str(out), "--nonblocking"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def perf_dsos(data: Path) -> dict[str, float]:
    """Shares of the daemons' CPU samples by thread kind and binary ("python libpython...")."""
    out = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            str(data),
            "--no-children",
            "--sort",
            "comm,dso",
            "--stdio",
            "-g",
            "none",
        ],
        capture_output=True,
        text=True,
    ).stdout
    shares: dict[str, float] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].endswith("%"):
            comm = "zmq_io" if parts[1].startswith("ZMQbg/IO") else parts[1]
            dso = parts[2].split(".cpython")[0].split("-")[0].split(".so")[0]
            key = f"{comm} {dso}"
            shares[key] = round(shares.get(key, 0.0) + float(parts[0][:-1]) / 100, 3)
    return shares


def sampled_window(wrk: Wrk, urls: list[str], pids: list[int], c: int, seconds: int) -> dict:
    """py-spy on each daemon and perf record on both, over one more window (sampling slows
    the daemons, so its req/s is not the window's above)."""
    tmp = Path(tempfile.mkdtemp(prefix="gossipd-door-floor-"))
    outs = [tmp / f"{pid}.txt" for pid in pids]
    samplers = [_spy(pid, out, seconds + 1) for pid, out in zip(pids, outs, strict=True)]
    if shutil.which("perf") is not None:
        samplers.append(
            subprocess.Popen(
                [
                    "perf",
                    "record",
                    "-F",
                    "999",
                    "-o",
                    str(tmp / "perf.data"),
                    "-p",
                    ",".join(map(str, pids)),
                    "--",
                    "sleep",
                    str(seconds + 1),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(0.5)
    w = wrk.run(urls, c, seconds, pids)
    for s in samplers:
        s.wait()
    out: dict[str, Any] = {
        "concurrency": c,
        "req_per_s_under_sampling": round(w.req_per_s),
        "python_layers": spy_layers([o for o in outs if o.exists()]),
    }
    if (tmp / "perf.data").exists():
        out["binaries"] = perf_dsos(tmp / "perf.data")
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument(
        "--sample", action="store_true", help="also sample with py-spy and perf record"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    workdir = new_workdir()
    cluster, urls, pids = _gossipd(workdir)
    report: dict[str, Any] = {"windows": [], "sampled": []}
    try:
        wrk = Wrk(workdir)
        wrk.run(urls, 16, 2, pids)  # warm
        for c in levels:
            print(f"c={c}: {args.seconds} s of wrk", file=sys.stderr, flush=True)
            report["windows"].append(window(wrk, urls, pids, c, args.seconds))
        if args.sample:
            for c in levels:
                print(f"c={c}: a sampled window", file=sys.stderr, flush=True)
                report["sampled"].append(sampled_window(wrk, urls, pids, c, args.seconds))
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for w in report["windows"]:
        print(f"c={w['concurrency']}: {w['req_per_s']:,} req/s, {w['cpu_us_per_req']} us CPU/req")
        for kind, t in w["threads"].items():
            calls = w.get("syscalls_per_req", {}).get(kind, {})
            print(f"  {kind:7s} user {t['user_us_per_req']:5.1f} us  sys {t['sys_us_per_req']:5.1f}"
                  f" us  switches vol {t['voluntary_switches_per_req']:.2f} invol "
                  f"{t['involuntary_switches_per_req']:.2f}  syscalls {calls}")  # fmt: skip
    for s in report["sampled"]:
        print(f"c={s['concurrency']} (sampled, {s['req_per_s_under_sampling']:,} req/s)")
        print(f"  main threads' Python samples by frame on top: {s['python_layers']}")
        print(f"  CPU samples by thread and binary: {s.get('binaries', 'no perf')}")


if __name__ == "__main__":
    main()
