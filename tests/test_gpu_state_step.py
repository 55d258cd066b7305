"""GpuState's first protocol step (docs/PROTOCOL.md "Adding a field to GpuState"): daemons
before 0.2.0 refuse a GpuState with a key they do not know (and the whole gossip message
with it); from 0.2.0 unknown keys are ignored, so that a later release can add a field."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gossipd.core.gossip_messages import (
    GossipOnly,
    GpuState,
    Meta,
    decode_gossip,
    encode_gossip,
)

# The reader of daemons before 0.2.0: the same fields, unknown ones refused.
GpuStateBefore020 = msgspec.defstruct(
    "GpuStateBefore020",
    [
        (f.name, f.type, f.default if f.default is not msgspec.NODEFAULT else f.default_factory())
        for f in msgspec.structs.fields(GpuState)
    ],
    kw_only=True,
    forbid_unknown_fields=True,
)


def _fields(gpu: GpuState) -> dict[str, object]:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(gpu))  # type: ignore[no-any-return]


@given(
    extra=st.dictionaries(
        st.text(min_size=1, max_size=12).filter(lambda k: k not in GpuState.__struct_fields__),
        st.one_of(st.integers(-(2**40), 2**40), st.text(max_size=20), st.booleans(), st.none()),
        max_size=6,
    )
)
def test_a_gpu_state_reads_keys_it_does_not_know_as_absent(extra: dict[str, object]) -> None:
    gpu = GpuState(model="m", inflight=3, software_version="0.2.0", prefixes=[1, 2])
    data = msgspec.msgpack.encode({**_fields(gpu), **extra})
    assert msgspec.msgpack.decode(data, type=GpuState) == gpu
    if extra:  # what a daemon before 0.2.0 refused
        try:
            msgspec.msgpack.decode(data, type=GpuStateBefore020)
        except msgspec.ValidationError as exc:
            assert "unknown field" in str(exc).lower() or "object contains" in str(exc).lower()
        else:
            raise AssertionError("the older reader took a key it does not know")


def test_a_gossip_message_with_a_later_releases_gpu_key_is_read() -> None:
    """A Meta from a later release (a key added to gpu) piggybacked on a message: read, the
    key dropped, the rest kept (before 0.2.0 the whole message was refused)."""
    gpu = GpuState(model="m", software_version="0.3.0")
    meta = Meta(node="n1", version=2, gpu=gpu, incarnation=1)
    raw = msgspec.msgpack.decode(
        encode_gossip(
            GossipOnly(cluster="default", src="n1", src_addr="tcp://10.0.0.1:7946", updates=[meta])
        )
    )
    raw["updates"][0]["gpu"]["max_model_len"] = 4096
    message = decode_gossip(msgspec.msgpack.encode(raw), bytes_max=1 << 20)
    assert message.updates == [meta]


def test_what_0_2_0_sends_an_older_daemon_still_reads() -> None:
    """0.2.0 adds no key: its GpuState is one a daemon before 0.2.0 takes."""
    gpu = GpuState(model="m", rpc="tcp://10.0.0.1:5558", software_version="0.2.0", prefixes=[7])
    older = msgspec.msgpack.decode(msgspec.msgpack.encode(gpu), type=GpuStateBefore020)
    assert msgspec.structs.asdict(older) == msgspec.structs.asdict(gpu)  # type: ignore[arg-type]
