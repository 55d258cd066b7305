"""gossipd/ops/ is a leaf: no module in it imports the daemon's parts, not even for type
checking (the parts import ops/ for logs and metric primitives; the other way is a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parent.parent / "gossipd" / "ops"
PARTS = (
    "gossipd.ingress",
    "gossipd.fanout",
    "gossipd.membership",
    "gossipd.leader",
    "gossipd.engines",
    "gossipd.daemon",
    "gossipd.admin",
)


def _imported(tree: ast.AST) -> set[str]:
    """Every absolute module an import names, anywhere in the file (under TYPE_CHECKING,
    inside functions)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _parts_in(names: set[str]) -> set[str]:
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in PARTS)}


@pytest.mark.parametrize("path", sorted(OPS.glob("*.py")), ids=lambda p: p.name)
def test_ops_module_imports_no_part_of_the_daemon(path: Path) -> None:
    found = _parts_in(_imported(ast.parse(path.read_text())))
    assert not found, f"ops/{path.name} imports {sorted(found)}"


def test_the_check_sees_a_part_imported_for_type_checking_or_by_name() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from gossipd.fanout.forwarding import Dispatcher\n"
        "from gossipd import daemon\n"
        "from gossipd.ops import logs\n"
    )
    assert _parts_in(_imported(ast.parse(source))) == {
        "gossipd.fanout.forwarding",
        "gossipd.fanout.forwarding.Dispatcher",
        "gossipd.daemon",
    }
    assert len(list(OPS.glob("*.py"))) >= 10
