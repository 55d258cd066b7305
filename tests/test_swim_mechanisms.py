"""The SWIM mechanisms one at a time (probing.py, dissemination.py, antientropy.py), on a few
SwimNodes joined by a lossless 1 ms wire that records every datagram: early probes, round-robin
probing, confirmation probes, relay bounds, metadata and re-announcements, joining, a member
alone.  Each test names the rule of the module's head comment it checks."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

import pytest

from gossipd.core.gossip_messages import (
    Alive,
    Dead,
    GossipMessage,
    GossipOnly,
    GpuState,
    Left,
    Meta,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Suspect,
    decode_gossip,
    encode_gossip,
)
from gossipd.core.membership import State
from gossipd.core.swim import SwimNode
from gossipd.core.swim_config import SwimConfig

LATENCY_S = 0.001


def addr_of(name: str) -> str:
    return f"tcp://{name}:7946"


class Wire:
    """SwimNodes on a lossless wire with fixed latency.  A member in ``down`` neither runs
    nor sends nor receives (crashed).  ``sent`` records (time, sender, destination, message)."""

    def __init__(
        self, names: list[str], *, config: SwimConfig | None = None, seed: int = 0
    ) -> None:
        self.config = config or SwimConfig.sim()
        self.rng = random.Random(seed)
        self.now = 0.0
        self.nodes: dict[str, SwimNode] = {}
        self.down: set[str] = set()
        self.sent: list[tuple[float, str, str, GossipMessage]] = []
        self._queue: list[tuple[float, int, str, bytes]] = []
        self._n = 0
        for name in names:
            self.add(name)
        pairs = [(n, addr_of(n)) for n in names]
        for node in self.nodes.values():
            node.bootstrap(0.0, pairs)

    def add(self, name: str, seeds: tuple[str, ...] = ()) -> SwimNode:
        node = SwimNode(
            self.config,
            node=name,
            addr=addr_of(name),
            rng=random.Random(self.rng.getrandbits(64)),
            now=self.now,
            seeds=seeds,
        )
        self.nodes[name] = node
        return node

    def _flush(self, node: SwimNode) -> None:
        for addr, data in node.take_outbox():
            msg = decode_gossip(data, bytes_max=self.config.message_bytes_max)
            self.sent.append((self.now, node.node, addr, msg))
            dst = addr.removeprefix("tcp://").removesuffix(":7946")
            if node.node not in self.down and dst not in self.down:
                self._n += 1
                heapq.heappush(self._queue, (self.now + LATENCY_S, self._n, dst, data))

    def inject(self, dst: str, msg: GossipMessage) -> None:
        """Deliver a hand-made message to ``dst`` now."""
        self.nodes[dst].receive(self.now, encode_gossip(msg))
        self._flush(self.nodes[dst])

    def flush_all(self) -> None:
        for node in self.nodes.values():
            self._flush(node)

    def run_until(self, t_end: float, stop: Callable[[], bool] = lambda: False) -> None:
        while not stop():
            up = [n for name, n in sorted(self.nodes.items()) if name not in self.down]
            tick_at = min((n.next_deadline() for n in up), default=float("inf"))
            deliver_at = self._queue[0][0] if self._queue else float("inf")
            at = max(min(tick_at, deliver_at), self.now)
            if at > t_end:
                break
            self.now = at
            if deliver_at <= tick_at:
                _, _, dst, data = heapq.heappop(self._queue)
                if dst in self.nodes and dst not in self.down:
                    self.nodes[dst].receive(at, data)
                    self._flush(self.nodes[dst])
                continue
            for node in up:
                if node.next_deadline() <= at:
                    node.tick(at)
                    self._flush(node)
        if not stop():
            self.now = t_end

    def probes_by(self, src: str, since: float = 0.0) -> list[tuple[float, str]]:
        """(time, target) of each probe ``src`` started (its first ping of each seq)."""
        seen: set[int] = set()
        out = []
        for at, who, _, msg in self.sent:
            if who == src and at >= since and isinstance(msg, Ping) and msg.seq not in seen:
                seen.add(msg.seq)
                out.append((at, msg.target))
        return out


def hdr(src: str) -> dict[str, object]:
    return {"cluster": "default", "src": src, "src_addr": addr_of(src)}


# -- probing.py ----------------------------------------------------------------------------


def test_probe_soon_probes_that_member_at_once_but_once_per_interval_at_most() -> None:
    """probing rule 3: a hint replaces the next target, at most once per member per interval."""
    wire = Wire(["a", "b", "c", "d", "e"], seed=1)
    wire.run_until(3.05)
    a = wire.nodes["a"]
    assert a.next_deadline() > 3.05 + 2 * LATENCY_S, "no probe of a's in flight here"
    a.probe_soon(3.05, "d")
    wire.run_until(3.06)
    assert wire.probes_by("a", since=3.05) == [(3.05, "d")]
    # Again within the interval: ignored, a probes on its own schedule (one per interval).
    wire.run_until(3.5)
    a.probe_soon(3.5, "d")
    wire.run_until(4.06)
    assert [at for at, _ in wire.probes_by("a", since=3.06)] == [4.05]
    # Unknown or departed members are never probed on a hint.
    wire.run_until(4.5)
    a.probe_soon(4.5, "nobody")
    wire.run_until(5.0)
    assert wire.probes_by("a", since=4.06) == []
    # After a whole interval, a new hint is taken.
    wire.run_until(5.06)
    a.probe_soon(5.06, "d")
    wire.run_until(5.07)
    assert wire.probes_by("a", since=5.06) == [(5.06, "d")]


def test_round_robin_probing_probes_each_member_once_per_round_and_skips_the_departed() -> None:
    """probing rule 2 without coordinated probing: a shuffled round robin over live members."""
    wire = Wire(["a", "b", "c", "d", "e"], config=SwimConfig.sim(coordinated_probing=False))
    wire.run_until(8.0)
    targets = [t for _, t in wire.probes_by("a")]
    assert len(targets) >= 8
    for r in range(2):
        assert sorted(targets[4 * r : 4 * r + 4]) == ["b", "c", "d", "e"], targets
    wire.run_until(8.0 + 1.5)  # mid-round: e is still on a's list of this round
    wire.nodes["e"].leave(wire.now)
    wire.flush_all()
    left_at = wire.now
    wire.run_until(16.0)
    assert wire.nodes["a"].table.members["e"].state is State.LEFT
    after = [t for _, t in wire.probes_by("a", since=left_at + 0.1)]
    assert len(after) >= 6 and set(after) == {"b", "c", "d"}


def _suspect_x_at_b(wire: Wire, accuser: str) -> None:
    """b hears from a that ``accuser`` suspects x (a new suspicion to b)."""
    news = Suspect(node="x", incarnation=0, by=accuser)
    wire.inject("b", GossipOnly(**hdr("a"), updates=[news]))  # type: ignore[arg-type]


def _suspects_sent_by_b(wire: Wire, since: float) -> list[tuple[str, Suspect]]:
    return [
        (dst, u)
        for at, who, dst, msg in wire.sent
        if who == "b" and at >= since
        for u in msg.updates
        if isinstance(u, Suspect) and u.node == "x" and u.by == "b"
    ]


def test_a_confirmation_probe_that_fails_confirms_to_the_accuser_directly() -> None:
    """probing rule 5 (with 4 members the probability is 1) and membership rule 4."""
    wire = Wire(["a", "b", "c", "x"], seed=2)
    wire.run_until(1.0)
    wire.down.add("x")
    t0 = wire.now
    _suspect_x_at_b(wire, accuser="a")
    pings = [m for _, who, dst, m in wire.sent[-3:] if who == "b" and isinstance(m, Ping)]
    assert [p.target for p in pings] == ["x"]
    assert any(isinstance(u, Suspect) and u.node == "x" for u in pings[0].updates), "buddy"
    deadline = t0 + wire.config.probe_deadline_s
    wire.run_until(deadline + 0.01)
    confirmations = _suspects_sent_by_b(wire, since=t0)
    assert confirmations and confirmations[0][0] == addr_of("a")
    assert wire.nodes["b"].stats.confirm_probes == 1


def test_a_confirmation_probe_that_is_acked_confirms_nothing_and_the_suspect_refutes() -> None:
    wire = Wire(["a", "b", "c", "x"], seed=2)
    wire.run_until(1.0)
    t0 = wire.now
    _suspect_x_at_b(wire, accuser="a")
    wire.run_until(t0 + 2 * wire.config.probe_deadline_s)
    assert _suspects_sent_by_b(wire, since=t0) == []
    x_at_b = wire.nodes["b"].table.members["x"]
    assert (x_at_b.state, x_at_b.incarnation) == (State.ALIVE, 1)
    assert wire.nodes["x"].stats.refutations == 1


def test_a_confirmation_for_an_accuser_we_do_not_know_goes_nowhere() -> None:
    wire = Wire(["a", "b", "c", "x"], seed=2)
    wire.run_until(1.0)
    wire.down.add("x")
    t0 = wire.now
    _suspect_x_at_b(wire, accuser="ghost")
    wire.run_until(t0 + wire.config.probe_deadline_s + 0.01)
    assert wire.nodes["b"].stats.confirm_probes == 1
    assert _suspects_sent_by_b(wire, since=t0) == []


def test_a_member_relays_at_most_relays_max_ping_reqs_and_nacks_each_it_relayed() -> None:
    wire = Wire(["a", "b", "x"], config=SwimConfig.sim(relays_max=2))
    wire.run_until(1.0)
    wire.down.add("x")
    t0 = wire.now
    for seq in (101, 102, 103):
        wire.inject("b", PingReq(**hdr("a"), seq=seq, target="x", target_addr=addr_of("x")))  # type: ignore[arg-type]
    relayed = [m for at, who, dst, m in wire.sent if at >= t0 and who == "b"]
    assert [(type(m), m.target) for m in relayed] == [(Ping, "x"), (Ping, "x")]  # type: ignore[union-attr]
    wire.run_until(t0 + wire.config.probe_timeout_s + 0.01)
    nacks = [(dst, m.seq) for at, who, dst, m in wire.sent if who == "b" and isinstance(m, Nack)]
    assert nacks == [(addr_of("a"), 101), (addr_of("a"), 102)]


# -- dissemination.py and antientropy.py ---------------------------------------------------

GPU = GpuState(model="tiny", memory_total_mb=80_000, running_requests=2)


def test_gpu_state_rides_piggyback_to_every_member() -> None:
    """dissemination rule 1 and 3: metadata is not urgent, it rides on probes and acks."""
    wire = Wire(["a", "b", "c"], seed=3)
    wire.run_until(1.0)
    wire.nodes["a"].set_gpu(1.0, GPU)
    assert not any(isinstance(m, GossipOnly) for _, who, _, m in wire.sent if who == "a")
    wire.run_until(4.0)
    for name in ("b", "c"):
        member = wire.nodes[name].table.members["a"]
        assert (member.gpu, member.meta_version) == (GPU, 1)


def test_a_joining_member_learns_gpu_state_from_the_seeds_push_pull_reply() -> None:
    """antientropy rules 2 and 5: the reply's record of its sender carries its GPU state."""
    wire = Wire(["a", "b"], seed=4)
    wire.nodes["a"].set_gpu(0.0, GPU)
    wire.run_until(2.0)
    n = wire.add("n", seeds=(addr_of("a"),))
    assert not n.joined
    wire.run_until(3.0, stop=lambda: n.joined)
    assert n.stats.received == {"PushPull": 1}, "joined on the seed's reply alone"
    replies = [m for _, _, dst, m in wire.sent if dst == addr_of("n") and isinstance(m, PushPull)]
    assert len(replies) == 1 and not replies[0].reply and replies[0].updates == []
    member = n.table.members["a"]
    assert (member.gpu, member.meta_version) == (GPU, 1)
    assert set(n.table.members) == {"a", "b"}


