"""The seed registry: the leader keeps ``<prefix>/seeds`` in etcd pointing at a few live
members, and a daemon configured with etcd that knows no live member (no gossip.seeds, or
none of them answers) joins through them.

The value is JSON: ``{"seeds": ["NODE@tcp://HOST:PORT", ...], "leader": NODE, "token": N,
"updated_wall_s": T}``; seeds are chosen by core/reaping.py ``choose_seeds``.  The duty
writes it (fenced) when the choice changes, looking every ``SEEDS_TICK_S``.

Joining: ``join_through_etcd`` reads the value and hands the seeds to gossip while we know
no live member, every ``JOIN_RETRY_S`` (etcd down, no leader yet, or seeds that do not
answer: it tries again), so a daemon started with only etcd endpoints joins as soon as the
cluster has a leader that has published seeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from gossipd.config import split_seed
from gossipd.core.messages import endpoint_problem
from gossipd.core.reaping import SEEDS_MAX, SeedCandidate, choose_seeds

if TYPE_CHECKING:
    from gossipd.membership.gossip import GossipService

log = logging.getLogger("gossipd.leader.seeding")

SEEDS_KEY = "seeds"
SEEDS_TICK_S = 1.0
JOIN_RETRY_S = 1.0


class SeedsValue(msgspec.Struct, kw_only=True):
    seeds: list[str] = msgspec.field(default_factory=list)
    leader: str = ""
    token: int = 0
    updated_wall_s: float = 0.0


def seeds_key(prefix: str) -> bytes:
    return f"{prefix}/{SEEDS_KEY}".encode()


class SeedRegistry:
    def __init__(
        self,
        gossip: GossipService,
        *,
        node: str,
        status: Callable[[], str],
        wall: Callable[[], float],
    ) -> None:
        self._gossip = gossip
        self._wall = wall
        self._node = node
        self._status = status
        self.writes = 0

    def candidates(self) -> list[SeedCandidate]:
        out = [SeedCandidate(self._node, self._gossip.advertise, "alive", self._status())]
        for m in self._gossip.live_members():
            status = m.gpu.status if m.gpu is not None else ""
            out.append(SeedCandidate(m.node, m.addr, m.state, status))
        return out

    async def duty(self, ctx: Any) -> None:
        current: list[str] = []
        got = await ctx.client.get(seeds_key(ctx.prefix))
        if got is not None:
            try:
                current = msgspec.json.decode(got.value, type=SeedsValue).seeds
            except (msgspec.DecodeError, msgspec.ValidationError):
                current = []
        written: list[str] | None = None
        while True:
            if self._gossip.core is not None:
                chosen = choose_seeds(current, self.candidates())
                if chosen != written:
                    value = SeedsValue(
                        seeds=chosen,
                        leader=self._node,
                        token=ctx.token,
                        updated_wall_s=self._wall(),
                    )
                    if not await ctx.fenced_put(seeds_key(ctx.prefix), msgspec.json.encode(value)):
                        log.warning("seeds not stored: no longer the leader")
                        return
                    self.writes += 1
                    log.info("seeds published", extra={"seeds": chosen, "token": ctx.token})
                    current = written = chosen
            await asyncio.sleep(SEEDS_TICK_S)


async def read_seeds(get: Callable[[bytes], Awaitable[Any]], prefix: str) -> list[str]:
    """The published seeds ([] when none are, or the value is unreadable)."""
    got = await get(seeds_key(prefix))
    if got is None:
        return []
    try:
        seeds = msgspec.json.decode(got.value, type=SeedsValue).seeds[: 4 * SEEDS_MAX]
    except (msgspec.DecodeError, msgspec.ValidationError):
        log.warning("seeds in etcd unreadable; ignored")
        return []
    # Only addresses a socket connects to (as gossip requires of every address it names).
    usable = [seed for seed in seeds if endpoint_problem(split_seed(seed)[1]) is None]
    if len(usable) < len(seeds):
        log.warning("seeds in etcd that are no address were ignored",
                    extra={"ignored": len(seeds) - len(usable)})  # fmt: skip
    return usable


async def join_through_etcd(
    get: Callable[[bytes], Awaitable[Any]],
    prefix: str,
    gossip: GossipService,
    *,
    configured: list[str] | None = None,
) -> None:
    """While we know no live member, take the seeds from etcd (runs for the daemon's life:
    a daemon cut off from every member later finds its way back the same way), beside the
    ``configured`` ones (gossip.seeds), which are kept: a member whose configured seeds are
    all down, or that joined through one seed that died before it met the others, finds the
    cluster through etcd."""
    configured = configured or []
    said = False
    last: list[str] = []
    while True:
        core = gossip.core
        if core is not None and core.table.live_count() <= 1:
            try:
                seeds = await read_seeds(get, prefix)
            except Exception as exc:  # etcd down or unreachable: try again
                seeds = []
                if not said:
                    log.warning("cannot read the seeds from etcd yet", extra={"error": str(exc)})
                    said = True
            seeds = [
                s for s in seeds if not s.startswith(f"{gossip.node}@") and s not in configured
            ]
            if seeds:
                if seeds != last:
                    log.info("joining through seeds from etcd", extra={"seeds": seeds})
                    last = seeds
                gossip.set_seeds(configured + seeds)  # a push-pull with each, now
        await asyncio.sleep(JOIN_RETRY_S)
