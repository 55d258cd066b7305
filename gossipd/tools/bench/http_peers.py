"""The moving parts of `gossipd bench http`: the stub engines, the routers it compares with
(vllm-router, sglang-router: Rust, from PyPI, in a venv of their own), the load generator
(wrk, Debian package ``wrk``) and the CPU each process spends (/proc/PID/stat).

Router launch flags, found with ``--help`` and by running them against the stub:
- both wait for their workers at start-up, polling every ``--worker-startup-check-interval``
  seconds (default 30: set to 1), and check ``GET /health`` every 60 s afterwards;
- both serve Prometheus on port 29000 by default: each gets a free port, so two can run;
- sglang-router asks each worker for ``/server_info`` and ``/model_info`` (then the older
  ``/get_*`` names) and, when one names a model path, downloads that model's tokenizer from
  Hugging Face (its Rust code ignores HF_HUB_OFFLINE).  The stub answers those with 404, so
  nothing is fetched ("No tokenizer_path or model_path found").  vllm-router asks for
  ``/health`` only.  HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 are set anyway;
- ``--log-level error``: both log each request at INFO (sglang-router "started processing
  request" / "finished processing request"), and gossipd at its default level logs nothing
  per request: with theirs off, no variant writes a line a request (and the warnings about
  the stub's missing info endpoints are noise).
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossipd.tools.launcher import free_tcp_port

BODY = '{"model":"echo","prompt":"hello world","max_tokens":1}'

# One Lua script for every variant: the same POST, an x-session-id from 4,096 keys per wrk
# process (the placement key of gossipd and of vllm-router's consistent_hash; round_robin
# ignores it), and a JSON line of wrk's own figures at the end (latency percentiles in us).
WRK_LUA = """
local body = '@BODY@'
local prefix = "s"
local n = 0
local keys = nil
function init(args)
  if args[1] then prefix = args[1] end
  if args[2] then  -- a file of keys, one a line: these, in turn, instead of PREFIX..n
    keys = {}
    for line in io.lines(args[2]) do keys[#keys + 1] = line end
  end
end
function request()
  n = n + 1
  local key = keys and keys[(n % #keys) + 1] or prefix .. (n % 4096)
  return wrk.format("POST", "/v1/completions",
    {["Content-Type"] = "application/json", ["x-session-id"] = key}, body)
end
function done(summary, latency, requests)
  local e = summary.errors
  -- the latency at every 0.1% (q = 0.1 .. 99.9): what pooling several processes needs
  local grid = {}
  for k = 1, 999 do grid[k] = string.format("%d", latency:percentile(k / 10)) end
  io.write(string.format('WRKJSON {"requests":%d,"duration_us":%d,"p50_us":%d,' ..
    '"p99_us":%d,"status":%d,"connect":%d,"read":%d,"write":%d,"timeout":%d,' ..
    '"per_mille_us":[%s]}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect, e.read, e.write, e.timeout, table.concat(grid, ",")))
end
""".replace("@BODY@", BODY)

ROUTER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1"}


def default_router_venv() -> Path:
    env = os.environ.get("GOSSIPD_ROUTER_VENV")
    return Path(env) if env else Path.home() / ".cache" / "gossipd" / "routers-venv"


@dataclass(frozen=True)
class Router:
    """One router variant: a package in the router venv, how to start it with a policy."""

    package: str  # on PyPI
    policy: str

    @property
    def name(self) -> str:
        return f"{self.package}:{self.policy}"

    def command(self, venv: Path, port: int, workers: list[str]) -> list[str]:
        common = [
            "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", self.policy, "--prometheus-port", str(free_tcp_port()),
            "--prometheus-host", "127.0.0.1", "--worker-startup-check-interval", "1",
            "--log-level", "error",
        ]  # fmt: skip
        if self.package == "vllm-router":
            return [str(venv / "bin" / "vllm-router"), *common]
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common]

    def version(self, venv: Path) -> str:
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c",
             f"import importlib.metadata as m; print(m.version({self.package!r}))"],
            capture_output=True, text=True,
        )  # fmt: skip
        return out.stdout.strip() or "?"

    def missing(self, venv: Path) -> str | None:
        """Why it cannot run (with the pip command that installs it), or None."""
        module = self.package.replace("-", "_")
        py = venv / "bin" / "python"
        install = f"python3 -m venv {venv} && {py} -m pip install {self.package}"
        if not py.exists():
            return f"no router venv at {venv}: {install}"
        found = subprocess.run(
            [str(py), "-c", f"import importlib.util as u; print(bool(u.find_spec({module!r})))"],
            capture_output=True,
            text=True,
        )
        if found.stdout.strip() != "True":
            return f"{self.package} is not installed in {venv}: {install}"
        return None


ROUTERS = [
    Router("vllm-router", "round_robin"),
    Router("vllm-router", "consistent_hash"),
    Router("sglang-router", "round_robin"),
]


def routers_of(peers: str) -> list[Router]:
    """``--peers`` for http: all (or routers): every router; else one package's variants."""
    if peers in ("all", "routers"):
        return list(ROUTERS)
    return [r for r in ROUTERS if r.package == peers]


class Processes:
    """Child processes (stubs, routers) with their logs in one folder; ``stop`` ends them all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> int:
        log = (self.workdir / f"{name.replace(':', '-')}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        log.close()
        return self.procs[name].pid

    def log_tail(self, name: str) -> str:
        path = self.workdir / f"{name.replace(':', '-')}.log"
        try:
            return path.read_text(errors="replace")[-1500:]
        except FileNotFoundError:
            return ""

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_stub(procs: Processes, name: str) -> tuple[str, int]:
    """A stub engine: (its URL, its pid)."""
    port = free_tcp_port()
    cmd = [sys.executable, "-m", "gossipd.tools.bench.http_stub", "--port", str(port)]
    return f"http://127.0.0.1:{port}", procs.start(name, cmd)


def completion_request(url: str, headers: dict[str, str] | None = None) -> urllib.request.Request:
    """The bench's POST /v1/completions (``BODY``) through ``url``, with ``headers`` too."""
    return urllib.request.Request(
        f"{url}/v1/completions",
        data=BODY.encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )


def keys_by_path(url: str, entry: str, n: int) -> tuple[list[str], list[str]]:
    """``n`` session keys (p0, p1, ...) sorted by where gossipd ran them, each sent once through
    ``url``, the door of member ``entry``: (those run there, those forwarded).  Where a key
    runs is read from the answer's x-gossipd-member header, not computed: what the daemons
    did, whatever the ring says."""
    local: list[str] = []
    forwarded: list[str] = []
    for i in range(n):
        key = f"p{i}"
        req = completion_request(url, {"x-session-id": key})
        with urllib.request.urlopen(req, timeout=5) as resp:
            member = resp.headers.get("x-gossipd-member", "")
            resp.read()
        if not member:
            raise RuntimeError(f"{url} answered without an x-gossipd-member header")
        (local if member == entry else forwarded).append(key)
    return local, forwarded


def wait_serving(url: str, timeout_s: float, *, headers: dict[str, str] | None = None) -> None:
    """Until one POST /v1/completions through ``url`` answers 200 (TimeoutError if not)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        req = completion_request(url, headers)
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    json.loads(resp.read())
                    return
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer POST /v1/completions with 200: {last}")


# -- CPU from /proc ----------------------------------------------------------------------------

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
    return out


def cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes and their descendants (every thread, /proc/PID/stat),
    and of the children each has waited for (cutime + cstime: a child that ended inside a
    window moved its CPU there, all of it).  A process of ``pids`` that is gone raises: its
    CPU would read as 0 and the window's difference would be wrong."""
    total = 0
    for root in pids:
        for pid in _descendants(root):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                if pid == root:
                    raise RuntimeError(f"process {root} ended while its CPU was measured") from None
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": field 3 is fields[0]
            # utime, stime, cutime, cstime: fields 14-17
            total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total * _TICK_S


# -- the load generator --------------------------------------------------------------------------


@dataclass
class Window:
    """One measured window of one variant at one concurrency."""

    requests: int  # answered 2xx/3xx (wrk's count less its status errors)
    seconds: float
    p50_us: float
    p99_us: float
    errors: int
    cpu_s: float  # of the routing layer over the window
    engine_cpu_s: float = 0.0  # of the stub engines behind it (none for gossipd: in-process)

    @property
    def req_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_req(self) -> float | None:
        return self.cpu_s * 1e6 / self.requests if self.requests else None


def wrk_available() -> str | None:
    """None, or why wrk cannot run."""
    if shutil.which("wrk") is None:
        return "wrk is not installed (Debian: apt-get install wrk)"
    return None


def split_load(entry_points: int, connections: int) -> list[tuple[int, int]]:
    """(wrk threads, connections) per wrk process: one process per entry point (wrk takes
    one host; at concurrency 1 the first only), the connections split evenly, 2 threads in
    all (1 at concurrency 1) so that every variant gets the same generator."""
    n = min(entry_points, connections)
    conns = [connections // n + (1 if i < connections % n else 0) for i in range(n)]
    threads = max(1, min(2, connections) // n)
    # wrk gives each thread connections // threads: an odd count on 2 threads would open one
    # connection fewer than asked, so that process runs on one thread.
    return [(threads if c % threads == 0 else 1, c) for c in conns]


class Wrk:
    """Runs wrk with the bench's Lua script; several processes at once for several entry
    points (wrk takes one host), the connections and threads split between them."""

    def __init__(self, workdir: Path) -> None:
        self.script = workdir / "post.lua"
        self.script.write_text(WRK_LUA)

    def run(
        self,
        urls: list[str],
        connections: int,
        seconds: int,
        cpu_pids: list[int],
        engine_pids: Sequence[int] = (),
        keys_file: Path | None = None,
    ) -> Window:
        """``keys_file``: the session keys to send, one a line, in turn (else w<i>-<n>)."""
        procs = []
        cpu0, eng0 = cpu_s(cpu_pids), cpu_s(list(engine_pids))
        for i, (threads, conns) in enumerate(split_load(len(urls), connections)):
            cmd = [
                "wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds}s", "--timeout", "5s",
                "-s", str(self.script), urls[i], "--", f"w{i}-",
            ]  # fmt: skip
            if keys_file is not None:
                cmd.append(str(keys_file))
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        try:
            outs = [p.communicate(timeout=seconds + 30) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:  # none left running behind the bench
                p.kill()
                p.wait()
            raise RuntimeError(f"wrk did not end within {seconds + 30} s") from None
        cpu1, eng1 = cpu_s(cpu_pids), cpu_s(list(engine_pids))
        figs: list[dict[str, Any]] = []
        for p, (out, err) in zip(procs, outs, strict=True):
            line = next((x for x in out.decode().splitlines() if x.startswith("WRKJSON ")), None)
            if p.returncode != 0 or line is None:
                raise RuntimeError(f"wrk failed ({p.returncode}): {err.decode()[-500:]}")
            figs.append(json.loads(line[len("WRKJSON ") :]))
        # wrk counts a response of status 400 or more as a request too (and as a status
        # error): a fast refusal is no request served, so it counts in neither req/s nor
        # the CPU a request.
        requests = sum(f["requests"] - f["status"] for f in figs)
        return Window(
            requests=requests,
            seconds=max(f["duration_us"] for f in figs) / 1e6,
            p50_us=pooled_percentile(figs, 500),
            p99_us=pooled_percentile(figs, 990),
            errors=sum(
                f[k] for f in figs for k in ("status", "connect", "read", "write", "timeout")
            ),
            cpu_s=cpu1 - cpu0,
            engine_cpu_s=eng1 - eng0,
        )


def pooled_percentile(figs: Sequence[dict[str, Any]], per_mille: int) -> float:
    """The latency at ``per_mille`` (500: the p50) of the requests of several wrk processes
    together, from each one's latency at every 0.1% (``per_mille_us``) and its request
    count.  A weighted mean of their own percentiles is not one: a process of fast answers
    beside one of slow answers has its median between the two, where no request may be.
    A process's share of requests at or below v is taken as the last 0.1% step whose latency
    is <= v, so one process alone gives wrk's own figure."""
    total = sum(f["requests"] for f in figs)
    if not total:
        return 0.0
    need = per_mille * total
    for v in sorted({v for f in figs for v in f["per_mille_us"]}):
        below = sum(f["requests"] * bisect.bisect_right(f["per_mille_us"], v) for f in figs)
        if below >= need:
            return float(v)
    return float(max(f["per_mille_us"][-1] for f in figs))


def new_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="gossipd-bench-http-"))
