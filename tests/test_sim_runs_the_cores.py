"""The simulator runs the daemon's own cores (issue 25): the classes a simulated daemon drives
for placement, forwarding, the owner's decisions and admission are the ones the daemon
composes (gossipd/daemon.py, gossipd/fanout/assembly.py), and simulations/ defines none of that logic itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gossipd.config import load_config
from gossipd.daemon import Daemon
from simulations.fanout_run import FanoutRun
from simulations.fanout_world import World

SIMULATIONS = Path(__file__).resolve().parent.parent / "simulations"
# What only a core may decide: a class of this role defined under simulations/ is a copy.
CORE_ROLES = ("Placer", "Placement", "Owner", "Admission", "Forwarder", "TaskBook")


def test_a_simulated_daemon_drives_the_classes_the_daemon_composes() -> None:
    config = load_config(
        overrides=[
            'ingress.bind="tcp://127.0.0.1:0"',
            'fanout.rpc_bind="tcp://127.0.0.1:0"',
            'gossip.bind="tcp://127.0.0.1:0"',
            'journal.path=""',
            'metrics.bind=""',
        ]
    )
    daemon = Daemon(config)
    dispatcher = daemon._build_fanout("tcp://127.0.0.1:1").dispatcher
    try:
        world = World(FanoutRun(nodes=3, tasks=10, seed=1, faults=()))
        sim = world.daemons[0]
        assert type(sim.placement) is type(dispatcher.placer)
        assert type(sim.forwarder) is type(dispatcher.forwarder)
        assert type(sim.owner) is type(dispatcher.owner.core)
        assert type(sim.admission) is type(daemon.ingress.intake.admission)
        assert type(sim.book) is type(daemon.ingress.intake.book)
        # Forward.boot is set, as the daemon's is: an owner's stale rule runs (0 skips it).
        assert sim.forwarder.boot > 0 and dispatcher.forwarder.boot > 0
    finally:
        dispatcher.close()
        daemon._ctx.destroy(linger=0)


def _classes_defined(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def test_simulations_define_no_placement_owner_or_admission_of_their_own() -> None:
    copies = [
        f"{path.name}: {name}"
        for path in sorted(SIMULATIONS.rglob("*.py"))
        for name in _classes_defined(path)
        if any(role in name for role in CORE_ROLES)
    ]
    assert copies == [], f"simulations/ defines core logic of its own: {copies}"
    # ...nor calls the placement rules directly (it places through the daemon's Placer).
    calls = [
        path.name
        for path in sorted(SIMULATIONS.rglob("*.py"))
        if re.search(r"from gossipd\.core\.ring import [^\n]*\b(place|bound)\b", path.read_text())
    ]
    assert calls == [], f"simulations/ applies placement rules itself: {calls}"


def test_the_check_sees_a_class_of_a_core_role(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text("class SimPlacement:\n    pass\n")
    assert _classes_defined(source) == ["SimPlacement"]
    assert any(role in "SimPlacement" for role in CORE_ROLES)
