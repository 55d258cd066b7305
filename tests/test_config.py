"""Configuration: the embedded default, overrides, and one clear line for each mistake."""

from __future__ import annotations

import dataclasses
import json
import random
import socket
from pathlib import Path

import pytest
import zmq

from gossipd.config import Config, load_config
from gossipd.core.swim_config import SwimConfig, field_bounds
from gossipd.engines.echo import EchoEngine
from gossipd.errors import ConfigError
from gossipd.membership.gossip import GossipService
from gossipd.sockets import SocketPool
from tests.helpers import RawProducer, gossipd_cli, wait_until

ROOT = Path(__file__).resolve().parents[1]


def test_configs_local_toml_is_the_embedded_default() -> None:
    assert load_config(ROOT / "configs" / "local.toml", environ={}) == Config()


def test_environment_then_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[ingress]\npending_max = 500\nbind = "tcp://127.0.0.1:7000"\n')
    config = load_config(
        path,
        environ={"GOSSIPD_INGRESS__PENDING_MAX": "600", "GOSSIPD_LOG__LEVEL": "debug"},
        overrides=["ingress.pending_max=700"],
    )
    assert config.ingress.pending_max == 700
    assert config.ingress.bind == "tcp://127.0.0.1:7000"
    assert config.log.level == "debug"


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "expected"),
    [
        (
            "[ingress]\nqueue = 5\n",
            {},
            [],
            "c.toml: ingress.queue: unknown key; expected one of: bind,",
        ),
        (
            "[ingress]\npending_max = 'ten'\n",
            {},
            [],
            "c.toml: ingress.pending_max: expected `int`, got `str`",
        ),
        (
            "[ingress]\nbind = 'udp://x'\n",
            {},
            [],
            "c.toml: ingress.bind: expected tcp://HOST:PORT or ipc://PATH, found 'udp://x'",
        ),
        ("[nope]\n", {}, [], "c.toml: nope: unknown key"),
        ("x = [", {}, [], "c.toml: not valid TOML"),
        (
            "",
            {"GOSSIPD_INGRESS__PENDING_MAX": "-3"},
            [],
            "environment variable GOSSIPD_INGRESS__PENDING_MAX: ingress.pending_max: expected `int` >= 1",
        ),
        (
            "",
            {},
            ["engine.kind=cuda"],
            "flag --set engine.kind: engine.kind: invalid enum value 'cuda'",
        ),
        (
            "",
            {},
            ["ingress.pending_max=10"],
            "ingress.pending_max: must be >= concurrency_max (256), found 10",
        ),
        ("", {}, ["garbage"], "--set 'garbage': expected SECTION.KEY=VALUE"),
        (
            "[gossip.swim]\nprobe_intervl_s = 2.0\n",
            {},
            [],
            "c.toml: gossip.swim.probe_intervl_s: unknown key; expected one of: probe_interval_s,",
        ),
        (
            "",
            {"GOSSIPD_GOSSIP__SWIM__GOSSIP_FANOUT": "'three'"},
            [],
            "environment variable GOSSIPD_GOSSIP__SWIM__GOSSIP_FANOUT: gossip.swim.gossip_fanout: "
            "expected `int`, got `str`",
        ),
        (
            "",
            {},
            ["gossip.swim.cluster='other'"],
            "flag --set gossip.swim.cluster: gossip.swim.cluster: unknown key",  # node.cluster
        ),
        (
            "",
            {},
            ["gossip.swim.probe_deadline_s=2.0"],
            "flag --set gossip.swim.probe_deadline_s: gossip.swim.probe_deadline_s: "
            "probe_interval_s must be >= probe_deadline_s (2.0), found 1.0 "
            "(over gossip.preset 'lan')",
        ),
        (
            "[gossip]\npreset = 'wan'\nswim = {piggyback_bytes_max = 9000}\n",
            {},
            ["gossip.swim.message_bytes_max=8192"],
            "c.toml: gossip.swim.piggyback_bytes_max: must be <= message_bytes_max (8192), "
            "found 9000 (over gossip.preset 'wan')",
        ),
        (
            "",
            {},
            ["fanout.ack_timeout_s=0.02"],
            "ack_delay_s (0.005) must be at most a tenth of ack_timeout_s (0.02)",
        ),
    ],
)
def test_bad_configuration_names_source_key_found_and_expected(
    tmp_path: Path, text: str, environ: dict[str, str], overrides: list[str], expected: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=environ, overrides=overrides)
    assert expected in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load_config(tmp_path / "missing.toml", environ={})