def test_a_lone_member_sets_no_deadline_until_it_has_someone_to_tell() -> None:
    """A member alone sleeps (issue 25): its urgent update (its own Alive) schedules no
    gossip round while no other member is live (the daemon's loop waits on next_deadline);
    once one joins, the round is due at once and its metadata goes out."""
    wire = Wire([], seed=7)
    n = wire.add("n")
    n.set_gpu(0.0, GPU)
    assert n.dissemination.broadcasts.urgent_pending
    assert n.dissemination.next_deadline() == float("inf")
    wire.run_until(5.0)
    assert not [m for _, who, _, m in wire.sent if who == "n"], "sent to no one"
    wire.add("a", seeds=(addr_of("n"),))
    wire.run_until(6.0, stop=lambda: "a" in n.table.members)
    assert "a" in n.table.members
    wire.run_until(7.0)
    assert wire.nodes["a"].table.members["n"].gpu == GPU


def test_seeds_set_after_start_make_a_lone_member_join_and_are_ignored_once_joined() -> None:
    """antientropy.set_seeds (seeds read from etcd): a member started with none joins."""
    wire = Wire(["a", "b"], seed=4)
    wire.run_until(1.0)
    n = wire.add("n")
    wire.run_until(2.0)
    assert n.joined and set(n.table.members) == set()  # alone: nothing to join
    n.antientropy.set_seeds([addr_of("n"), addr_of("a")], wire.now)  # our own is dropped
    assert n.antientropy.seeds == [addr_of("a")] and not n.joined
    wire.flush_all()
    wire.run_until(3.0, stop=lambda: n.joined)
    wire.run_until(4.0)
    assert set(n.table.members) == {"a", "b"}
    # Joined: new seeds are kept for later, but we stay joined.
    n.antientropy.set_seeds([addr_of("b")], wire.now)
    assert n.joined


