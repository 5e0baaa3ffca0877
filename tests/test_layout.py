"""The house rules, checked: imports only go down the floors, no import circles, small modules and functions.

Floors (a module may import its own package and anything on a lower floor, never a higher one):

    0  agent_rl.core                                  the RL nouns, Env protocol, renderers, registry, config
    1  tools                                          tool protocol, sandboxes, search, knowledge graph
    2  rewards                                        reward functions
    3  envs                                           example environments
    4  agent_rl.rollout | agent_rl.learn | agent_rl.runs   siblings: none imports another
    5  agent_rl (the commands: trainer, sft, evaluate, demos, play, session, cli, ...)

Every import counts, also those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent_rl", "tools", "rewards", "envs")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def floor(module: str) -> tuple[int, str]:
    """(floor, package) of a module of this project."""
    parts = module.split(".")
    if parts[0] == "agent_rl":
        sub = parts[1] if len(parts) > 1 else ""
        if sub == "core":
            return 0, "agent_rl.core"
        if sub in ("rollout", "learn", "runs"):
            return 4, f"agent_rl.{sub}"
        return 5, "agent_rl"
    return {"tools": 1, "rewards": 2, "envs": 3}[parts[0]], parts[0]


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports (resolved to the longest known module name)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


GRAPH = {name: imports(path, set(modules())) - {name} for name, path in modules().items()}


def test_floor_rules_hold_for_a_known_back_edge():
    # the rule itself, on made-up edges: a ground-floor module importing a command must fail
    assert floor("agent_rl.core.types") < floor("agent_rl.trainer")
    assert not allowed("agent_rl.core.types", "envs.base")
    assert not allowed("agent_rl.learn.update", "agent_rl.rollout.sampler")
    assert allowed("envs.base", "agent_rl.core.env") and allowed("agent_rl.learn.update", "agent_rl.learn.loss")


def allowed(importer: str, imported: str) -> bool:
    (f_from, p_from), (f_to, p_to) = floor(importer), floor(imported)
    return f_to < f_from or p_to == p_from


def test_imports_only_go_down():
    bad = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if not allowed(a, b))
    assert bad == [], "imports from a lower floor to a higher one (or between siblings):\n" + "\n".join(bad)


def test_no_import_circles():
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "import circles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("folder", [*PACKAGES, "bench", "examples"])
def test_modules_and_functions_stay_small(folder):
    too_long = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}(): {n} lines")
    assert too_long == []


def test_every_module_says_what_it_owns():
    missing = [str(p.relative_to(ROOT)) for name, p in modules().items()
               if p.name != "__init__.py" and "Owns" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert missing == []


def test_readme_module_table_matches_the_tree():
    """Every module the README's table names exists, and every module of those folders is named."""
    import re

    rows = re.findall(r"^\| `((?:agent_rl|envs)[^`]*)` \| (.*) \|$", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) == 6
    for folder, text in rows:
        named = {n for n in re.findall(r"`([a-z0-9_]+)`", text)}
        on_disk = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
        assert named & on_disk == on_disk, f"{folder}: not in the README: {sorted(on_disk - named)}"
        assert {n for n in named if n not in on_disk and not (ROOT / folder / n).is_dir()} <= {"auto"}, folder
