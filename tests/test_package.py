"""The package's shape: sfttrain's modules import one another without a circle."""

from __future__ import annotations

import ast

from tests.conftest import REPO


def imports_of_each_module() -> dict[str, set[str]]:
    """module -> the sfttrain modules it imports anywhere in its text (at its top or inside a function)."""
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (REPO / "sfttrain").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                named |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in named if m in paths and m != name}
    return graph


def test_no_module_reaches_itself_through_its_imports():
    """A circle of imports (a module that imports, through others, itself) would make the order of
    imports matter and the layers of the package meaningless; lazy imports inside functions count too."""
    graph = imports_of_each_module()
    assert {"sfttrain.trainer", "sfttrain.checkpoint", "sfttrain.data.loader"} <= set(graph)  # the walk found them
    assert "sfttrain.checkpoint" in graph["sfttrain.trainer"]
    circles = []
    for start in graph:
        reached, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in reached:
                reached.add(module)
                todo += graph[module]
        if start in reached:
            circles.append(start)
    assert not circles, f"modules that import themselves through others: {circles}"