def test_announce_spreads_a_new_incarnation_to_every_member() -> None:
    wire = Wire(["a", "b", "c", "d"], seed=5)
    wire.run_until(1.0)
    wire.nodes["a"].announce(1.0)
    wire.flush_all()
    wire.run_until(2.0)
    for name in ("b", "c", "d"):
        member = wire.nodes[name].table.members["a"]
        assert (member.state, member.incarnation) == (State.ALIVE, 1)


def test_a_member_alone_sends_nothing_and_counts_as_joined() -> None:
    """With no other member and no seed, no timer finds anyone to talk to."""
    wire = Wire(["a"])
    wire.run_until(120.0)
    assert wire.sent == [] and wire.nodes["a"].joined


# -- a restart is a fresh start (membership rules 6 and 8) ---------------------------------


@pytest.mark.parametrize("stop", ["sigterm", "sigkill-undetected", "sigkill-declared-dead"])
def test_a_restarted_member_is_serving_again_in_every_view(stop: str) -> None:
    """A member that published many versions of its GPU state, ended draining and stopped,
    restarts with its counters at 0: within a few gossip rounds every peer holds its new
    life's state (serving), not the previous life's (draining), however it stopped."""
    wire = Wire(["a", "b", "c"], seed=7)
    a = wire.nodes["a"]
    for i in range(50):
        a.set_gpu(0.02 * i, GpuState(model="tiny", rpc="tcp://a:1", running_requests=i))
    wire.run_until(3.0)
    a.set_gpu(3.0, GpuState(model="tiny", rpc="tcp://a:1", status="draining"))
    wire.run_until(4.0)
    assert all(wire.nodes[n].table.members["a"].gpu.status == "draining" for n in ("b", "c"))
    if stop == "sigterm":
        a.leave(4.0)
        wire.flush_all()
        wire.run_until(5.0)
    wire.down.add("a")
    if stop == "sigkill-declared-dead":
        wire.run_until(
            60.0,
            stop=lambda: all(
                wire.nodes[n].table.members["a"].state is State.DEAD for n in ("b", "c")
            ),
        )
    else:
        wire.run_until(wire.now + 0.5)
    wire.down.discard("a")
    restarted_at = wire.now
    new = wire.add("a", seeds=(addr_of("b"),))
    serving = GpuState(model="tiny", rpc="tcp://a:1", status="serving")
    new.set_gpu(restarted_at, serving)
    wire.flush_all()

    def everyone_sees_it_serving() -> bool:
        return all(
            (m := wire.nodes[n].table.members["a"]).state is State.ALIVE and m.gpu == serving
            for n in ("b", "c")
        )

    wire.run_until(restarted_at + 30.0, stop=everyone_sees_it_serving)
    assert everyone_sees_it_serving(), {
        n: (wire.nodes[n].table.members["a"].state, wire.nodes[n].table.members["a"].gpu)
        for n in ("b", "c")
    }
    assert wire.now - restarted_at < 2.0, "within a few gossip rounds"
    assert new.table.incarnation >= 1 and new.table.meta_incarnation == new.table.incarnation


