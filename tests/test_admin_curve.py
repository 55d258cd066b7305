"""`gossipd status`, `drain`, `undrain` and `submit` as a CURVE producer, with real daemons on
loopback (issue 24, items 3-4 of its contract): keys by flags or environment, answers sent
over a connection to the producer's key, a Drain for member B sent to member A relayed over
rpc and answered by B, a reply address on another loopback address (127.0.0.2, as a
producer on another host would give its own), and what the commands say when keys, a
daemon or a valid reply address are missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gossipd.tools.client import DEFAULT_REPLY_BIND, ProducerKeys
from gossipd.tools.launcher import free_tcp_port
from simulations.cluster import Cluster
from tests.helpers import wait_until
from tests.test_admin import send_keyed as send_keyed_to

pytestmark = pytest.mark.slow


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gossipd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    c = Cluster(3, log_dir=str(tmp_path_factory.mktemp("curve-admin")), curve=True)
    c.start()
    c.wait_converged(timeout_s=30)
    c.wait_meta(timeout_s=30)
    yield c
    c.stop()


def key_args(cluster: Cluster, node: str = "d00") -> list[str]:
    keys = cluster.keys
    assert keys is not None
    return [
        "--secret-key", str(keys.secrets / "producer.key_secret"),
        "--server-key", str(keys.peers / f"{node}.key"),
    ]  # fmt: skip


def status(cluster: Cluster, i: int, *extra: str) -> dict[str, Any]:
    endpoint = cluster.daemons[i].endpoint
    done = cli("status", "--json", "-e", endpoint, *key_args(cluster, f"d{i:02d}"), *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def rows(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["node"]: r for r in s["members"]}


def send_keyed(
    cluster: Cluster, n: int, tag: str, reply_bind: str = DEFAULT_REPLY_BIND
) -> Counter[str]:
    """tests/test_admin.py's send_keyed with this cluster's producer keys."""
    keys = cluster.keys
    assert keys is not None
    curve = ProducerKeys.from_files(
        str(keys.secrets / "producer.key_secret"),
        [str(keys.peers / f"{d.name}.key") for d in cluster.daemons],
    )
    endpoints = [d.endpoint for d in cluster.daemons]
    return send_keyed_to(endpoints, n, tag, curve=curve, reply_bind=reply_bind)


def test_status_with_keys_shows_every_member_asked_itself(cluster: Cluster) -> None:
    s = wait_until(
        lambda: (x := status(cluster, 0))["checksums_agree"] and x, 15, "checksum agreement"
    )
    assert s["members_live"] == 3
    for row in rows(s).values():
        assert row["reachable"] and row["status"] == "serving", row  # each asked itself
        assert len(row["seen_as"]) == 2
    # the same from the environment, and through another member
    keys = cluster.keys
    assert keys is not None
    env = {
        "GOSSIPD_SECRET_KEY": str(keys.secrets / "producer.key_secret"),
        "GOSSIPD_SERVER_KEY": str(keys.peers / "d02.key"),
    }
    done = cli("status", "--json", "-e", cluster.daemons[2].endpoint, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["members_live"] == 3
    # ...and from a producer configuration file (paths relative to it)
    conf = keys.root / "producer.toml"
    conf.write_text(
        '[producer]\nsecret_key = "secrets/producer.key_secret"\n'
        'server_key = ["peers/d01.key"]\nreply_bind = "tcp://127.0.0.3:*"\n'
    )
    done = cli(
        "status", "--json", "-e", cluster.daemons[1].endpoint, "--producer-config", str(conf)
    )
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    assert s["members_live"] == 3 and all(r["reachable"] for r in s["members"])


def test_a_member_whose_key_is_not_at_hand_is_shown_as_the_asked_daemon_sees_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    keys = cluster.keys
    assert keys is not None
    (tmp_path / "d00.key").write_bytes((keys.peers / "d00.key").read_bytes())  # d00's alone
    done = cli(
        "status", "--json", "-e", cluster.daemons[0].endpoint,
        "--secret-key", str(keys.secrets / "producer.key_secret"),
        "--server-key", str(tmp_path / "d00.key"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    assert s["members_live"] == 3 and rows(s)["d00"]["reachable"]
    assert not rows(s)["d01"]["reachable"] and "no d01.key" in rows(s)["d01"]["error"]


def test_drain_of_one_member_sent_to_another_is_relayed_and_answered(cluster: Cluster) -> None:
    d0 = cluster.daemons[0].endpoint
    assert send_keyed(cluster, 60, "before")["d01"] > 0
    done = cli("drain", "d01", "-e", d0, *key_args(cluster, "d00"))
    assert done.returncode == 0, done.stderr
    assert "d01: draining" in done.stdout  # d01's own answer, relayed by d00
    wait_until(
        lambda: set(rows(status(cluster, 0))["d01"]["seen_as"].values()) == {"draining"},
        10,
        "d01 draining in every view",
    )
    served_by = send_keyed(cluster, 90, "drained")
    assert served_by["d01"] == 0 and sum(served_by.values()) == 90
    done = cli("undrain", "d01", "-e", cluster.daemons[2].endpoint, *key_args(cluster, "d02"))
    assert done.returncode == 0 and "d01: serving" in done.stdout, done.stderr
    wait_until(
        lambda: set(rows(status(cluster, 0))["d01"]["seen_as"].values()) == {"serving"},
        10,
        "d01 serving in every view",
    )
    bad = cli("drain", "nobody", "-e", d0, *key_args(cluster))
    assert bad.returncode == 1 and "no live member named 'nobody'" in bad.stderr


def test_a_producer_with_its_reply_address_on_127_0_0_2(cluster: Cluster) -> None:
    reply = "tcp://127.0.0.2:*"
    assert sum(send_keyed(cluster, 50, "elsewhere", reply_bind=reply).values()) == 50
    s = status(cluster, 1, "--reply-bind", reply)
    assert s["members_live"] == 3 and all(r["reachable"] for r in s["members"])
    done = cli(
        "submit", "hello", "--json", "-e", cluster.daemons[1].endpoint,
        *key_args(cluster, "d01"), env={"GOSSIPD_REPLY_BIND": reply},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    done = cli(
        "drain", "d02", "-e", cluster.daemons[1].endpoint, "--reply-bind", reply,
        *key_args(cluster, "d01"), "--timeout", "5",
    )  # fmt: skip
    assert done.returncode == 0 and "d02: draining" in done.stdout, done.stderr
    done = cli(
        "undrain",
        "d02",
        "-e",
        cluster.daemons[0].endpoint,
        "--reply-bind",
        reply,
        *key_args(cluster),
    )
    assert done.returncode == 0 and "d02: serving" in done.stdout, done.stderr


def test_without_keys_a_curve_daemon_is_named_as_such(cluster: Cluster) -> None:
    endpoint = cluster.daemons[0].endpoint
    for args in (["status"], ["drain", "d01"]):
        done = cli(*args, "-e", endpoint, "--timeout", "1")
        assert done.returncode == 1
        assert "accepts connections" in done.stderr and "--secret-key" in done.stderr
    done = cli("status", "-e", endpoint, "--timeout", "1", *key_args(cluster, "d01"))
    assert done.returncode == 1 and "is --server-key that daemon's NODE.key" in done.stderr


def test_no_daemon_and_bad_reply_addresses_say_what_to_do() -> None:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    for args in (["status"], ["drain", "d01"], ["undrain", "d01"]):
        done = cli(*args, "-e", endpoint, "--timeout", "1")
        assert done.returncode == 1
        assert f"nothing listens at {endpoint}" in done.stderr and "gossipd run" in done.stderr
    for bind in ("tcp://0.0.0.0:*", "tcp://*:7000", "tcp://[::]:*"):
        for args in (
            ["status"],
            ["submit", "x"],
            ["drain", "d01"],
            ["cluster", "drain", "--follow"],
        ):
            done = (
                cli(*args, "-e", endpoint, "--reply-bind", bind)
                if args[0] != "cluster"
                else cli(*args, "--reply-bind", bind)
            )
            assert done.returncode == 2, (args, done.stderr)
            assert "not a wildcard host" in done.stderr
    done = cli("status", "-e", endpoint, env={"GOSSIPD_REPLY_BIND": "udp://x"})
    assert (
        done.returncode == 2
        and "GOSSIPD_REPLY_BIND 'udp://x': expected tcp://IP:PORT" in done.stderr
    )
    done = cli("submit", "x", "-e", endpoint, "--reply-bind", "tcp://192.0.2.1:*")
    assert done.returncode == 2 and "cannot bind the reply address" in done.stderr
