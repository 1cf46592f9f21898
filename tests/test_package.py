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


def test_every_script_with_a_main_runs_it():
    """bench/'s and data_prep/'s scripts, and sfttrain's entry points, call their main() when started as
    a script (`python -m bench.X`, `python data_prep/X.py`): the suite calls most bench scripts' main()
    in its own process, so a guard lost in an edit would otherwise leave a script that does nothing."""
    scripts = [p for folder in ("bench", "data_prep", "sfttrain") for p in (REPO / folder).glob("*.py")]
    with_main = [p for p in scripts if any(isinstance(node, ast.FunctionDef) and node.name == "main"
                                           for node in ast.parse(p.read_text()).body)]
    assert {"sfttrain_w1.py", "gsm8k.py", "run.py"} <= {p.name for p in with_main}  # the walk found them
    unguarded = [str(p.relative_to(REPO)) for p in with_main if not runs_main_as_script(ast.parse(p.read_text()))]
    assert not unguarded, f"no `if __name__ == \"__main__\": main()` in {unguarded}"


def runs_main_as_script(tree: ast.Module) -> bool:
    """The module's top level has `if __name__ == "__main__":` whose body calls main()."""
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
                and node.test.left.id == "__name__"):
            return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "main"
                       for n in ast.walk(node))
    return False
