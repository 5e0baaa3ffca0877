"""The `agent_rl.tools` package (folder `tools/`) imports form no circle: shared modules never import the
ones built on them.

Reads the source (every import statement, those inside functions included) rather than importing,
so a circle hidden behind a function-level import is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def tools_imports(source: str) -> set[str]:
    """Names of the `agent_rl.tools` modules a module's source imports (`agent_rl.tools.x`, or
    `from agent_rl.tools import x`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("agent_rl.tools.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "agent_rl.tools":
                found |= {f"agent_rl.tools.{alias.name}" for alias in node.names}
            elif node.module.startswith("agent_rl.tools."):
                found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {f"agent_rl.tools.{p.stem}": p for p in TOOLS.glob("*.py") if p.stem != "__init__"}
    return {name: tools_imports(path.read_text()) & modules.keys() for name, path in modules.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (circle := visit(nxt, path + [node])):
                return circle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start, [])):
            return circle
    return None


def test_find_circle_sees_function_level_imports():
    a, b = "agent_rl.tools.a", "agent_rl.tools.b"
    assert find_circle({a: tools_imports("def f():\n    from agent_rl.tools import b\n"), b: {a}}) == [a, b, a]
    assert find_circle({a: {b}, b: set()}) is None


def test_tools_modules_import_without_a_circle():
    graph = import_graph()
    assert "agent_rl.tools.sandbox_docker" in graph and graph["agent_rl.tools.python_tool"]  # the scan found them
    assert find_circle(graph) is None, " -> ".join(find_circle(graph) or [])