@pytest.mark.parametrize("queued", ["meta", "quiet_alive"])
def test_every_ping_to_a_suspect_carries_the_suspicion_whatever_else_is_queued_about_it(
    queued: str,
) -> None:
    """Buddy system (MEMBERSHIP.md): every ping to a suspect carries the Suspect.  Another
    update about the suspect waiting to be piggybacked (its Meta, which a busy member
    republishes every 2 s, or an older quiet Alive) used to take its place: the suspect
    answered every ping and never heard it was suspected, and was declared dead."""
    wire = Wire(["a", "b", "c", "d", "x"])
    a = wire.nodes["a"]
    if queued == "meta":
        a.apply(Meta(node="x", version=1, gpu=GpuState(), incarnation=0), 0.0)
        incarnation = 0
    else:
        a.apply(Alive(node="x", incarnation=1, addr=addr_of("x"), quiet=True), 0.0)
        incarnation = 1
    a.apply(Suspect(node="x", incarnation=incarnation, by="a"), 0.0)
    assert a.table.members["x"].state is State.SUSPECT
    a.take_outbox()
    for _ in range(10):
        a.prober.seq += 1
        a.prober.ping("x", a.prober.seq)
    pings = [decode_gossip(data, bytes_max=1 << 20) for _, data in a.take_outbox()]
    assert len(pings) == 10
    for ping in pings:
        assert isinstance(ping, Ping)
        told = [u for u in ping.updates if isinstance(u, Suspect) and u.node == "x"]
        assert told == [Suspect(node="x", incarnation=incarnation, by="a")]


