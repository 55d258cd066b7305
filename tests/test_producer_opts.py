"""The producer-side options every command shares (gossipd/tools/producer_opts.py): a flag
beats its variable, which beats the [producer] file; wildcard and malformed reply addresses
and unknown file keys are refused with what to do."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import zmq.auth

from gossipd.errors import StartupError
from gossipd.security import write_key_pair
from gossipd.tools import producer_opts
from gossipd.tools.producer_opts import add_producer_args, producer_keys, reply_bind


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_producer_args(p)
    return p.parse_args(list(argv))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REPLY_BIND", "SECRET_KEY", "SERVER_KEY", "PRODUCER_CONFIG"):
        monkeypatch.delenv(f"GOSSIPD_{name}", raising=False)


def test_reply_bind_default_flag_env_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert reply_bind(parse()) == "tcp://127.0.0.1:*"
    conf = tmp_path / "producer.toml"
    conf.write_text('[producer]\nreply_bind = "tcp://10.0.0.20:*"\n')
    assert reply_bind(parse("--producer-config", str(conf))) == "tcp://10.0.0.20:*"
    monkeypatch.setenv("GOSSIPD_PRODUCER_CONFIG", str(conf))
    assert reply_bind(parse()) == "tcp://10.0.0.20:*"
    monkeypatch.setenv("GOSSIPD_REPLY_BIND", "tcp://10.0.0.21:7000")
    assert reply_bind(parse()) == "tcp://10.0.0.21:7000"
    assert reply_bind(parse("--reply-bind", "tcp://[fd00::5]:*")) == "tcp://[fd00::5]:*"


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:*", "tcp://*:5000", "tcp://[::]:*"])
def test_a_wildcard_reply_host_is_refused(bind: str) -> None:
    with pytest.raises(StartupError, match="not a wildcard host"):
        reply_bind(parse("--reply-bind", bind))


@pytest.mark.parametrize(
    "bind", ["udp://1.2.3.4:5", "tcp://10.0.0.1", "ipc:///tmp/x", "10.0.0.1:5"]
)
def test_a_malformed_reply_address_is_refused(bind: str) -> None:
    with pytest.raises(StartupError, match=r"expected tcp://IP:PORT"):
        reply_bind(parse("--reply-bind", bind))


def test_keys_from_a_producer_file_relative_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_key_pair("me", tmp_path / "keys")
    write_key_pair("n1-gpu0", tmp_path / "keys" / "peers")
    write_key_pair("n1-gpu1", tmp_path / "keys" / "peers")
    conf = tmp_path / "keys" / "producer.toml"
    conf.write_text('[producer]\nsecret_key = "me.key_secret"\nserver_key = "peers/n1-gpu0.key"\n')
    args = parse("--producer-config", str(conf))
    keys = producer_keys(args, ["tcp://127.0.0.1:5557"])
    assert keys is not None
    assert keys.public == zmq.auth.load_certificate(str(tmp_path / "keys" / "me.key"))[0]
    find = producer_opts.member_key_finder(args)
    assert find("n1-gpu1") is not None and find("nobody") is None and find("../me") is None
    # a flag wins over the file; so does the variable
    monkeypatch.setenv("GOSSIPD_SERVER_KEY", str(tmp_path / "keys" / "peers" / "n1-gpu1.key"))
    assert producer_keys(args, ["e"]).server_keys == [find("n1-gpu1")]  # type: ignore[union-attr]
    assert producer_keys(
        parse(
            "--producer-config",
            str(conf),
            "--server-key",
            str(tmp_path / "keys" / "peers" / "n1-gpu0.key"),
        ),
        ["e"],
    ).server_keys == [find("n1-gpu0")]  # type: ignore[union-attr]


def test_a_bad_producer_file_says_what_is_wrong(tmp_path: Path) -> None:
    conf = tmp_path / "p.toml"
    conf.write_text('[producer]\nsecret = "x"\n')
    with pytest.raises(
        StartupError, match="secret: unknown; expected secret_key, server_key, reply_bind"
    ):
        reply_bind(parse("--producer-config", str(conf)))
    conf.write_text("reply_bind = 1\n")
    with pytest.raises(StartupError, match=r"expected a \[producer\] table"):
        reply_bind(parse("--producer-config", str(conf)))
    with pytest.raises(StartupError, match="cannot read the producer configuration"):
        reply_bind(parse("--producer-config", str(tmp_path / "missing.toml")))
    with pytest.raises(StartupError, match="both --secret-key FILE and --server-key FILE"):
        conf.write_text('[producer]\nsecret_key = "me.key_secret"\n')
        producer_keys(parse("--producer-config", str(conf)), ["e"])


@pytest.mark.parametrize(
    ("ingress", "gossip", "asked"),
    [
        ("tcp://0.0.0.0:5567", "tcp://10.0.0.5:7956", "tcp://10.0.0.5:5567"),
        ("tcp://[::]:5567", "tcp://[fd00::5]:7956", "tcp://[fd00::5]:5567"),
        ("tcp://10.0.0.7:5557", "tcp://10.0.0.5:7946", "tcp://10.0.0.7:5557"),
        ("ipc:///run/gossipd/0", "tcp://10.0.0.5:7946", "ipc:///run/gossipd/0"),
    ],
)
def test_status_asks_a_wildcard_ingress_at_its_members_gossip_host(
    ingress: str, gossip: str, asked: str
) -> None:
    from gossipd.tools.admin import reachable_ingress

    assert reachable_ingress(ingress, gossip) == asked


def test_a_loopback_reply_address_for_a_daemon_elsewhere_is_warned_of(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reply_bind(parse(), ["tcp://127.0.0.1:5557", "ipc:///tmp/x"])
    assert capsys.readouterr().err == ""
    reply_bind(parse(), ["tcp://10.0.0.5:5557"])
    assert "--reply-bind tcp://THIS_HOST_IP:*" in capsys.readouterr().err
    reply_bind(parse("--reply-bind", "tcp://10.0.0.20:*"), ["tcp://10.0.0.5:5557"])
    assert capsys.readouterr().err == ""


def test_several_server_keys_suit_submit_and_cluster_drain_not_a_one_daemon_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One environment for every command: GOSSIPD_SERVER_KEY made for `submit -e A -e B -e C`
    serves submit and cluster drain (etcd only); status/drain/undrain ask one daemon and say
    which key they need instead of a count that does not apply."""
    write_key_pair("me", tmp_path)
    keys = [str(write_key_pair(f"n{i}", tmp_path)[0]) for i in range(3)]
    monkeypatch.setenv("GOSSIPD_SECRET_KEY", str(tmp_path / "me.key_secret"))
    monkeypatch.setenv("GOSSIPD_SERVER_KEY", ",".join(keys))
    assert len(producer_keys(parse(), ["a", "b", "c"]).server_keys) == 3  # type: ignore[union-attr]
    assert producer_keys(parse(), None) is not None
    with pytest.raises(StartupError, match=r"asks one daemon: give its NODE\.key once"):
        producer_keys(parse(), ["a"])
    with pytest.raises(StartupError, match=r"once per --endpoint \(2\)"):
        producer_keys(parse(), ["a", "b"])
