"""The placer's view kept member by member (issue 17): the same as one built from scratch,
the same decisions as core/placement.place, and its memory at 10,000 members."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.config import FanoutConfig
from gossipd.core.gossip_messages import Alive, Dead, GpuState, Left, LoadRecord, Meta, Suspect
from gossipd.core.membership import MemberTable
from gossipd.core.messages import Task
from gossipd.core.placer import Placer
from gossipd.core.prefix import prefix_hashes
from gossipd.core.ring import Candidate, LoadCounts, place
from gossipd.fanout.placement_feed import KernelLoader
from gossipd.tools.bench.place import memory_mb

NAMES = [f"m{i}" for i in range(8)]
ME = "me"
NOW = 0.0  # decisions' time where no record's age matters
PROMPT = "You are a careful assistant. " * 20  # four whole blocks of 128 characters
PROMPT_HASHES = prefix_hashes(PROMPT, 128, 8)


class Harness:
    """A real member table, its events delivered to the placers that listen."""

    def __init__(self) -> None:
        self.table = MemberTable(me=ME, addr="tcp://10.0.0.1:1", now=0.0)
        self.listeners: list[Any] = []
        self.meta_versions: dict[str, int] = {}
        self.loads = LoadCounts()

    def placer(self, *, listen: bool = True, owner_check: bool = False, **kw: Any) -> Placer:
        """Without the owner check by default: the gossiped view alone decides, as
        core/placement.place does over the same candidates.  It reads the table as it stands
        (``rebuild``) and, with ``listen``, follows its events (as PlacementFeed does)."""
        placer = Placer(
            FanoutConfig(load_floor=0, owner_check=owner_check),
            node=ME,
            loads=self.loads,
            local_ids=set(),
            **kw,
        )
        placer.rebuild(self.table.members.values())
        if listen:
            self.listeners.append(placer)
        return placer

    def apply(self, update: Any) -> None:
        outcome = self.table.apply(update, 0.0)
        if outcome.event is not None:
            for placer in self.listeners:
                placer.member_event(outcome.event, self.table.members.get(outcome.event.node))

    def incarnation(self, name: str) -> int:
        m = self.table.members.get(name)
        return 0 if m is None else m.incarnation


gpu_states = st.builds(
    lambda rpc, status, weight, model, waiting, prefixes: GpuState(
        rpc=rpc,
        status=status,
        capacity_weight=weight,
        model=model,
        waiting_requests=waiting,
        prefixes=prefixes,
    ),
    st.sampled_from(["", "tcp://10.0.0.2:5558", "tcp://10.0.0.3:5558"]),
    st.sampled_from(["serving", "serving", "draining", "unhealthy"]),
    st.sampled_from([0.0, 1.0, 2.0]),
    st.sampled_from(["", "", "llama", "qwen"]),
    st.sampled_from([0, 0, 1_000_000]),
    st.lists(st.integers(0, 12) | st.sampled_from(PROMPT_HASHES), max_size=6),
)
operations = st.lists(
    st.tuples(
        st.sampled_from(["alive", "meta", "meta", "meta", "suspect", "dead", "left", "new_life"]),
        st.sampled_from(NAMES[:4]),  # few members: each sees several changes
        gpu_states,
    ),
    min_size=4,
    max_size=40,
)


def snapshot(placer: Placer) -> dict[str, Any]:
    view = placer.view()
    return {
        "ring": None if view.ring is None else (view.ring.members, view.ring._weights),
        "weights": dict(view.weights),
        "total_weight": round(view.total_weight, 9),
        "addrs": dict(view.addrs),
        "saturated": set(view.saturated),
        "models": {k: v for k, v in placer._by_model.items() if v},
        "holders": {h: placer.prefix_index.holders([h]) for h in [*range(13), *PROMPT_HASHES]},
    }


@settings(max_examples=150, deadline=None)
@given(operations, st.lists(st.integers(0, 12), max_size=8))
def test_the_view_kept_member_by_member_equals_the_view_built_from_scratch(
    ops: list[tuple[str, str, GpuState]], loads: list[int]
) -> None:
    h = Harness()
    incremental = h.placer()
    for name in NAMES[:4]:
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
    for i, (kind, name, gpu) in enumerate(ops):
        inc = h.incarnation(name)
        if kind == "alive":
            h.apply(Alive(node=name, incarnation=inc, addr=f"tcp://{name}:1"))
        elif kind == "new_life":
            h.apply(Alive(node=name, incarnation=inc + 1, addr=f"tcp://{name}:2"))
        elif kind == "meta":
            version = h.meta_versions[name] = h.meta_versions.get(name, 0) + 1
            h.apply(Meta(node=name, version=version, gpu=gpu, incarnation=inc))
        elif kind == "suspect":
            h.apply(Suspect(node=name, incarnation=inc, by=ME))
        elif kind == "dead":
            h.apply(Dead(node=name, incarnation=inc, by=ME))
        else:
            h.apply(Left(node=name, incarnation=inc))
        if i % 4 != 3:
            incremental.view()  # read between changes (mostly), not only at the end
    for name, load in zip(NAMES, loads, strict=False):
        h.loads[name] = load
    rebuilt = h.placer(listen=False)
    assert snapshot(incremental) == snapshot(rebuilt)
    for k in range(5):
        for model in ("", "llama"):
            task = Task(
                v=1, id=f"t{k}", key=f"k{k}", prompt="p", reply_to="tcp://1.2.3.4:5", model=model
            )
            assert incremental.order(task, NOW) == rebuilt.order(task, NOW)
            assert incremental.owner_for(task, NOW) == rebuilt.owner_for(task, NOW)
    keyless = Task(v=1, id="q", prompt=PROMPT + "?", reply_to="tcp://1.2.3.4:5")
    for _ in range(2):  # the second time from the remembered holder ranking
        assert incremental.owner_for(keyless, NOW) == rebuilt.owner_for(keyless, NOW)
    assert incremental.prefix_hits == rebuilt.prefix_hits


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(NAMES),
        st.tuples(
            st.integers(0, 30),
            st.booleans(),
            st.sampled_from([1.0, 2.0]),
            st.sampled_from(["", "llama", "qwen"]),
        ),
        min_size=1,
    ),
    st.integers(0, 20),
    st.sampled_from(["", "llama"]),
    st.sets(st.sampled_from([*NAMES, ME]), max_size=3),
    st.text(max_size=6),
)
def test_order_chooses_as_core_placement_does(
    members: dict[str, tuple[int, bool, float, str]],
    own_load: int,
    model: str,
    exclude: set[str],
    key: str,
) -> None:
    """The first attempts_max of place()'s order over every serving, eligible, not excluded
    candidate (loads here only on serving members: the totals then agree)."""
    h = Harness()
    for name, (_, saturated, weight, member_model) in members.items():
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        gpu = GpuState(
            rpc=f"tcp://{name}:5558",
            capacity_weight=weight,
            model=member_model,
            waiting_requests=1_000_000 if saturated else 0,
        )
        h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
    for name, (load, *_) in members.items():
        h.loads[name] = load
    placer = h.placer()
    placer.local_ids.update(f"local-{i}" for i in range(own_load))
    candidates = {
        name: Candidate(
            name,
            load=load,
            weight=weight,
            models=frozenset({m}) if m else frozenset(),
            saturated=saturated,
        )
        for name, (load, saturated, weight, m) in members.items()
    }
    candidates[ME] = Candidate(ME, load=own_load)
    cands = {n: c for n, c in candidates.items() if n not in exclude}
    config = placer.config
    task = Task(v=1, id="t", key=key, prompt="p", reply_to="tcp://1.2.3.4:5", model=model)
    expected = place(
        key or "t", cands, c=config.load_bound_c, floor=config.load_floor, model=model
    )[: config.attempts_max]
    assert placer.order(task, NOW, frozenset(exclude)) == expected


def test_membership_and_placement_state_of_10000_members_fits_100_mb() -> None:
    """256 prefix hashes a member, all distinct (the worst case for the index): measured at
    1,000 members and scaled, the state being per member (bench place measures 10,000:
    about 44 MB), with a push-pull of the whole table sent: nothing of it stays, and what it
    holds while it is sent (pages, not the table's records) is added to the scaled state."""
    memory = memory_mb(1000, prefixes=256)
    per_member_mb = memory["state_mb"] / 1000
    in_flight_mb = memory["push_pull_peak_mb"] - memory["state_mb"]
    assert memory["state_mb"] <= memory["state_before_push_pull_mb"] + 0.1  # nothing kept
    assert per_member_mb * 10_000 + in_flight_mb <= 100.0, f"{per_member_mb * 1e3:.1f} KB a member"


def test_a_load_only_meta_refreshes_its_member_alone_and_keeps_the_ring() -> None:
    h = Harness()
    for i, name in enumerate(NAMES):
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        gpu = GpuState(rpc=f"tcp://{name}:5558", prefixes=[i])
        h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
    placer = h.placer()
    ring = placer.view().ring
    refreshed: list[str] = []
    original = placer._refresh

    def counting(name: str, member: Any) -> None:
        refreshed.append(name)
        original(name, member)

    placer._refresh = counting  # type: ignore[method-assign]
    busy = GpuState(rpc="tcp://m3:5558", prefixes=[3], running_requests=7, waiting_requests=9)
    h.apply(Meta(node="m3", version=2, gpu=busy, incarnation=0))
    view = placer.view()
    assert refreshed == ["m3"] and view.ring is ring  # no rebuild for a load
    assert "m3" in view.saturated  # ...yet the new load is seen
    heavier = GpuState(rpc="tcp://m3:5558", prefixes=[3], capacity_weight=2.0)
    h.apply(Meta(node="m3", version=3, gpu=heavier, incarnation=0))
    assert placer.view().ring is not ring and placer.view().weights["m3"] == 2.0


def test_the_ring_kernels_load_off_the_event_loop_and_the_ring_follows_once_loaded(
    monkeypatch: Any,
) -> None:
    """A ring of KERNEL_MIN members or more: NumPy while the kernels load in a thread (no
    stall of the loop), the same owners, then rebuilt with them."""
    import pytest

    from gossipd.core import hrw
    from gossipd.core import ring as rings

    pytest.importorskip("numba")
    monkeypatch.setattr(rings, "KERNEL_MIN", 4)
    monkeypatch.setattr(hrw, "_loaded", [])  # as in a process that never loaded them
    h = Harness()
    for name in [f"n{i}" for i in range(rings.VECTOR_MIN)]:  # vectorised: kernels may score
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        h.apply(Meta(node=name, version=1, gpu=GpuState(rpc=f"tcp://{name}:5558"), incarnation=0))
    loader = KernelLoader()
    placer = h.placer(kernels=loader)
    first = placer.view().ring
    assert first is not None and first._kernels is None
    assert loader._thread is not None
    loader._thread.join(timeout=60)
    second = placer.view().ring
    assert second is not first and second is not None and second._kernels is not None
    assert placer.view().ring is second
    keys = [f"k{i}" for i in range(200)]
    assert [first.owner(k) for k in keys] == [second.owner(k) for k in keys]


def _saturated_cluster(h: Harness) -> None:
    for name in NAMES:
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        h.apply(Meta(node=name, version=1, gpu=GpuState(rpc=f"tcp://{name}:5558"), incarnation=0))


def test_owner_check_passes_a_member_over_only_on_a_record_at_most_trust_s_old() -> None:
    """fanout.owner_check: a member whose Meta or old record says saturated is tried (its own
    check decides, on its current load); one whose record of at most load_trust_s says so is
    passed over, and the decision is recorded with that record's age."""
    h = Harness()
    _saturated_cluster(h)
    placer = h.placer(owner_check=True)
    task = _task_not_mine(placer)
    ring_owner = placer.order(task, 100.0)[0]
    hot = LoadRecord(ring_owner, 5, 0, 3, 50, 0, 99)
    assert placer.on_load(hot, 100.0)
    now = 100.2  # 0.2 s old: trusted, passed over
    assert placer.owner_for(task, now) not in (ring_owner, None)
    ages = placer.state_ages
    assert ages.count == 1 and abs(ages.sum_s - 0.2) < 1e-6 and ages.owner_checked == 0
    now += placer.config.load_trust_s  # older than load_trust_s: the owner checks
    assert placer.owner_for(task, now) == ring_owner
    assert ages.count == 1 and ages.owner_checked == 1 and ages.unknown == 0
    # Without the check the same old record still passes it over (the view alone decides).
    plain = h.placer(owner_check=False)
    plain.on_load(hot, 100.0)
    assert plain.owner_for(task, now) != ring_owner


def test_owner_check_ignores_a_saturated_meta_without_a_record() -> None:
    h = Harness()
    for name in NAMES:
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        gpu = GpuState(rpc=f"tcp://{name}:5558", waiting_requests=1_000_000)
        h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
    checked = h.placer(owner_check=True)
    viewed = h.placer(owner_check=False)
    task = _task_not_mine(checked)
    ring_owner = checked.order(task, NOW)[0]
    assert checked.owner_for(task, NOW) == ring_owner and checked.state_ages.owner_checked == 1
    # The view alone passes every saturated Meta over: only we are left.
    assert viewed.owner_for(task, NOW) == ME and viewed.state_ages.owner_checked == 0


def _task_not_mine(placer: Placer) -> Task:
    for i in range(100):
        task = Task(v=1, id=f"t{i}", key=f"k{i}", prompt="p", reply_to="tcp://1.2.3.4:5")
        if placer.view().ring.owner(task.key) != ME:  # type: ignore[union-attr]
            return task
    raise AssertionError("every key is ours")


def test_drained_or_saturated_we_are_never_the_first_choice_while_another_serves() -> None:
    """Our own entry comes from set_draining (an operator's Drain, or stopping) and from our
    engine's latest sample (own_sample): drained, no task is placed here; saturated, another
    member under its bound comes first."""
    h = Harness()
    _saturated_cluster(h)  # every member serving, none saturated
    sample: dict[str, Any] = {"now": GpuState()}
    placer = h.placer(own_sample=lambda: sample["now"])
    tasks = [
        Task(v=1, id=f"t{i}", key=f"k{i}", prompt="p", reply_to="tcp://1.2.3.4:5")
        for i in range(200)
    ]
    mine = [t for t in tasks if placer.owner_for(t, NOW) == ME]
    assert mine, "some keys are ours while we serve"
    placer.set_draining(True)
    assert all(placer.owner_for(t, NOW) != ME for t in tasks)
    assert all(ME not in placer.order(t, NOW) for t in tasks)
    placer.set_draining(False)
    assert [t for t in tasks if placer.owner_for(t, NOW) == ME] == mine
    sample["now"] = GpuState(waiting_requests=1_000_000)  # our engine queues: saturated
    assert ME in placer.view().saturated
    assert all(placer.owner_for(t, NOW) != ME for t in mine)
    sample["now"] = GpuState()
    assert [t for t in tasks if placer.owner_for(t, NOW) == ME] == mine


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(NAMES),
        st.tuples(st.integers(0, 5), st.sampled_from(["", "llama", "llama", "qwen"])),
        min_size=1,
    ),
    st.sampled_from(["", "llama"]),  # what we serve ourselves
    st.booleans(),  # keyed, or placed by its prompt's prefix
    st.lists(st.sampled_from(NAMES), max_size=3),  # members holding the prompt's prefix
)
def test_a_task_naming_a_model_goes_to_a_member_serving_it_and_else_as_any_task(
    members: dict[str, tuple[int, str]], own_model: str, keyed: bool, holders: list[str]
) -> None:
    """Where every member serves the model (names it or names none), a task naming it is
    placed exactly as the same task naming none (ring, bounds, prefix holders: every OpenAI
    request names a model); where some do not, it goes to one that does."""
    h = Harness()
    for name, (_, member_model) in members.items():
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        prefixes = list(PROMPT_HASHES) if name in holders else []
        gpu = GpuState(rpc=f"tcp://{name}:5558", model=member_model, prefixes=prefixes)
        h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
        h.loads[name] = members[name][0]
    named = h.placer(model=own_model)
    plain = h.placer(model=own_model)
    fields = {"v": 1, "id": "t1", "prompt": PROMPT, "reply_to": "tcp://1.2.3.4:5"}
    if keyed:
        fields["key"] = "session-7"
    owner = named.owner_for(Task(**fields, model="llama"), NOW)
    serving = {n for n, (_, m) in members.items() if m in ("", "llama")}
    if own_model in ("", "llama"):
        serving.add(ME)
    if len(serving) == len(members) + 1:  # everyone, ourselves included
        assert owner == plain.owner_for(Task(**fields), NOW)
    else:
        assert owner in serving


