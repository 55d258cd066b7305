"""Rendered units with CURVE on (issue 24, items 1-2 of its contract): one key pair per
instance through ``{node_id}`` in security.secret_key_file, sibling seeds named by node id,
render's refusal of a shared key pair, `gossipd keygen` of several names, `check-config`
refusing what `run` refuses; and two instances started as their units say forming one
cluster over CURVE."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gossipd.config import load_config
from gossipd.ops import systemd
from gossipd.ops.topology import Gpu
from tests.helpers import gossipd_cli, wait_until
from tests.test_systemd import FAKE_GPUS, GOSSIPD_BIN, _free_base_port, make_fake_sysfs

HOST = socket.gethostname()
GPUS = [Gpu(index=i, pci_bus_id=f"0000:0{i}:00.0", numa_node=0, cpulist="0-3") for i in (0, 1)]


def _curve_toml(keys: Path, secret: str = "{node_id}.key_secret", extra: str = "") -> str:
    return (
        "[security]\ncurve = true\n"
        f'secret_key_file = "{keys / "secrets" / secret}"\n'
        f'peer_keys_dir = "{keys / "peers"}"\nproducer_keys_dir = "{keys / "producers"}"\n' + extra
    )


def _keys(root: Path, nodes: list[str], producers: list[str] = ["producer"]) -> Path:  # noqa: B006
    """The layout docs/OPERATIONS.md describes, made with `gossipd keygen NAME...`."""
    for folder in ("secrets", "peers", "producers"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    done = gossipd_cli("keygen", *nodes, *producers, "--out", str(root / "secrets"))
    assert done.returncode == 0, done.stderr
    for name in nodes:
        (root / "peers" / f"{name}.key").write_bytes(
            (root / "secrets" / f"{name}.key").read_bytes()
        )
    for name in producers:
        (root / "producers" / f"{name}.key").write_bytes(
            (root / "secrets" / f"{name}.key").read_bytes()
        )
    return root


def test_node_id_placeholder_is_the_daemons_own_id(tmp_path: Path) -> None:
    path = tmp_path / "gossipd.toml"
    path.write_text(_curve_toml(tmp_path) + "[node]\ngpu_index = 3\n")
    config = load_config(path, environ={}, hostname="h1")
    assert config.security.secret_key_file == str(tmp_path / "secrets" / "h1-gpu3.key_secret")
    named = load_config(path, environ={"GOSSIPD_NODE__ID": "n7-gpu1"}, hostname="h1")
    assert named.security.secret_key_file.endswith("/n7-gpu1.key_secret")
    raw = load_config(path, environ={}, hostname="")  # render's view: filled in per instance
    assert raw.security.secret_key_file.endswith("/{node_id}.key_secret")


def test_render_names_sibling_seeds_and_each_instances_key_file(tmp_path: Path) -> None:
    path = tmp_path / "gossipd.toml"
    path.write_text(
        _curve_toml(tmp_path) + '[node]\nid = "n1"\n[gossip]\nbind = "tcp://10.0.0.5:7946"\n'
        'seeds = ["n2-gpu0@tcp://10.0.0.6:7946"]\n'
    )
    instances = systemd.plan(load_config(path, environ={}, hostname=""), GPUS, hostname="h")
    assert [i.node_id for i in instances] == ["n1-gpu0", "n1-gpu1"]
    assert instances[1].key_file == str(tmp_path / "secrets" / "n1-gpu1.key_secret")
    env = systemd.read_env_file(systemd.render_env(instances[1], str(path)))
    config = load_config(path, environ=env, hostname="h")
    assert config.gossip.seeds == ["n2-gpu0@tcp://10.0.0.6:7946", "n1-gpu0@tcp://10.0.0.5:7946"]
    assert config.security.secret_key_file == instances[1].key_file


def test_render_refuses_one_key_pair_for_several_instances(tmp_path: Path) -> None:
    sysfs = make_fake_sysfs(tmp_path / "sys", FAKE_GPUS[:2])
    path = tmp_path / "gossipd.toml"
    path.write_text(_curve_toml(tmp_path, secret="node.key_secret"))
    out = tmp_path / "out"
    args = ["systemd", "render", "--out", str(out), "--sysfs", str(sysfs), "--config", str(path)]
    done = gossipd_cli(*args)
    assert done.returncode == 2
    assert "{node_id}" in done.stderr and "gossipd keygen" in done.stderr
    # one GPU: one instance, a fixed file is fine
    assert gossipd_cli(*args, "--gpus", "0").returncode == 0

    path.write_text(_curve_toml(tmp_path))
    done = gossipd_cli(*args)
    assert done.returncode == 0, done.stderr
    for i in (0, 1):
        key = tmp_path / "secrets" / f"{HOST}-gpu{i}.key_secret"
        assert f"gossipd@{i} {HOST}-gpu{i}: {key} (MISSING)" in done.stdout
    assert f"gossipd keygen {HOST}-gpu0 {HOST}-gpu1 --out {tmp_path / 'secrets'}" in done.stdout
    _keys(tmp_path, [f"{HOST}-gpu0", f"{HOST}-gpu1"])
    done = gossipd_cli(*args)
    assert done.stdout.count("(exists)") == 2 and "MISSING" not in done.stdout


def test_keygen_takes_several_names_and_overwrites_none(tmp_path: Path) -> None:
    done = gossipd_cli("keygen", "a-gpu0", "a-gpu1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a-gpu0.key", "a-gpu0.key_secret", "a-gpu1.key", "a-gpu1.key_secret",
    ]  # fmt: skip
    assert (tmp_path / "a-gpu1.key_secret").stat().st_mode & 0o777 == 0o600
    before = (tmp_path / "a-gpu0.key").read_bytes()
    done = gossipd_cli("keygen", "a-gpu2", "a-gpu0", "--out", str(tmp_path))
    assert done.returncode == 2 and "a-gpu0.key" in done.stderr
    assert not (tmp_path / "a-gpu2.key").exists()  # nothing written when one exists
    assert (tmp_path / "a-gpu0.key").read_bytes() == before


def test_check_config_refuses_what_run_refuses(tmp_path: Path) -> None:
    _keys(tmp_path, ["n-gpu0", "n-gpu1"])
    path = tmp_path / "gossipd.toml"

    def check(text: str) -> subprocess.CompletedProcess[str]:
        path.write_text(text)
        return gossipd_cli("check-config", "--config", str(path))

    done = check('[ingress]\nbind = "tcp://0.0.0.0:5557"\n')
    assert done.returncode == 2 and "without CURVE" in done.stderr
    done = check(f'[metrics]\nbind = "127.0.0.1:0"\nbearer_token_file = "{tmp_path}/no-token"\n')
    assert done.returncode == 2 and "bearer_token_file" in done.stderr
    done = check('[gossip]\nbind = ""\n[etcd]\nendpoints = ["127.0.0.1:2379"]\n')
    assert done.returncode == 2 and "etcd.endpoints needs membership" in done.stderr
    assert (
        check('[ingress]\nbind = "tcp://0.0.0.0:5557"\n[security]\ninsecure = true\n').returncode
        == 0
    )
    node = '[node]\nid = "n-gpu0"\n'
    done = check(_curve_toml(tmp_path) + node + '[gossip]\nseeds = ["tcp://127.0.0.1:7956"]\n')
    assert done.returncode == 2 and "NODE@tcp://HOST:PORT" in done.stderr
    ran = gossipd_cli("run", "--config", str(path))  # run refuses it the same way
    assert ran.returncode == 2 and "NODE@tcp://HOST:PORT" in ran.stderr
    done = check(
        _curve_toml(tmp_path) + node + '[gossip]\nseeds = ["n-gpu1@tcp://127.0.0.1:7956"]\n'
    )
    assert done.returncode == 0, done.stderr
    assert '"secret_key_file": "' + str(tmp_path / "secrets" / "n-gpu0.key_secret") in done.stdout
    # gpu1 serving gpu0's key pair: its peers would refuse it; caught before it starts
    done = check(_curve_toml(tmp_path, secret="n-gpu0.key_secret") + '[node]\nid = "n-gpu1"\n')
    assert done.returncode == 2 and "two instances sharing one key pair" in done.stderr
    done = check(_curve_toml(tmp_path) + '[node]\nid = "nobody"\n')
    assert done.returncode == 2 and "nobody.key_secret" in done.stderr and "keygen" in done.stderr


@pytest.mark.slow
def test_two_curve_instances_started_from_rendered_files_form_one_cluster(tmp_path: Path) -> None:
    """Rendered for 2 GPUs with CURVE, each instance started as its unit says (ExecStart=,
    N.env over gossipd.toml): each has its own key pair, joins the other through its named
    seed, and both see 2 members alive; a keyed `gossipd status` through either shows them."""
    taken: set[int] = set()
    ingress, rpc, gossip = (_free_base_port(10, 2, taken) for _ in range(3))
    nodes = [f"{HOST}-gpu0", f"{HOST}-gpu1"]
    keys = _keys(tmp_path / "keys", nodes)
    config_path = tmp_path / "gossipd.toml"
    config_path.write_text(
        f'[ingress]\nbind = "tcp://127.0.0.1:{ingress}"\n'
        f'[fanout]\nrpc_bind = "tcp://127.0.0.1:{rpc}"\n'
        f'[gossip]\nbind = "tcp://127.0.0.1:{gossip}"\npreset = "local"\n' + _curve_toml(keys)
    )
    sysfs = make_fake_sysfs(tmp_path / "sys", FAKE_GPUS[:2])
    out = tmp_path / "out"
    done = gossipd_cli(
        "systemd", "render", "--gpus", "0-1", "--out", str(out), "--sysfs", str(sysfs),
        "--config", str(config_path), "--bin", GOSSIPD_BIN,
        "--state-root", str(tmp_path / "state"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    service = (out / "etc/systemd/system/gossipd@.service").read_text()
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for i in (0, 1):
            env = {
                **os.environ,
                **systemd.read_env_file((out / f"etc/gossipd/{i}.env").read_text()),
            }
            (tmp_path / "state" / str(i)).mkdir(parents=True)
            log_path = tmp_path / f"gossipd@{i}.log"
            with log_path.open("wb") as log:
                procs.append(
                    (
                        subprocess.Popen(
                            systemd.exec_start_argv(service, str(i)),
                            env=env,
                            stdout=log,
                            stderr=log,
                        ),
                        log_path,
                    )
                )
        for i, (proc, log_path) in enumerate(procs):

            def curve_line(proc: subprocess.Popen[bytes] = proc, p: Path = log_path) -> dict:
                assert proc.poll() is None, p.read_text()
                lines = [json.loads(x) for x in re.findall(r"^\{.*\}$", p.read_text(), re.M)]
                return next((e for e in lines if e.get("msg") == "CURVE on"), {})

            line = wait_until(curve_line, 30, f"gossipd@{i}'s CURVE line")
            public = (keys / "peers" / f"{nodes[i]}.key").read_text()
            assert line["node"] == nodes[i] and line["public_key"] in public
            assert (line["peer_keys"], line["producer_keys"]) == (2, 1)
            assert line["peer_keys_dir"] == str(keys / "peers")
        key_args = [
            "--secret-key", str(keys / "secrets" / "producer.key_secret"),
            "--server-key", str(keys / "peers" / f"{nodes[0]}.key"),
        ]  # fmt: skip
        for i in (0, 1):
            args = ["status", "--json", "--endpoint", f"tcp://127.0.0.1:{ingress + 10 * i}"]
            args += [*key_args[:2], "--server-key", str(keys / "peers" / f"{nodes[i]}.key")]

            def two_alive(args: list[str] = args) -> dict | None:
                done = gossipd_cli(*args)
                if done.returncode != 0:
                    return None
                status = json.loads(done.stdout)
                return status if status["members_live"] == 2 else None

            status = wait_until(two_alive, 30, f"gossipd@{i} to see 2 members alive")
            assert sorted(row["node"] for row in status["members"]) == nodes
            assert all(row["reachable"] and row["live"] for row in status["members"])
            assert status["checksums_agree"]
        for _, log_path in procs:
            assert "src_mismatch" not in log_path.read_text()
            assert "not its key's node" not in log_path.read_text()
    finally:
        for proc, _ in procs:
            proc.terminate()
        deadline = time.monotonic() + 20
        for proc, _ in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc, _ in procs] == [0, 0]
