"""The protocol core is sans-IO: no module under gossipd/core/ imports IO, reads a clock or
draws from the global random generator (time and randomness are passed in)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "gossipd" / "core"
FORBIDDEN = {
    "asyncio",
    "zmq",
    "socket",
    "time",
    "os",
    "threading",
    "uvloop",
    "select",
    "secrets",
    "subprocess",
    "signal",
    "selectors",
    "datetime",
}


def _core_modules() -> list[Path]:
    return sorted(CORE.glob("*.py"))


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", _core_modules(), ids=lambda p: p.name)
def test_core_module_imports_no_io(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert not (_imports(tree) & FORBIDDEN), f"{path.name} imports {_imports(tree) & FORBIDDEN}"
    # `random` only as the type of an injected generator: random.Random(...), never random.x().
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "random"
        ):
            assert node.attr == "Random", f"{path.name} uses random.{node.attr}"


def test_the_check_sees_a_forbidden_import() -> None:
    assert _imports(ast.parse("import time\nfrom zmq import asyncio")) == {"time", "zmq"}
    assert len(_core_modules()) >= 15
