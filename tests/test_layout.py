"""The house rules, checked: imports only go down the floors, no import circles, small modules and functions.

Floors (a module may import its own package and anything on a lower floor, never a higher one):

    0  agent_rl.core                                  the RL nouns, Env protocol, renderers, registry, config
    1  agent_rl.tools     (folder tools/)             tool protocol, sandboxes, search, knowledge graph
    2  agent_rl.rewards   (folder rewards/)           reward functions
    3  agent_rl.envs      (folder envs/)              example environments
    4  agent_rl.rollout | agent_rl.learn | agent_rl.runs   siblings: none imports another
    5  agent_rl (the commands: trainer, sft, evaluate, demos, play, session, cli, ...; the audit package)

bench/ (scripts run from the checkout, not installed): a script (`bench/*.py`) may import agent_rl and bench.shared
(what more than one script needs), never another script; bench.shared imports agent_rl and itself, never a script;
agent_rl imports nothing of bench. No circles there either.

Every import counts, also those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder: envs/, tools/ and rewards/ install as subpackages of agent_rl (pyproject.toml)
PACKAGES = {"agent_rl": "agent_rl", "agent_rl.tools": "tools", "agent_rl.rewards": "rewards", "agent_rl.envs": "envs"}
FLOORS = {"core": 0, "tools": 1, "rewards": 2, "envs": 3, "rollout": 4, "learn": 4, "runs": 4}
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 60


def floor(module: str) -> tuple[int, str]:
    """(floor, package) of a module of this project."""
    parts = module.split(".")
    assert parts[0] == "agent_rl", module
    sub = parts[1] if len(parts) > 1 else ""
    return (FLOORS[sub], f"agent_rl.{sub}") if sub in FLOORS else (5, "agent_rl")


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if package == "agent_rl" and parts and f"agent_rl.{parts[0]}" in PACKAGES:
                continue  # agent_rl/envs etc. are links to the folders walked as packages of their own
            found[".".join((package, *parts))] = path
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
BENCH = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
         for p in sorted((ROOT / "bench").rglob("*.py"))}
BENCH_GRAPH = {name: imports(path, set(BENCH) | set(modules())) - {name} for name, path in BENCH.items()}


def bench_allowed(importer: str, imported: str) -> bool:
    """A script imports agent_rl and bench.shared, never another script; bench.shared imports no script."""
    return imported.startswith("agent_rl") or imported == "bench.shared" or imported.startswith("bench.shared.")


def test_floor_rules_hold_for_a_known_back_edge():
    # the rule itself, on made-up edges: a ground-floor module importing a command must fail
    assert floor("agent_rl.core.types") < floor("agent_rl.trainer")
    assert not allowed("agent_rl.core.types", "agent_rl.envs.base")
    assert not allowed("agent_rl.learn.update", "agent_rl.rollout.sampler")
    assert not allowed("agent_rl.envs.calculator", "agent_rl.audit.hacks")  # envs fill in core's audit types
    assert allowed("agent_rl.audit.play", "agent_rl.rollout.runner") and \
        allowed("agent_rl.audit.targets", "agent_rl.envs.base")
    assert allowed("agent_rl.envs.base", "agent_rl.core.env") and \
        allowed("agent_rl.learn.update", "agent_rl.learn.loss")


def allowed(importer: str, imported: str) -> bool:
    (f_from, p_from), (f_to, p_to) = floor(importer), floor(imported)
    return f_to < f_from or p_to == p_from


def test_imports_only_go_down():
    bad = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if not allowed(a, b))
    assert bad == [], "imports from a lower floor to a higher one (or between siblings):\n" + "\n".join(bad)


def circles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_circles():
    assert circles(GRAPH) == [], "import circles:\n" + "\n".join(circles(GRAPH))


def test_bench_scripts_import_only_the_package_and_what_they_share():
    bad = sorted(f"{a} -> {b}" for a, targets in BENCH_GRAPH.items() for b in targets if not bench_allowed(a, b))
    assert bad == [], "a bench script importing another, or bench.shared importing a script:\n" + "\n".join(bad)
    assert circles(BENCH_GRAPH) == [], "import circles in bench/:\n" + "\n".join(circles(BENCH_GRAPH))
    into_bench = sorted(f"{a} -> bench" for a, path in modules().items() if imports(path, set(BENCH)))
    assert into_bench == []


def test_bench_rules_hold_for_a_known_back_edge():
    # the rule itself, on made-up edges: the circle that was (runner_scale <-> its workers' half), a script
    # importing a script, the shared folder importing a script
    assert not bench_allowed("bench.turn_parts", "bench.runner_scale")
    assert not bench_allowed("bench.shared.sim_episodes", "bench.runner_scale")
    assert bench_allowed("bench.turn_parts", "bench.shared.sim_measure") and \
        bench_allowed("bench.shared.sim_measure", "bench.shared.sim_episodes") and \
        bench_allowed("bench.runner_scale", "agent_rl.rollout.engine")
    assert "bench.runner_scale" in BENCH_GRAPH and "bench.shared.sim_episodes" in BENCH_GRAPH["bench.runner_scale"]
    back = {**BENCH_GRAPH}
    back["bench.shared.sim_episodes"] = back["bench.shared.sim_episodes"] | {"bench.runner_scale"}
    assert "bench.shared.sim_episodes -> bench.runner_scale -> bench.shared.sim_episodes" in circles(back)


@pytest.mark.parametrize("folder", [*PACKAGES.values(), "bench", "examples"])
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
    assert len(rows) == 10
    for folder, text in rows:
        named = {n for n in re.findall(r"`([a-z0-9_]+)`", text)}
        on_disk = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
        assert named & on_disk == on_disk, f"{folder}: not in the README: {sorted(on_disk - named)}"
        assert {n for n in named if n not in on_disk and not (ROOT / folder / n).is_dir()} <= {"auto"}, folder


def test_every_package_folder_is_installed():
    """pyproject.toml lists its packages by hand (the folders envs/, tools/, rewards/ are mapped into
    agent_rl): a new subpackage left out of the list would be missing from the wheel."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == PACKAGES
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert set(setup["packages"]) == folders


def test_the_checkout_imports_as_it_installs():
    """agent_rl/envs, agent_rl/tools and agent_rl/rewards are relative links to the top-level folders, so a
    checkout on PYTHONPATH, and type checkers, see the package layout the wheel installs."""
    for package, folder in PACKAGES.items():
        if package != "agent_rl":
            link = ROOT / "agent_rl" / package.split(".")[1]
            assert link.is_symlink() and link.readlink() == Path("..") / folder, link
