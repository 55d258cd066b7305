"""The operator's acceptance test: docs/OPERATIONS.md's steps for a new node, run on a bed of 2
hosts x 2 GPUs as written (simulations/hosts_docs.py, hosts_accept.py), so that it fails when
the docs and the code part ways.  Root and `ip` needed (skipped without them, failed under
GOSSIPD_REQUIRE_NETNS=1, as in CI); the reading of the docs is checked everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations.hosts_docs import DocsDiverge, commands, plan
from tests.test_hosts import _require_bed

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "OPERATIONS.md"


def test_every_command_of_the_new_node_steps_is_run_or_stood_in_for() -> None:
    planned = plan(commands(OPERATIONS.read_text()))
    texts = [cmd.text for cmd, _ in planned]
    assert any(" systemd render " in t for t in texts)
    assert any(what == "toml" for _, what in planned)
    assert any("gossipd.target" in t for t in texts)


def test_a_command_the_bed_does_not_know_fails_the_reading() -> None:
    doc = OPERATIONS.read_text().replace(
        "cp -r /root/gossipd-units/etc/. /etc/", "rsync -a /root/gossipd-units/etc/ /etc/"
    )
    with pytest.raises(DocsDiverge, match="rsync -a"):
        plan(commands(doc))


def test_the_new_node_steps_of_operations_md_run_on_the_bed() -> None:
    _require_bed()
    from simulations.hosts_accept import run_acceptance

    log = run_acceptance(OPERATIONS, hosts=2, gpus=2)
    started = [entry for entry in log if "started" in entry]
    assert started and len(started[0]["started"]) == 4, log
    ran = [entry["command"] for entry in log if "host" in entry]
    assert any(" submit " in c for c in ran) and any(c.startswith("curl ") for c in ran), ran
