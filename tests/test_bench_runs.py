"""Every bench runs from a fresh clone as its docstring says, checked cheaply (no vLLM, no model, no measurement):

- each script of bench/ answers `--help` with its usage, and every flag its docstring's usage lines name is in it.
  One interpreter runs them all (torch and the trainer imported once, not two dozen times), each as `__main__`
  from the repository root as `python bench/X.py` runs it: sys.path as a fresh interpreter has it (the script's
  folder first, no PYTHONPATH) and bench's modules forgotten, so a script that does not put the repository on
  sys.path itself fails here as it fails from a fresh clone;
- a bench that builds a virtualenv of its own for a side script (bench/vs_trl.py: TRL's, for bench/trl_side.py)
  installs what that script imports: its imports, and those of every module of this project they reach when
  imported (module level, parents' `__init__` included; not those inside functions, which the side never calls),
  name only distributions in the bench's requirement list.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if "__name__ == \"__main__\"" in p.read_text())
# bench -> (its side script, the module attribute holding the side virtualenv's requirements)
SIDE_VENVS = {"bench/vs_trl.py": ("bench/trl_side.py", "TRL_REQUIREMENTS")}

DRIVER = """
import contextlib, io, json, runpy, sys
base = [p for p in sys.path if p not in ("", ".")]
out = {}
for script in sys.argv[1:]:
    sys.path[:] = [script.rsplit("/", 1)[0], *base]  # what `python bench/X.py` starts with
    for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
        del sys.modules[name]
    sys.argv = [script, "--help"]
    text, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code, text = 1, io.StringIO(f"{type(e).__name__}: {e}")
    out[script] = [code, text.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", DRIVER, *map(str, SCRIPTS)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def usage_flags(doc: str, script: str) -> set[str]:
    """The `--flags` of the docstring's usage lines: each `python bench/X.py ...` line and the lines indented under
    it."""
    flags: set[str] = set()
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if f"bench/{script}" in line and "python" in line.split(f"bench/{script}")[0]:
            indent = len(line) - len(line.lstrip())
            block = [line, *[x for x in lines[i + 1:i + 4] if len(x) - len(x.lstrip()) > indent and x.strip()]]
            flags |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(block)))
    return flags


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_bench_answers_help_with_the_flags_its_docstring_names(script, helps):
    code, text = helps[str(script)]
    assert code == 0 and text.startswith("usage: "), f"{script.name} --help: exit {code}: {text[-2000:]}"
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    assert f"bench/{script.name}" in doc, f"{script.name}: its docstring says nowhere how to run it"
    missing = sorted(f for f in usage_flags(doc, script.name) if f not in text)
    assert missing == [], f"{script.name}: its docstring's usage names flags --help does not know: {missing}"


def test_the_usage_check_finds_a_flag_the_script_does_not_have():
    doc = "Runs.\n\n    python bench/x.py [--steps 3] [--gone]\n        [--also-gone N]\n\nProse: --not-usage.\n"
    assert usage_flags(doc, "x.py") == {"--steps", "--gone", "--also-gone"}


# -- side virtualenvs -------------------------------------------------------------------------------------------
def module_file(name: str) -> Path | None:
    """The file of a module of this project (agent_rl's subpackages envs, tools, rewards are its links)."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def imports_on_import(tree: ast.Module) -> list[str]:
    """What importing the module runs: its import statements outside functions and `if TYPE_CHECKING:` blocks
    (`from a import b` names both `a` and `a.b`, which may be a module)."""
    names: list[str] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                names.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                names.extend([node.module or "", *(f"{node.module}.{a.name}" for a in node.names)])
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(tree.body)
    return names


def third_party_imports(script: Path) -> dict[str, str]:
    """Top-level names of the libraries importing `script` imports, through this project's modules: name -> the
    first file (from the repository root) that imports it."""
    found: dict[str, str] = {}
    todo, seen = [script], set()
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        for name in imports_on_import(ast.parse(path.read_text())):
            top = name.split(".")[0]
            if top in ("agent_rl", "bench"):
                parts = name.split(".")
                todo += [f for i in range(1, len(parts) + 1) if (f := module_file(".".join(parts[:i])))]
            elif top and top not in sys.stdlib_module_names:
                found.setdefault(top, path.relative_to(ROOT).as_posix())
    return found


def distribution(import_name: str) -> str:
    """The distribution that installs a top-level import name (as installed here), canonical."""
    dists = importlib.metadata.packages_distributions().get(import_name, [import_name])
    return re.sub(r"[-_.]+", "-", dists[0]).lower()


def requirement_names(requirements: tuple[str, ...]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;@]", r, maxsplit=1)[0]).lower() for r in requirements}


@pytest.mark.parametrize("bench", sorted(SIDE_VENVS))
def test_a_side_virtualenv_installs_what_its_script_imports(bench):
    side, attribute = SIDE_VENVS[bench]
    sys.path.insert(0, str(ROOT))  # bench/ is not installed: the checkout's
    requirements = getattr(importlib.import_module(bench.removesuffix(".py").replace("/", ".")), attribute)
    wanted = requirement_names(requirements)
    missing = sorted(f"{name} ({distribution(name)}, imported by {where})"
                     for name, where in third_party_imports(ROOT / side).items() if distribution(name) not in wanted)
    assert missing == [], f"{side} imports what {bench}'s virtualenv does not install: {missing}"


def test_every_bench_that_builds_a_virtualenv_is_checked():
    builds = {f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py") if re.search(r'"-m", "venv"', p.read_text())}
    assert builds == set(SIDE_VENVS)


def test_the_import_walk_finds_a_library_behind_a_project_module(tmp_path):
    side = tmp_path / "side.py"
    side.write_text("import json\nimport torch\nfrom agent_rl.tools.base import Tool\n\ndef later():\n    import ray\n")
    names = set(imports_on_import(ast.parse(side.read_text())))
    assert names == {"json", "torch", "agent_rl.tools.base", "agent_rl.tools.base.Tool"}  # not ray: in a function
    assert {"orjson", "pydantic"} <= set(third_party_imports(module_file("agent_rl.tools.base")))
    assert requirement_names(("torch==2.13.0", "PyYAML>=6", "trl[vllm]>=1")) == {"torch", "pyyaml", "trl"}
    assert distribution("yaml") == "pyyaml"