def test_a_capacity_weight_near_zero_counts_as_the_floor_and_placement_never_divides_by_0() -> None:
    """The wire takes any capacity_weight in 0..1e6; 1e-300 beside a weight of 1.0 summed to
    1.0 and, that member gone, to 0.0: the load bound divided by it (ZeroDivisionError in
    the gossip task, from one Meta).  Placement reads such a weight as CAPACITY_WEIGHT_MIN."""
    from gossipd.core.gossip_messages import CAPACITY_WEIGHT_MIN

    h = Harness()
    placer = h.placer()
    for name, weight in (("m0", 1.0), ("m1", 1e-300), ("m2", 5e-324)):
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        gpu = GpuState(rpc=f"tcp://{name}:5558", capacity_weight=weight, model="evil")
        h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
    assert placer.view().weights["m1"] == placer.view().weights["m2"] == CAPACITY_WEIGHT_MIN
    h.apply(Dead(node="m0", incarnation=0, by=ME))
    task = Task(v=1, id="t", key="k", prompt="p", reply_to="tcp://1.2.3.4:5", model="evil")
    # Without this daemon (a drain's hand-off orders so): only the two tiny weights count.
    assert set(placer.order(task, NOW, frozenset({ME}))) == {"m1", "m2"}
    assert placer.order(task, NOW, frozenset({ME, "m1"})) == ["m2"]