def test_a_push_pull_does_not_bring_back_a_dead_member_that_others_reaped() -> None:
    """A dead record for a member we do not know is ignored (memberlist's rule): it used to
    become an Alive and a Suspect, so a member reaped everywhere but at one came back as
    alive with its old GPU state (a placement candidate), was gossiped so to the others, and
    its reap clock started over."""
    wire = Wire(["a", "b", "c", "d", "x"])
    gpu = GpuState(status="serving", rpc="tcp://x:9000")
    for name in "abcd":
        node = wire.nodes[name]
        node.apply(Meta(node="x", version=5, gpu=gpu, incarnation=0), 0.0)
        node.apply(Dead(node="x", incarnation=0, by="a"), 0.0)
        node.dissemination.forget()
        node.take_outbox()
        node.take_events()
    wire.down.add("x")
    for name in "acd":  # reaped x; b has not yet
        wire.nodes[name].table.reap(10**6, dead_after_s=0, left_after_s=0)
        assert "x" not in wire.nodes[name].table.members
    wire.nodes["b"].antientropy.push_pull(addr_of("a"), reply=True, now=wire.now)
    wire.flush_all()
    for until in (0.05, 1.0, 3.0, 6.0):
        wire.run_until(until)
        assert all("x" not in wire.nodes[name].table.members for name in "acd"), until
    assert wire.nodes["b"].table.members["x"].state is State.DEAD
    # (b's table, x dead in it, did reach a)
    assert any(src == "b" and isinstance(msg, PushPull) for _, src, _, msg in wire.sent)


def test_the_prober_forgets_refuted_suspects_and_old_early_probes() -> None:
    """Its last-chance and early-probe records held every name ever suspected or probed
    early; they now end with the suspicion, and with the probe interval."""
    from gossipd.core.probing import EARLY_PROBED_MAX

    names = [f"m{i}" for i in range(EARLY_PROBED_MAX + 40)]
    wire = Wire(["a", *names])
    a = wire.nodes["a"]
    for i, name in enumerate(names):
        a.prober.probe_soon(i * 0.001, name)
    assert len(a.prober._early_probed) == EARLY_PROBED_MAX + 40  # all within one interval
    later = 2 * wire.config.probe_interval_s
    a.prober.probe_soon(later, "m0")
    assert set(a.prober._early_probed) == {"m0"}
    a.prober.verifying["m1"] = 0  # (as its last-chance ping leaves)
    a.apply(Suspect(node="m1", incarnation=0, by="a"), later)
    a.tick(later)
    assert "m1" in a.prober.verifying
    a.apply(Alive(node="m1", incarnation=1, addr=addr_of("m1")), later)  # refuted
    a.tick(later + 0.01)
    assert "m1" not in a.prober.verifying