def test_cli_exits_2_with_one_line_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[ingress]\nconcurrency_max = 'lots'\n")
    proc = gossipd_cli("run", "--config", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert (
        str(path) in lines[0]
        and "ingress.concurrency_max" in lines[0]
        and "expected `int`" in lines[0]
    )


def test_check_config_prints_the_resolved_configuration() -> None:
    proc = gossipd_cli("check-config", "--set", "ingress.pending_max=4096")
    assert proc.returncode == 0
    assert '"pending_max": 4096' in proc.stdout


@pytest.mark.parametrize("command", ["check-config", "run"])
def test_an_out_of_range_swim_setting_stops_the_cli_with_one_line_and_status_2(
    command: str,
) -> None:
    proc = gossipd_cli(command, "--set", "gossip.swim={probe_interval_s=-1}")
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "gossipd: configuration error: flag --set gossip.swim: gossip.swim.probe_interval_s: "
        "expected `float` > 0.0; found -1"
    ]


@pytest.mark.parametrize(
    ("name", "bound", "outside"),
    [
        (name, bound, outside)
        for name, meta in field_bounds().items()
        for bound, outside in [
            ("gt", None if meta.gt is None else meta.gt),
            ("ge", None if meta.ge is None else meta.ge - 1),
            ("le", None if meta.le is None else meta.le * 2),
        ]
        if outside is not None
    ],
)
def test_every_bounded_swim_setting_is_refused_outside_its_bound_by_config_and_core(
    name: str, bound: str, outside: float
) -> None:
    """The bounds live once, in SwimConfig's field types: the configuration refuses a value
    outside one (naming the key), and so does SwimConfig built in code (the simulator)."""
    with pytest.raises(
        ConfigError, match=rf"flag --set gossip\.swim\.{name}: gossip\.swim\.{name}: "
    ):
        load_config(environ={}, overrides=[f"gossip.swim.{name}={outside!r}"])
    with pytest.raises(ValueError, match=rf"^{name}: must be"):
        SwimConfig.lan(**{name: outside})


def test_swim_overrides_over_a_preset_reach_the_gossip_service() -> None:
    config = load_config(
        environ={"GOSSIPD_GOSSIP__SWIM__GOSSIP_FANOUT": "5"},
        overrides=[
            "gossip.preset=wan",
            "gossip.swim={suspicion_floor_s=9.5, coordinated_probing=false}",
            "node.cluster=blue",
        ],
    )
    ctx = zmq.Context()
    try:
        service = GossipService(
            config,
            node="n",
            sockets=SocketPool(ctx),
            engine=EchoEngine(),
            ingress_endpoint="tcp://x:1",
            rng=random.Random(1),
        )
    finally:
        ctx.term()
    expected = SwimConfig.wan(
        cluster="blue", suspicion_floor_s=9.5, coordinated_probing=False, gossip_fanout=5
    )
    assert service.swim_config == expected
    assert service.swim_config.probe_interval_s == 5.0, "the rest is the wan preset's"


def test_check_config_prints_the_resolved_swim_settings() -> None:
    proc = gossipd_cli(
        "check-config", "--set", "gossip.preset=local", "--set", "gossip.swim.heal_fanout=7"
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)["gossip"]["swim"]
    expected = dataclasses.asdict(SwimConfig.local(heal_fanout=7))
    del expected["cluster"]  # node.cluster
    assert printed == expected


