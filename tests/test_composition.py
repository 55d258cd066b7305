"""The composition root (gossipd/daemon.py, and gossipd/fanout/assembly.py, which builds
membership and fan-out for it) passes dependencies through constructors: it never sets an
attribute of a part it built (issue 13: it used to set 18 hooks).  The one exception is the
ingress's links (IngressLinks), the composition root's own object, which closes the cycle
between the ingress and the parts built after it (fan-out, admin)."""

from __future__ import annotations

import ast
from pathlib import Path

import gossipd.daemon
import gossipd.fanout.assembly

COMPOSITION = [Path(gossipd.daemon.__file__), Path(gossipd.fanout.assembly.__file__)]
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
    if parts[0] in OWN_OBJECTS:  # links.x = ...: assembly.py is handed the daemon's links
        return False
    if parts[0] != "self":
        return True
    return len(parts) > 2 and parts[1] not in OWN_OBJECTS


def test_the_daemon_sets_no_attribute_of_a_part_it_built() -> None:
    offending = [
        (path.name, line, t)
        for path in COMPOSITION
        for line, t in attribute_assignments(ast.parse(path.read_text()))
        if foreign(t)
    ]
    assert offending == [], f"the composition sets attributes of its parts: {offending}"


def test_the_check_finds_a_hook_set_on_a_part() -> None:
    tree = ast.parse(
        "self.ingress.router = d.route\ngossip.model = m\nself.links.router = r\nlinks.hold = h\n"
    )
    found = [t for _, t in attribute_assignments(tree) if foreign(t)]
    assert found == ["self.ingress.router", "gossip.model"]


# The cycles the composition root still closes by a name bound after the closure that uses
# it (issue 25 took the rest out: placement before the owner endpoint and gossip, load
# gossip subscribing itself).  A new one fails here: build the part first, or subscribe.
LATE_NAMES_ALLOWED = {
    # the owner endpoint hands the dispatcher what peers send us as a forwarder (TaskDones
    # of tasks re-run from a journal, Confirms, ReplayQuerys about tasks they finished); the
    # dispatcher is built on the endpoint
    ("build_fanout", "dispatcher"),
    # the owner endpoint and the dispatcher hand the ResultHolder Withdraws and
    # ConfirmReplies of held Results; it asks the endpoint who forwarded what and sends its
    # Confirms through the dispatcher (before, the same cycle went through a daemon method)
    ("build_fanout", "holder"),
}


def closures_over_later_names(tree: ast.AST) -> set[tuple[str, str]]:
    """(function, name) for each lambda or nested function that reads a local of its
    enclosing function assigned only after the closure is written."""
    found: set[tuple[str, str]] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        bound: dict[str, int] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign | ast.AugAssign) or (
                isinstance(node, ast.AnnAssign) and node.value is not None
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for n in names:
                        if isinstance(n, ast.Name):  # a local
                            bound.setdefault(n.id, node.lineno)
                        elif _is_self_attr(n):  # or one of ours, self.part
                            bound.setdefault(ast.unparse(n), node.lineno)
        for inner in ast.walk(fn):
            if inner is fn or not isinstance(inner, ast.Lambda | ast.FunctionDef):
                continue
            own = {a.arg for a in inner.args.args} | {
                n.id
                for n in ast.walk(inner)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
            for n in ast.walk(inner):
                if (
                    isinstance(n, ast.Name)
                    and isinstance(n.ctx, ast.Load)
                    and n.id not in own
                    and bound.get(n.id, 0) > inner.lineno
                ):
                    found.add((fn.name, n.id))
                elif _is_self_attr(n) and bound.get(ast.unparse(n), 0) > inner.lineno:
                    found.add((fn.name, ast.unparse(n)))
    return found


def _is_self_attr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def test_the_daemon_closes_no_cycle_by_a_later_name_but_the_ones_it_names() -> None:
    found = set().union(*(closures_over_later_names(ast.parse(p.read_text())) for p in COMPOSITION))
    assert found == LATE_NAMES_ALLOWED


def test_the_check_finds_a_closure_over_a_name_bound_later() -> None:
    tree = ast.parse(
        "def build():\n"
        "    a = make(lambda: b.go())\n"
        "    def inner(x):\n"
        "        y = x\n"
        "        return y + a\n"
        "    b = make(inner)\n"
        "    c = make(lambda: self.holder.go())\n"
        "    self.holder = make(c)\n"
    )
    assert closures_over_later_names(tree) == {("build", "b"), ("build", "self.holder")}