def test_a_gpu_state_too_large_to_ride_piggyback_is_published_with_fewer_prefixes() -> None:
    """256 prefix hashes (prefix_summary_max's bound) made a 1,663-byte Meta: over
    piggyback_bytes_max it never rode a message, and being not urgent no gossip round carried
    it, so a drain reached the others by push-pull only (tens of seconds).  Now the least
    seen prefixes are left out until it fits, and the cut is counted."""
    import random as rand

    from gossipd.core.gossip_messages import encode_update

    wire = Wire(["a", "b", "c"])
    a = wire.nodes["a"]
    rng = rand.Random(1)
    prefixes = [rng.getrandbits(32) | 1 << 31 for _ in range(256)]  # (5 bytes each)
    gpu = GpuState(ingress="tcp://10.0.0.12:5555", rpc="tcp://10.0.0.12:5556", status="draining",
                   model="meta-llama/Llama-3.1-8B-Instruct", prefixes=prefixes)  # fmt: skip
    a.set_gpu(0.0, gpu)
    published = a.table.gpu
    assert published is not None and published.status == "draining"
    assert 0 < len(published.prefixes) < 256
    assert published.prefixes == prefixes[: len(published.prefixes)]  # the most seen kept
    meta = Meta(node="a", version=a.table.meta_version, gpu=published, incarnation=0)
    assert len(encode_update(meta)) <= wire.config.piggyback_bytes_max
    assert a.stats.prefixes_cut == 256 - len(published.prefixes)
    a.take_outbox()
    a.prober.seq += 1
    a.prober.ping("b", a.prober.seq)
    (ping,) = [decode_gossip(data, bytes_max=1 << 20) for _, data in a.take_outbox()]
    assert isinstance(ping, Ping)
    assert any(isinstance(u, Meta) and u.gpu.status == "draining" for u in ping.updates)
    small = GpuState(status="serving", prefixes=prefixes[:8])
    a.set_gpu(1.0, small)
    assert a.table.gpu == small  # one that fits is left whole


def test_an_ack_from_a_probe_target_forgotten_meanwhile_is_taken_without_raising() -> None:
    """The Ack's checksum, third in a run of mismatches, asked for a push-pull with the
    target's address from the table, which had forgotten it (the leader's forget directive,
    or a reap) while the probe was out: KeyError out of receive, and the rest of that read's
    frames were dropped.  Now nothing is asked of a member no longer known."""
    from gossipd.core.gossip_messages import Ack, GossipOnly, encode_gossip

    a = SwimNode(SwimConfig(), node="a", addr=addr_of("a"), rng=random.Random(1), now=0.0)
    a.bootstrap(0.0, [(n, addr_of(n)) for n in "abcde"])
    for _ in range(2):  # two acks of earlier probes whose checksum differed from ours
        a.antientropy.compare_checksum("c", 12345, 0.0)
    news = GossipOnly(cluster="default", src="c", src_addr=addr_of("c"),
                      updates=[Suspect(node="b", incarnation=0, by="c")])  # fmt: skip
    a.receive(0.0, encode_gossip(news))
    a.connection_lost(10.0, "b")  # a suspect whose connection dropped: probed early
    a.tick(10.0)
    assert a.prober.probe is not None and a.prober.probe.target == "b"
    assert a.table.forget("b", 0, 10.0)
    a.receive(10.01, encode_gossip(Ack(cluster="default", src="b", src_addr=addr_of("b"),
                                       seq=a.prober.probe.seq, checksum=999)))  # fmt: skip
    assert "b" not in a.table.members


def test_a_member_held_left_that_pings_hears_it_in_the_ack_and_refutes() -> None:
    """A restarted member (incarnation 0) that we hold left at 3 learns it from our Ack, as
    one held dead does (rule 11), and refutes above it at once."""
    a = SwimNode(SwimConfig(), node="a", addr=addr_of("a"), rng=random.Random(1), now=0.0)
    a.bootstrap(0.0, [(n, addr_of(n)) for n in "abc"])
    a.apply(Alive(node="b", incarnation=3, addr=addr_of("b")), 0.0)
    a.apply(Left(node="b", incarnation=3), 1.0)
    a.dissemination.forget()  # long since gossiped: no longer piggybacked
    b = SwimNode(SwimConfig(), node="b", addr=addr_of("b"), rng=random.Random(2), now=2.0)
    b.bootstrap(2.0, [(n, addr_of(n)) for n in "abc"])
    a.take_outbox()
    a.receive(2.0, encode_gossip(Ping(**b.header([]), seq=7, target="a")))
    [(to, ack)] = a.take_outbox()
    assert to == addr_of("b")
    b.receive(2.01, ack)
    assert b.table.incarnation == 4 and b.stats.refutations == 1