def test_every_swim_setting_is_documented_in_operations_md() -> None:
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    names = [n for n in SwimConfig.field_names() if n != "cluster"]
    assert [n for n in names if f"| `{n}` |" not in text] == []


def test_an_address_in_use_stops_start_up_with_one_line_and_status_2(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    first = daemon_factory()
    proc = gossipd_cli(
        "run",
        "--bind",
        first.endpoint,
        "--set",
        "gossip.bind=tcp://127.0.0.1:0",
        "--set",
        "fanout.rpc_bind=tcp://127.0.0.1:0",
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("gossipd: cannot start: cannot bind ingress.bind")
    assert "Address already in use" in lines[-1] and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("key", "receiver"),
    [("gossip.bind", "loop"), ("gossip.bind", "zmq"), ("fanout.rpc_bind", "loop")],
)
def test_a_membership_or_rpc_address_in_use_stops_start_up_with_one_line_and_status_2(
    key: str, receiver: str
) -> None:
    """The loop listens on those (gossip.receiver, fanout.peer_transport "loop"): its
    OSError is a start-up error as libzmq's ZMQError is, not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        settings = {"gossip.bind": "tcp://127.0.0.1:0", "fanout.rpc_bind": "tcp://127.0.0.1:0"}
        settings[key] = addr
        args = ["run", "--bind", "tcp://127.0.0.1:0", "--set", f"gossip.receiver={receiver}"]
        for name, value in settings.items():
            args += ["--set", f"{name}={value}"]
        proc = gossipd_cli(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"gossipd: cannot start: cannot bind {key}"), lines[-1]
    assert "Address already in use" in lines[-1] and "Traceback" not in proc.stderr


def test_a_membership_socket_at_an_ipc_path_serves(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """gossip.receiver "loop" speaks tcp:// only: an ipc:// bind keeps libzmq's PULL (it
    stopped start-up with a traceback), and a member gossips with it."""
    endpoint = f"ipc://{tmp_path}/gossip.sock"
    first = daemon_factory(f'gossip.bind="{endpoint}"', 'node.id="a"', name="a")
    bound = next(e["gossip"] for e in first.events() if e.get("msg") == "serving")
    assert bound == endpoint
    second = daemon_factory(f'gossip.seeds=["{bound}"]', 'node.id="b"', name="b")
    wait_until(
        lambda: (
            any(
                e.get("msg") == "member" and e.get("event") == "joined" and e.get("member") == "b"
                for e in first.events()
            )
            or None
        ),
        10,
        "the second member joined in the first's view",
    )
    assert second.proc.poll() is None


def test_an_ingress_at_any_free_port_serves(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Port * (libzmq's "any free port"), which the loop's PULL once took for no port (and
    stopped start-up with a traceback), is the kernel's pick, as port 0."""
    daemon = daemon_factory('ingress.bind="tcp://127.0.0.1:*"', 'gossip.bind=""')
    endpoint = next(e["endpoint"] for e in daemon.events() if e.get("msg") == "serving")
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
    producer = RawProducer(endpoint)
    try:
        producer.send_task("t1")
        assert [r["ok"] for r in producer.results(1, timeout_s=10)] == [True]
    finally:
        producer.close()


def test_an_unusable_journal_path_stops_start_up_with_status_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = gossipd_cli(
        "run",
        "--set",
        f"journal.path={str(blocker / 'j.log')!r}",
        "--set",
        "ingress.bind=tcp://127.0.0.1:0",
        "--set",
        "gossip.bind=tcp://127.0.0.1:0",
        "--set",
        "fanout.rpc_bind=tcp://127.0.0.1:0",
    )
    assert proc.returncode == 2
    assert "cannot open journal.path" in proc.stderr and "Traceback" not in proc.stderr