def test_load_records_of_names_placement_does_not_know_are_not_kept() -> None:
    """Load records come by gossip (anyone's, without CURVE): kept for any name, 100,000
    made-up names filled the view's bound for good and a real new member's records were then
    refused.  Only a member placement knows has its record kept."""
    h = Harness()
    placer = h.placer()
    h.apply(Alive(node="m0", incarnation=0, addr="tcp://m0:1"))
    h.apply(Meta(node="m0", version=1, gpu=GpuState(rpc="tcp://m0:5558"), incarnation=0))
    for i in range(1000):
        assert not placer.on_load(LoadRecord(node=f"ghost{i}", seq=1, waiting=5), NOW)
    assert len(placer.load_view) == 0
    assert placer.on_load(LoadRecord(node="m0", seq=1, waiting=1_000_000), NOW)
    assert len(placer.load_view) == 1 and "m0" in placer.view().saturated


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(NAMES),
        st.sampled_from(["", "0.3.1", "0.3.2", "0.3.3", "0.3.4", "0.3.5", "0.3.6", "0.4.0"]),
        min_size=1,
    ),  # each member's release
    st.sampled_from(["", "0.3.2", "0.3.3", "0.3.4", "0.3.5", "0.3.6"]),  # what the params need
    st.booleans(),  # keyed, or placed by its prompt's prefix
)
def test_a_task_asking_later_params_goes_to_a_member_of_a_release_that_reads_them(
    releases: dict[str, str], needs: str, keyed: bool
) -> None:
    """A rolling upgrade: a member before 0.3.2 refuses a task asking a penalty, min_p,
    min_tokens or structured output, one before 0.3.3 a task asking logprobs, before 0.3.4
    prompt_logprobs, before 0.3.5 logit_bias or stop_token_ids, before 0.3.6 a chat's
    add_special_tokens (and the whole frame it
    travels in), so such a task is placed, and tried again, only on members that
    read it (ourselves included); any other task is placed as if every member were
    upgraded."""
    from gossipd.core.releases import release_of
    from gossipd.core.sampling import SamplingParams, release_asked

    h = Harness()
    for name, release in releases.items():
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        gpu = GpuState(rpc=f"tcp://{name}:5558", software_version=release)
        h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
    placer = h.placer()
    upgraded = Harness()
    for name in releases:
        upgraded.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        gpu = GpuState(rpc=f"tcp://{name}:5558", software_version="0.3.6")
        upgraded.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
    reference = upgraded.placer()
    later = bool(needs)
    params = {
        "": SamplingParams(),
        "0.3.2": SamplingParams(frequency_penalty=0.5),
        "0.3.3": SamplingParams(logprobs=2),
        "0.3.4": SamplingParams(prompt_logprobs=1),
        "0.3.5": SamplingParams(logit_bias={7: -100.0}) if keyed else
        SamplingParams(stop_token_ids=[2]),
        "0.3.6": SamplingParams(add_special_tokens=False),
    }[needs]  # fmt: skip
    assert release_asked(params) == release_of(needs)
    readers = {n for n, r in releases.items() if later and r >= needs} | {ME}
    for i in range(20):
        fields = {"v": 1, "id": f"t{i}", "prompt": PROMPT + str(i), "params": params,
                  "reply_to": "tcp://1.2.3.4:5", "key": f"s{i}" if keyed else ""}  # fmt: skip
        task = Task(**fields)
        owner = placer.owner_for(task, NOW)
        if later:
            assert owner in readers
            assert set(placer.order(task, NOW)) <= readers
            tried = frozenset({owner}) if owner is not None else frozenset()
            assert set(placer.order(task, NOW, exclude=tried)) <= readers - tried
        if not later or readers == set(releases) | {ME}:
            # Every member reads it: placed as if all were upgraded (ring, prefixes).
            assert owner == reference.owner_for(task, NOW)


