"""A daemon's RSS through bursts of large prompts from an authorised CURVE producer (issue 24,
finding 6; docs/OPERATIONS.md "Memory budgets").

    PYTHONPATH=$PWD python scripts/memory_bursts.py [--bursts 5] [--tasks 150] [--json]

Starts one echo daemon with CURVE and small byte budgets (pending 32 MiB, results cache 16,
reply queues 16), then sends ``--bursts`` bursts of ``--tasks`` prompts of 900 KB each, all
at once, and waits for every Result. After each burst it prints the peak RSS during the
burst and the RSS settled (no longer falling) after it, with the daemon's byte gauges.
``--set KEY=VALUE`` passes more daemon overrides; ``--env NAME=VALUE`` sets its environment.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack
import zmq

from gossipd.ops.scrape import scrape
from gossipd.tools.curvekeys import CurveLayout
from gossipd.tools.launcher import DaemonProcess

MIB = 1024 * 1024
WORD = "x" * 10_000
PROMPT = " ".join([WORD] * 90)  # 900 KB
BUDGETS = {
    "pending_bytes_max": 32 * MIB,
    "results_cache_bytes_max": 16 * MIB,
    "reply_queue_bytes_max": 16 * MIB,
}
GAUGES = (
    "gossipd_tasks_pending_bytes",
    "gossipd_results_cached_bytes",
    "gossipd_replies_queued_bytes",
)


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def where_mib(pid: int) -> dict[str, float]:
    """Resident memory by kind of mapping (/proc/PID/smaps): the main heap ([heap]: brk),
    other anonymous mappings (malloc's mmaps and its thread arenas, libzmq's buffers), and
    files (code, libraries)."""
    out = {"heap": 0.0, "anon": 0.0, "anon_large": 0.0, "files": 0.0}
    kind = "files"
    size_kb = 0
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                start, end = (int(x, 16) for x in head[0].split("-"))
                size_kb = (end - start) // 1024
                name = head[5] if len(head) > 5 else ""
                kind = "heap" if name == "[heap]" else "anon" if not name else "files"
            elif head[0] == "Rss:":
                mib = int(head[1]) / 1024
                out[kind] += mib
                if kind == "anon" and size_kb >= 1024:
                    out["anon_large"] += mib
    return {k: round(v, 1) for k, v in out.items()}


def reset_peak(pid: int) -> None:
    """VmHWM from now on (``5`` in clear_refs resets the peak RSS; Linux 4.0+)."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def settled_mib(pid: int, *, quiet_s: float = 1.0, timeout_s: float = 10.0) -> float:
    """RSS once it has not fallen by more than 1 MiB for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    low = rss_mib(pid)
    since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = rss_mib(pid)
        if now < low - 1:
            low, since = now, time.monotonic()
    return rss_mib(pid)


class Producer:
    """An authorised producer with plain pyzmq + msgpack over CURVE."""

    def __init__(
        self, endpoint: str, pair: tuple[bytes, bytes] | None, server_key: bytes | None
    ) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.push = self.ctx.socket(zmq.PUSH)
        if pair is not None:
            self.pull.curve_server = True
            self.pull.curve_publickey, self.pull.curve_secretkey = pair
            self.push.curve_publickey, self.push.curve_secretkey = pair
            self.push.curve_serverkey = server_key
        self.reply_to = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(endpoint)

    def send(self, task_id: str, prompt: str, max_tokens: int) -> None:
        task = {
            "v": 1,
            "t": 1,
            "id": task_id,
            "prompt": prompt,
            "reply_to": self.reply_to,
            "params": {"max_tokens": max_tokens},
        }
        self.push.send(msgpack.packb(task))

    def results(self, ids: set[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < len(ids) and time.monotonic() < deadline:
            if self.pull.poll(100):
                msg = msgpack.unpackb(self.pull.recv())
                if msg["t"] == 3 and msg["id"] in ids:
                    out[msg["id"]] = msg
        return out

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


def run_bursts(
    *,
    bursts: int = 5,
    tasks: int = 150,
    max_tokens: int = 16,
    curve: bool = True,
    overrides: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | Path | None = None,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Run the bursts against a fresh daemon; the figures, in MiB."""
    with tempfile.TemporaryDirectory(prefix="gossipd-mem-") as tmp:
        layout = CurveLayout(Path(tmp) / "keys", nodes=["m0"], producers=["p"])
        daemon = DaemonProcess(
            overrides=[
                *(layout.overrides("m0") if curve else []),
                'node.id="m0"',
                'metrics.bind="127.0.0.1:0"',
                *(f"ingress.{k}={v}" for k, v in BUDGETS.items()),
                *(overrides or []),
            ],
            env=env,
            log_dir=log_dir or tmp,
            name="m0",
        )
        daemon.start()
        producer = (
            Producer(daemon.endpoint, layout.pair("p"), layout.public("m0"))
            if curve
            else Producer(daemon.endpoint, None, None)
        )
        try:
            producer.send("warm", "a b", 2)
            if not producer.results({"warm"}, 20):
                raise RuntimeError(f"no answer from the daemon; its log: {daemon.log_path}")
            baseline = settled_mib(daemon.pid)
            rows = []
            for b in range(bursts):
                reset_peak(daemon.pid)
                ids = {f"b{b}-{i}" for i in range(tasks)}
                started = time.monotonic()
                for task_id in sorted(ids):
                    producer.send(task_id, PROMPT, max_tokens)
                results = producer.results(ids, timeout_s)
                elapsed_s = time.monotonic() - started
                settled = settled_mib(daemon.pid)
                metrics = scrape(daemon.metrics_port)
                codes: dict[str, int] = {}
                for r in results.values():
                    code = "ok" if r["ok"] else r["error"]["code"]
                    codes[code] = codes.get(code, 0) + 1
                rows.append(
                    {
                        "burst": b + 1,
                        "peak_mib": round(rss_mib(daemon.pid, "VmHWM"), 1),
                        "settled_mib": round(settled, 1),
                        "answered": len(results),
                        "codes": codes,
                        "seconds": round(elapsed_s, 1),
                        "where_mib": where_mib(daemon.pid),
                        **{g.removeprefix("gossipd_"): metrics.get(g, 0.0) for g in GAUGES},
                    }
                )
        finally:
            producer.close()
            daemon.stop(timeout_s=15)
    cache_mib = BUDGETS["results_cache_bytes_max"] / MIB
    return {
        "baseline_mib": round(baseline, 1),
        "bound_mib": round(baseline + cache_mib + 20, 1),
        "budgets_mib": {k: v / MIB for k, v in BUDGETS.items()},
        "curve": curve,
        "tasks": tasks,
        "prompt_bytes": len(PROMPT),
        "max_tokens": max_tokens,
        "bursts": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--plain", action="store_true", help="without CURVE")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    out = run_bursts(
        bursts=args.bursts,
        tasks=args.tasks,
        max_tokens=args.max_tokens,
        curve=not args.plain,
        overrides=args.set,
        env=env,
    )
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"baseline {out['baseline_mib']} MiB, bound {out['bound_mib']} MiB")
    for row in out["bursts"]:
        print(
            f"burst {row['burst']}: peak {row['peak_mib']} MiB, settled {row['settled_mib']} MiB,"
            f" {row['codes']} in {row['seconds']} s; pending {row['tasks_pending_bytes']:.0f} B,"
            f" cached {row['results_cached_bytes'] / MIB:.1f} MiB,"
            f" queued {row['replies_queued_bytes']:.0f} B; {row['where_mib']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