def test_a_vllm_engine_without_a_model_directory_stops_start_up_with_status_2(
    tmp_path: Path,
) -> None:
    proc = gossipd_cli(
        "run",
        "--set",
        "engine.kind=vllm",
        "--set",
        f'engine.model="{tmp_path / "missing"}"',
        "--set",
        'gossip.bind=""',
        "--bind",
        "tcp://127.0.0.1:0",
    )
    assert proc.returncode == 2
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("gossipd: cannot start: engine.model")  # (before binding now)
    assert "not a model directory" in last and "make-tiny" in last
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("what", ["model", "journal"])
def test_check_config_refuses_what_run_would_stop_on_after_binding(
    tmp_path: Path, what: str
) -> None:
    """`gossipd check-config` promises exit 2 wherever `run` would stop: a vLLM engine's
    model directory without config.json and a journal path that cannot be opened were
    found only by `run` (after binding; under systemd, a restart loop)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    settings = (
        ["engine.kind=vllm", f'engine.model="{tmp_path / "missing"}"']
        if what == "model"
        else [f"journal.path={str(blocker / 'j.log')!r}"]
    )
    proc = gossipd_cli("check-config", *(a for s in settings for a in ("--set", s)))
    assert proc.returncode == 2, proc.stdout
    assert ("not a model directory" if what == "model" else "cannot open journal.path") in (
        proc.stderr
    )
    fine = gossipd_cli("check-config", "--set", f"journal.path={str(tmp_path / 'a' / 'j')!r}")
    assert fine.returncode == 0, fine.stderr


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ('gossip.advertise="ipc:///tmp/my dir/g.sock"', "gossip.advertise: members could not"),
        ('gossip.advertise="tcp://10.0.0.1:0"', "port 0 is outside 1..65535"),
        ('gossip.bind="tcp://10.0.0.1:70000"', "gossip.bind: port 70000 is outside"),
        ('gossip.seeds=["tcp://10.0.0.2:99999"]', "gossip.seeds: port 99999 is outside"),
        ('fanout.rpc_advertise="ipc:///tmp/a\tb"', "fanout.rpc_advertise: members could not"),
        ('fanout.rpc_bind="tcp://10.0.0.1:5558\n"', "expected tcp://HOST:PORT"),  # (\Z, not $)
    ],
)
def test_an_address_members_would_refuse_in_gossip_stops_start_up(
    override: str, expected: str
) -> None:
    """Members refuse gossip that names an address no socket connects to: a daemon that
    advertised one would stay out of the cluster, so its config is refused instead."""
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        load_config(environ={}, overrides=[override])


@pytest.mark.parametrize(
    "override",
    ['gossip.bind="tcp://127.0.0.1:0"', 'gossip.bind="tcp://*:7946"',
     'gossip.advertise="tcp://node-1.example:7946"', 'fanout.rpc_bind="tcp://[::1]:0"'],
)  # fmt: skip
def test_binds_to_port_0_or_every_address_still_start(override: str) -> None:
    extra = ['gossip.advertise="tcp://10.0.0.1:7946"'] if "*" in override else []
    load_config(environ={}, overrides=[override, *extra])


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("ingress.bind=tcp://127.0.0.1:99999", "ingress.bind: port 99999"),
        ("gossip.bind=tcp://127.0.0.1:65536", "gossip.bind: port 65536"),
        ('metrics.bind="127.0.0.1:99999"', "metrics.bind: port 99999"),
        ('http.bind="127.0.0.1:70000"', "http.bind: port 70000"),
        ('etcd.endpoints=["127.0.0.1:99999"]', "etcd.endpoints: port 99999"),
        ('etcd.endpoints=["127.0.0.1:0"]', "etcd.endpoints: port 0"),
    ],
)
def test_a_port_outside_the_tcp_range_is_refused_naming_its_key(override: str, named: str) -> None:
    """Five digits were taken: ZeroMQ bound 99999 as 34463 (99999 mod 65536) and said it
    served there; Python's bind raised OverflowError out of run (a review's reproduction)."""
    from gossipd.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides=[override])
