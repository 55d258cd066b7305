"""SIGKILL of a key's owners mid-flight costs the producer latency, never a final error.

The entry daemon forwards a keyed task down the key's placement order, at most
``fanout.attempts_max`` members, each given ``fanout.ack_timeout_s``.  Members killed but not
yet declared dead (failure detection takes seconds when the dead host's ports do not refuse)
eat those attempts, and the entry answers ``unavailable`` while live members remain.  That
answer means "later" (docs/PROTOCOL.md, "Error codes"): gossipd's Client resubmits it, same id,
after its ``retry_after_ms`` while the deadline allows, and the retry is placed on what
membership then knows.  Before that rule the Client took ``unavailable`` as final (the
multi-host bed lost one task of 12,000 that way in its ``kill`` fault).
"""

from __future__ import annotations

import asyncio
import time

from gossipd.core.messages import Result
from gossipd.core.ring import Ring, key_hash
from gossipd.tools.client import Client
from simulations.cluster import Cluster

NAMES = ["d00", "d01", "d02", "d03"]
VICTIMS = ("d01", "d02")
SPACING_S = 0.02  # 50 keyed tasks a second, all through d00


def _keys_owned_by_victims(n: int) -> list[str]:
    """Keys whose first two members in placement order are d01 then d02: with
    ``attempts_max = 2`` the entry d00 tries only the two victims."""
    ring = Ring(dict.fromkeys(NAMES, 1.0))
    out = []
    for key in (f"session-{i}" for i in range(5000)):
        top = [ring.members[i] for i in ring.top(key_hash(key), 2)]
        if tuple(top) == VICTIMS:
            out.append(key)
            if len(out) == n:
                break
    assert len(out) == n
    return out


def test_killing_a_keys_owners_mid_flight_loses_no_task(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cluster = Cluster(
        len(NAMES),
        log_dir=str(tmp_path),
        extra_overrides=[
            "engine.token_delay_s=0.05",  # 4 tokens: tasks run 0.2 s, some in flight at the kill
            "fanout.attempts_max=2",
            # Detection by suspicion only (a host whose ports stop answering, not refusing):
            # seconds during which the victims still look alive to d00.
            "gossip.swim.crash_by_refusal=false",
        ],
    )
    results: dict[str, Result] = {}
    try:
        cluster.start()
        cluster.wait_converged(timeout_s=30)
        cluster.wait_meta(timeout_s=30)
        keys = _keys_owned_by_victims(20)
        entry = cluster.daemons[0]

        async def main() -> tuple[int, float]:
            async with Client([entry.endpoint], resubmit_after_s=30) as client:
                waiters = []

                async def one(i: int) -> None:
                    handle = await client.submit(
                        f"t{i}", key=keys[i % len(keys)], max_tokens=4, timeout_s=30
                    )
                    results[handle.id] = await handle.result()

                killed_at = 0.0
                for i in range(200):  # 1 s before the kill, 3 s after
                    if i == 50:
                        for d in cluster.daemons[1:3]:
                            d.kill()
                        killed_at = time.monotonic()
                    waiters.append(asyncio.create_task(one(i)))
                    await asyncio.sleep(SPACING_S)
                await asyncio.gather(*waiters)
                return client.statistics().retried, killed_at

        retried, killed_at = asyncio.run(main())
        dead_at = _declared_dead_at(entry, VICTIMS)
    finally:
        cluster.stop()
    failed = {tid: (r.error.code, r.node, r.error.message) for tid, r in results.items() if r.error}
    assert len(results) == 200
    assert not failed, f"{len(failed)} tasks failed, e.g. {next(iter(failed.values()))}"
    assert "d01" in {r.node for r in results.values()}, "the keys ran on their owner before"
    # The window the test is about was there: d00 saw the victims alive for a while after the
    # kill (its forwards to them went unanswered), and the unavailable answers were retried.
    print(
        f"d00 declared the victims dead {dead_at - killed_at:.2f} s after the kill; "
        f"{retried} answers retried"
    )
    assert retried > 0


def _declared_dead_at(entry, victims: tuple[str, ...]) -> float:  # type: ignore[no-untyped-def]
    """When (monotonic, from the log's wall clock) d00 declared the last victim dead."""
    wall = [
        e["ts"]
        for e in entry.events()
        if e.get("msg") == "member" and e.get("event") == "dead" and e.get("member") in victims
    ]
    assert len(wall) >= len(victims), "d00 declared both victims dead"
    return max(wall) - time.time() + time.monotonic()
