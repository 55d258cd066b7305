"""GpuState's protocol step (docs/PROTOCOL.md "Adding a field to GpuState"): daemons before
0.2.0 refuse a GpuState with a field they do not know, so a field added since
(``max_model_len``) is sent only while every live member reads unknown fields; from 0.2.0 a
GpuState's unknown fields are ignored."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.gossip_messages import Alive, GpuState, Meta, PushPull, reads_gpu_extras
from gossipd.core.membership import MemberTable, all_read_gpu_extras
from tests.test_swim_mechanisms import Wire, addr_of

# The reader of daemons before 0.2.0: GpuState's fields then, unknown ones refused.
GpuStateBefore020 = msgspec.defstruct(
    "GpuStateBefore020",
    [
        (f.name, f.type, f.default if f.default is not msgspec.NODEFAULT else f.default_factory())
        for f in msgspec.structs.fields(GpuState)
        if f.name != "max_model_len"
    ],
    kw_only=True,
    forbid_unknown_fields=True,
)


def _fields(gpu: GpuState) -> dict[str, object]:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(gpu))  # type: ignore[no-any-return]


def test_an_unset_max_model_len_is_not_on_the_wire_and_older_readers_take_it() -> None:
    gpu = GpuState(model="m", rpc="tcp://10.0.0.1:5558")
    assert "max_model_len" not in _fields(gpu)
    older = msgspec.msgpack.decode(msgspec.msgpack.encode(gpu), type=GpuStateBefore020)
    assert older.model == "m"  # type: ignore[attr-defined]
    with_len = msgspec.structs.replace(gpu, max_model_len=4096)
    assert _fields(with_len)["max_model_len"] == 4096
    try:
        msgspec.msgpack.decode(msgspec.msgpack.encode(with_len), type=GpuStateBefore020)
    except msgspec.ValidationError as exc:
        assert "max_model_len" in str(exc)  # why the step is needed
    else:
        raise AssertionError("a reader before 0.2.0 took a field it does not know")


@given(
    extra=st.dictionaries(
        st.text(min_size=1, max_size=12).filter(lambda k: k not in GpuState.__struct_fields__),
        st.one_of(st.integers(-(2**40), 2**40), st.text(max_size=20), st.booleans(), st.none()),
        max_size=6,
    ),
    length=st.one_of(st.none(), st.integers(1, 2**31)),
)
def test_a_gpu_state_reads_fields_it_does_not_know_as_absent(
    extra: dict[str, object], length: int | None
) -> None:
    gpu = GpuState(model="m", inflight=3, software_version="0.2.0")
    if length is not None:
        gpu = msgspec.structs.replace(gpu, max_model_len=length)
    data = msgspec.msgpack.encode({**_fields(gpu), **extra})
    assert msgspec.msgpack.decode(data, type=GpuState) == gpu


def test_reads_gpu_extras_from_0_2_0() -> None:
    assert reads_gpu_extras("0.2.0") and reads_gpu_extras("0.10.1") and reads_gpu_extras("1.0.0")
    assert reads_gpu_extras("0.2.0+g1234")
    for old in ("0.1.0", "0.1.9", "", "dev", "0.2", "x.y.z", "0.2.0.dev1", "0.2.0rc1", " 0.2.0"):
        assert not reads_gpu_extras(old), old


def _table(*versions: str | None) -> MemberTable:
    table = MemberTable(me="me", addr="tcp://10.0.0.1:7946", now=0.0)
    for i, version in enumerate(versions):
        node = f"n{i}"
        table.apply(Alive(node=node, incarnation=1, addr=f"tcp://10.0.1.{i + 1}:7946"), 0.0)
        if version is not None:
            gpu = GpuState(software_version=version)
            table.apply(Meta(node=node, version=1, gpu=gpu, incarnation=1), 0.0)
    return table


def test_the_field_goes_only_once_every_live_member_reads_it() -> None:
    # Alone (or not joined yet): no, so that a join to older members never carries it.
    assert not all_read_gpu_extras(_table().members.values(), "me")
    assert all_read_gpu_extras(_table("0.2.0", "0.3.1").members.values(), "me")
    assert not all_read_gpu_extras(_table("0.2.0", "0.1.0").members.values(), "me")
    # A member whose GpuState has not reached us yet: its version is not known.
    assert not all_read_gpu_extras(_table("0.2.0", None).members.values(), "me")


def test_our_meta_relayed_without_a_field_the_relay_does_not_know_is_still_ours() -> None:
    """Rule 8b: our Meta heard at our own (incarnation, version) with other content is a
    previous life's, but not when the only difference is a GPU_STATE_EXTRAS field that a
    relay older than it dropped (it reads unknown fields as absent)."""
    table = MemberTable(me="me", addr="tcp://10.0.0.1:7946", now=0.0)
    ours = GpuState(model="m", software_version="0.2.0", max_model_len=4096)
    table.publish_meta(ours)
    inc, version = table.meta_incarnation, table.meta_version
    dropped = msgspec.structs.replace(ours, max_model_len=msgspec.UNSET)
    assert not table.is_previous_life(inc, version, ours)
    assert not table.is_previous_life(inc, version, dropped)
    assert table.is_previous_life(inc, version, msgspec.structs.replace(ours, model="other"))
    assert table.is_previous_life(inc, version, msgspec.structs.replace(ours, max_model_len=8))
    assert table.is_previous_life(inc, version + 1, ours)


def _carries_extras(msg: object) -> bool:
    updates = getattr(msg, "updates", [])
    if any(type(u) is Meta and u.gpu.max_model_len is not msgspec.UNSET for u in updates):
        return True
    records = msg.members if isinstance(msg, PushPull) else []
    return any(r.gpu is not None and r.gpu.max_model_len is not msgspec.UNSET for r in records)


def _older_member_joins(wire: Wire) -> list[object]:
    """Three members of 0.2.0 that send the field; an older one joins through b: what every
    member sent to it."""
    for name, node in wire.nodes.items():
        node.send_gpu_extras = True  # as their shells say: every live member reads it
        node.set_gpu(0.0, GpuState(software_version="0.2.0", model=name, max_model_len=4096))
    wire.run_until(3.0)
    assert all(
        m.gpu is not None and m.gpu.max_model_len == 4096
        for node in wire.nodes.values()
        for m in node.table.members.values()
    )
    assert any(_carries_extras(m) for _, _, _, m in wire.sent), "sent while all read it"
    older = wire.add("o", seeds=(addr_of("b"),))
    older.set_gpu(wire.now, GpuState(software_version="0.1.0", model="o"))
    wire.run_until(10.0)
    assert set(older.table.members) == {"a", "b", "c"}
    return [m for _, _, dst, m in wire.sent if dst == addr_of("o")]


def test_an_older_member_that_joins_is_sent_no_field_it_refuses() -> None:
    """Once a member joins (or comes back) whose version is not known to read GpuState's
    newer fields, nothing sent to it carries them: not our own Meta, not others' Metas we
    relay, not the records of a push-pull (SwimNode.send_gpu_extras, header, antientropy)."""
    to_older = _older_member_joins(Wire(["a", "b", "c"], seed=5))
    assert to_older and not [m for m in to_older if _carries_extras(m)]


def test_without_the_stripping_the_older_member_would_be_sent_the_field(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The check above can fail: with the sending rules undone, the older member hears it."""
    import gossipd.core.antientropy as antientropy
    import gossipd.core.swim as swim

    monkeypatch.setattr(swim, "sendable", lambda u: u)
    monkeypatch.setattr(antientropy, "sendable_record", lambda r: r)
    monkeypatch.setattr(antientropy, "without_extras", lambda g: g)
    to_older = _older_member_joins(Wire(["a", "b", "c"], seed=5))
    assert [m for m in to_older if _carries_extras(m)]
