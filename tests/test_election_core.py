"""The election core (gossipd/core/election.py) against a model of etcd, with hypothesis:
candidates grant, put, keep alive, look, resign, crash, get cut off from etcd and come back,
in any order, with answers that arrive late.  Whatever happens: at most one member believes it
leads at any time, at most one member ever leads with a given token, a leader's token is the
lowest live key's create_revision (its key exists while it leads), and tokens never go down.
Plus the rules one by one."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.core.election import Elected, ElectionCore, Phase, SteppedDown, Watch

TTL_S = 2.0


@dataclass
class EtcdModel:
    """etcd's leases and keys: a lease expires TTL after its last keepalive was processed,
    and its key goes with it."""

    ttl_s: float = TTL_S
    revision: int = 0
    leases: dict[int, float] = field(default_factory=dict)  # id -> expires at
    keys: dict[int, int] = field(default_factory=dict)  # lease id -> create_revision
    next_lease: int = 1

    def expire(self, now: float) -> None:
        for lease, at in list(self.leases.items()):
            if at <= now:
                self.revoke(lease)

    def revoke(self, lease: int) -> None:
        self.leases.pop(lease, None)
        if self.keys.pop(lease, None) is not None:
            self.revision += 1

    def grant(self, now: float) -> int:
        lease = self.next_lease
        self.next_lease += 1
        self.leases[lease] = now + self.ttl_s
        return lease

    def put(self, lease: int) -> int | None:
        if lease not in self.leases:
            return None
        if lease not in self.keys:
            self.revision += 1
            self.keys[lease] = self.revision
        return self.keys[lease]

    def keepalive(self, lease: int, processed_at: float) -> float:
        if lease not in self.leases:
            return 0.0
        # etcd handles requests in order: a keepalive processed later never shortens a lease.
        self.leases[lease] = max(self.leases[lease], processed_at + self.ttl_s)
        return self.leases[lease] - processed_at


# "campaign" is the shell's campaign loop's next step for the member's phase (grant, put, or
# read the candidates); listed several times so that elections happen often.
OPS = ("campaign",) * 6 + ("keepalive",) * 3 + ("advance",) * 4
OPS += ("resign", "rejoin", "crash", "cut", "heal")


@given(
    st.lists(
        st.tuples(st.sampled_from(OPS), st.integers(0, 2), st.floats(0.0, 1.5)),
        min_size=20,
        max_size=150,
    )
)
@settings(max_examples=300)
def test_at_most_one_leader_at_a_time_and_per_token(steps: list) -> None:  # type: ignore[type-arg]
    etcd = EtcdModel()
    now = 0.0
    cores = [ElectionCore(ttl_s=TTL_S) for _ in range(3)]
    cut = [False, False, False]
    leader_of_token: dict[int, int] = {}
    highest_elected = 0
    elections = 0
    for op, i, x in steps:
        core = cores[i]
        reach = not cut[i]
        decision = None
        if op == "advance":
            later = now + x
            for c in cores:  # each steps down at its own deadline (before etcd expires it)
                deadline = c.next_deadline()
                if deadline <= later:
                    assert isinstance(c.tick(deadline), SteppedDown)
            now = later
            etcd.expire(now)
        elif not reach and op != "heal":
            pass  # etcd unreachable: the call fails, the core hears nothing
        elif op == "campaign" and core.phase is Phase.NO_SESSION:
            core.granted(now - x / 10, etcd.grant(now), TTL_S)
        elif op == "campaign" and core.phase is Phase.NO_KEY:
            revision = etcd.put(core.lease_id)
            if revision is not None:
                core.key_created(revision)
        elif op == "campaign" and core.phase is Phase.CANDIDATE:
            decision = core.candidates(now, sorted(etcd.keys.values()))
            if isinstance(decision, Watch):
                assert decision.revision in etcd.keys.values()
                assert decision.revision < core.revision
        elif op == "keepalive" and core.lease_id:
            # Sent x/2 ago, processed x/4 ago, answered now.
            ttl_left = etcd.keepalive(core.lease_id, now - x / 4)
            decision = core.keepalive_answered(now, now - x / 2, ttl_left)
        elif op == "resign":
            lease = core.lease_id
            decision = core.resign()
            etcd.revoke(lease)
        elif op == "rejoin":
            core.restart()
        elif op == "crash":
            cores[i] = ElectionCore(ttl_s=TTL_S)  # a new process; the old lease lingers
        elif op == "cut":
            cut[i] = True
        elif op == "heal":
            cut[i] = False
        if isinstance(decision, Elected):
            elections += 1
            assert leader_of_token.setdefault(decision.token, i) == i
            assert decision.token >= highest_elected, "tokens never go down"
            highest_elected = decision.token
        leaders = [c for c in cores if c.leading]
        assert len(leaders) <= 1, "two members believe they lead at once"
        for c in leaders:
            assert c.leader_token == min(etcd.keys.values()), "a leader's key is the lowest"
            assert c.lease_valid(now)
    event("elections", elections)


def event(name: str, value: int) -> None:
    from hypothesis import event as hypothesis_event

    hypothesis_event(f"{name}: {min(value, 5)}{'+' if value >= 5 else ''}")


def test_lowest_key_leads_others_watch_their_predecessor() -> None:
    a, b, c = (ElectionCore(ttl_s=TTL_S) for _ in range(3))
    for core, lease, rev in ((a, 1, 5), (b, 2, 7), (c, 3, 9)):
        core.granted(0.0, lease, TTL_S)
        core.key_created(rev)
    assert a.candidates(0.1, [5, 7, 9]) == Elected(5)
    assert a.candidates(0.2, [5, 7, 9]) is None, "already leading: nothing new"
    assert b.candidates(0.1, [5, 7, 9]) == Watch(5)
    assert c.candidates(0.1, [5, 7, 9]) == Watch(7), "only the predecessor, not the leader"
    assert c.candidates(0.1, [5, 9]) == Watch(5)
    assert b.candidates(0.3, [7, 9]) == Elected(7)


def test_a_leader_steps_down_a_ttl_after_its_last_answered_keepalive() -> None:
    core = ElectionCore(ttl_s=TTL_S, margin_s=0.1)
    core.granted(0.0, 1, TTL_S)
    core.key_created(3)
    assert core.candidates(0.0, [3]) == Elected(3)
    assert core.keepalive_answered(0.8, 0.6, TTL_S) is None
    assert core.next_deadline() == 0.6 + TTL_S - 0.1
    assert core.tick(2.4) is None
    assert core.tick(2.5) == SteppedDown(3, "lease_expired")
    assert core.next_deadline() == math.inf
    # etcd confirms the lease again (it was down, not the lease): same key, same token.
    assert core.candidates(2.6, [3]) is None, "not before a keepalive is answered"
    core.keepalive_answered(2.7, 2.65, TTL_S)
    assert core.candidates(2.7, [3]) == Elected(3)


def test_a_lost_lease_or_key_ends_the_session() -> None:
    core = ElectionCore(ttl_s=TTL_S)
    core.granted(0.0, 1, TTL_S)
    core.key_created(3)
    core.candidates(0.0, [3])
    assert core.keepalive_answered(0.5, 0.4, 0) == SteppedDown(3, "lease_lost")
    assert core.phase is Phase.NO_SESSION and core.revision == 0
    assert core.keepalive_answered(0.6, 0.5, TTL_S) is None, "no session: ignored"
    core.granted(1.0, 2, TTL_S)
    core.key_created(8)
    assert core.candidates(1.0, [8]) == Elected(8)
    assert core.candidates(1.1, [9]) == SteppedDown(8, "key_gone")
    assert core.phase is Phase.NO_SESSION
    core.granted(2.0, 3, TTL_S)
    core.key_created(10)
    assert core.candidates(2.0, [4, 10]) == Watch(4)
    assert core.candidates(2.1, [10, 11]) == Elected(10)
    assert core.candidates(2.2, [6, 10]) == SteppedDown(10, "not_lowest")
    assert core.step_downs == {"lease_lost": 1, "key_gone": 1, "not_lowest": 1}


def test_resign_steps_down_and_stays_out_until_restarted() -> None:
    core = ElectionCore(ttl_s=TTL_S)
    core.granted(0.0, 1, TTL_S)
    core.key_created(3)
    core.candidates(0.0, [3])
    assert core.resign() == SteppedDown(3, "resigned")
    assert core.phase is Phase.RESIGNED
    core.granted(0.1, 2, TTL_S)
    core.key_created(4)
    assert core.candidates(0.1, [4]) is None
    assert core.keepalive_answered(0.1, 0.1, TTL_S) is None
    assert core.resign() is None, "not leading: nothing to step down from"
    core.restart()
    assert core.phase is Phase.NO_SESSION
    core.granted(0.2, 3, TTL_S)
    core.key_created(5)
    assert core.candidates(0.2, [5]) == Elected(5)
    assert core.keepalive_interval_s() == TTL_S / 3
    core.key_created(6)  # only after a grant: ignored
    assert core.revision == 5


def test_key_deleted_ends_a_candidates_session_and_is_ignored_otherwise() -> None:
    core = ElectionCore(ttl_s=TTL_S)
    assert core.key_deleted() is None, "no session: nothing to end"
    core.granted(0.0, 1, TTL_S)
    core.key_created(3)
    assert core.candidates(0.0, [3]) == Elected(3)
    assert core.key_deleted() == SteppedDown(3, "key_gone")
    assert core.phase is Phase.NO_SESSION and core.revision == 0 and not core.leading
    assert core.key_deleted() is None
    core.granted(1.0, 2, TTL_S)
    core.key_created(5)
    assert core.candidates(1.0, [4, 5]) == Watch(4)
    assert core.key_deleted() is None, "not leading: the session ends, nothing to step down"
    assert core.phase is Phase.NO_SESSION
    core.granted(2.0, 3, TTL_S)
    core.key_created(6)
    core.resign()
    assert core.key_deleted() is None and core.phase is Phase.RESIGNED
    assert core.step_downs == {"key_gone": 1}
