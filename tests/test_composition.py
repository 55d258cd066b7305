"""The composition root (gossipd/daemon.py) passes dependencies through constructors: it never
sets an attribute of a part it built (issue 13: it used to set 18 hooks).  The one exception
is the ingress's links (IngressLinks), the composition root's own object, which closes the
cycle between the ingress and the parts built after it (fan-out, admin)."""

from __future__ import annotations

import ast
from pathlib import Path

import gossipd.daemon

OWN_OBJECTS = {"links"}  # self.links: IngressLinks, connected once before messages flow


def attribute_assignments(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute):
                    found.append((t.lineno, ast.unparse(t)))
    return found


def foreign(target: str) -> bool:
    """``part.x = ...`` or ``self.part.x = ...``: setting an attribute of another object."""
    parts = target.split(".")
    if parts[0] != "self":
        return True
    return len(parts) > 2 and parts[1] not in OWN_OBJECTS


def test_the_daemon_sets_no_attribute_of_a_part_it_built() -> None:
    source = Path(gossipd.daemon.__file__).read_text()
    offending = [(line, t) for line, t in attribute_assignments(ast.parse(source)) if foreign(t)]
    assert offending == [], f"daemon.py sets attributes of its parts: {offending}"


def test_the_check_finds_a_hook_set_on_a_part() -> None:
    tree = ast.parse("self.ingress.router = d.route\ngossip.model = m\nself.links.router = r\n")
    found = [t for _, t in attribute_assignments(tree) if foreign(t)]
    assert found == ["self.ingress.router", "gossip.model"]