def test_a_task_asking_later_params_that_no_reader_serves_is_refused_not_sent_to_an_older() -> None:
    """Drained ourselves, and every other member before 0.3.2: an older member would refuse
    the task and the whole frame it went in (other tasks' Cancels with it), so there is no
    owner: the forwarder refuses it unavailable, saying why."""
    from gossipd.core.sampling import SamplingParams

    h = Harness()
    for name in NAMES[:3]:
        h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
        gpu = GpuState(rpc=f"tcp://{name}:5558", software_version="0.3.1")
        h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
    placer = h.placer()
    placer.set_draining(True)
    fields = {"v": 1, "id": "t", "prompt": "p", "reply_to": "tcp://1.2.3.4:5"}
    assert placer.owner_for(Task(**fields), NOW) in NAMES[:3]
    asking = Task(**fields, params=SamplingParams(min_tokens=1))
    assert placer.owner_for(asking, NOW) is None and placer.order(asking, NOW) == []


def test_a_task_every_older_member_reads_keeps_its_prefix_placement_mid_upgrade() -> None:
    """Every other member at 0.3.2 (older than logprobs, not than penalties): a keyless task
    asking a penalty is placed as in an upgraded cluster, by its prompt's prefix, not spread
    by the full placement that leaving members out needs."""
    from gossipd.core.sampling import SamplingParams

    def placer_at(release: str) -> Placer:
        h = Harness()
        for name in NAMES:
            h.apply(Alive(node=name, incarnation=0, addr=f"tcp://{name}:1"))
            gpu = GpuState(rpc=f"tcp://{name}:5558", software_version=release)
            h.apply(Meta(node=name, version=1, gpu=gpu, incarnation=0))
        return h.placer()

    mid, upgraded = placer_at("0.3.2"), placer_at("0.3.3")
    for params in (SamplingParams(frequency_penalty=0.5), SamplingParams(logprobs=1)):
        for i in range(20):
            task = Task(v=1, id=f"t{i}", prompt=PROMPT + str(i), params=params,
                        reply_to="tcp://1.2.3.4:5")  # fmt: skip
            if params.logprobs is None:
                assert mid.owner_for(task, NOW) == upgraded.owner_for(task, NOW)
            else:  # (read by ourselves only: the rest are older)
                assert mid.owner_for(task, NOW) == ME
