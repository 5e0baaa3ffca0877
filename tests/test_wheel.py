"""A built wheel, installed (not editable) into a fresh environment, works inside a user's project that has
its own `tools/`, `envs/` and `rewards/` packages: everything agent-rl installs lives under `agent_rl`.

Editable installs hide this class of bug (their finder resolves our modules from the checkout whatever
else is on the path), so the test builds the wheel from a copy of the sources, installs it with pip into
a venv of its own and runs a user's script there. The venv borrows the test environment's dependencies
(torch, transformers, ...) through a `.pth` line: a line of a `.pth` file adds a folder to the path
without running the `.pth` files inside it, so the checkout's editable install stays out of it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = '''
import asyncio, json, sys

from tools import my_search            # the user's own packages, named as agent code often names them
from envs import my_env
from rewards import my_reward

import agent_rl
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.envs.calculator import load_tasks, make_env, solve
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.rollout.scripted import ScriptedSampler


async def main():
    task = load_tasks(1, seed=0)[0]
    renderer = load_renderer(sys.argv[1])
    sampler = ScriptedSampler(renderer, lambda messages: solve(task, messages, False), on_messages=True)
    async with make_env(task) as env:
        traj = await run_episode(env, sampler, renderer, EpisodeLimits(), task["id"])
    try:
        from envs.calculator import make_env as old  # noqa: F401  (the old spelling)
        old_import = "imported"
    except ModuleNotFoundError as e:
        old_import = str(e)
    print(json.dumps({"agent_rl": agent_rl.__file__, "reward": traj.reward, "calls": len(traj.tool_calls),
                      "mine": [my_search("x"), my_env, my_reward()], "old_import": old_import}))


asyncio.run(main())
'''


def _user_project(folder: Path) -> Path:
    for package, body in {"tools": "def my_search(q):\n    return 'found ' + q\n",
                          "envs": "my_env = 'mine'\n",
                          "rewards": "def my_reward():\n    return 0.5\n"}.items():
        (folder / package).mkdir(parents=True)
        (folder / package / "__init__.py").write_text(body)
    (folder / "main.py").write_text(USER_SCRIPT)
    return folder


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("agent_rl", "envs", "tools", "rewards"):
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp / "dist").glob("agent_rl-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "fresh"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    (Path(site) / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, capture_output=True, timeout=240)
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(tmp)
    return wheel, _fresh_venv(tmp, wheel)


def test_the_wheel_holds_one_top_level_package(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"agent_rl"}
    for module in ("agent_rl/envs/calculator.py", "agent_rl/tools/base.py", "agent_rl/rewards/answers.py",
                   "agent_rl/core/types.py", "agent_rl/runs/trace_page.html"):
        assert module in names


def _run(venv: Path, argv: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`argv` in the fresh venv, from `cwd`, with none of this test run's environment variables."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run(argv, input=stdin, cwd=cwd, capture_output=True, text=True, timeout=240, env=env)


def test_a_project_with_its_own_tools_envs_rewards_runs_an_environment(installed, tmp_path, smol_dir):
    _, venv = installed
    project = _user_project(tmp_path / "project")
    proc = _run(venv, ["python", "main.py", str(smol_dir)], project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["agent_rl"].startswith(str(venv))  # the wheel's copy, not the checkout
    assert out["reward"] == 1.0 and out["calls"] == 1
    assert out["mine"] == ["found x", "mine", 0.5]
    # the top-level spelling of before 0.1.0 in the user's own script: Python's own error, no finder of ours on
    # sys.meta_path (where agent-rl imports such a module, the error names the new import: below)
    assert out["old_import"] == "No module named 'envs.calculator'"


def test_the_installed_command_plays_from_the_project_folder(installed, tmp_path):
    from agent_rl.core.registry import BUILTIN
    from agent_rl.envs.calculator import load_tasks

    _, venv = installed
    project = _user_project(tmp_path / "project")
    task = load_tasks(1, seed=0)[0]
    proc = _run(venv, ["agent-rl", "play", "calculator"], project, f"The answer is {task['answer']}.\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["reward"] == 1.0
    old = _run(venv, ["agent-rl", "play", "envs.calculator"], project, "x\n")
    assert old.returncode == 2
    builtins = ", ".join(BUILTIN)  # the list grows with the environments; the line's form is the test
    assert old.stderr.strip() == ("error: unknown environment 'envs.calculator': agent-rl's environments are "
                                  "agent_rl.envs now; write 'agent_rl.envs.calculator' (or a built-in name: "
                                  f"{builtins})")
    (project / "old_env.py").write_text("from envs.calculator import load_tasks, make_env\n")
    mine = _run(venv, ["agent-rl", "play", "./old_env.py"], project, "x\n")
    assert mine.returncode == 2
    assert mine.stderr.strip() == ("error: environment './old_env.py' failed to import: No module named "
                                   "'envs.calculator'; agent-rl's envs package is agent_rl.envs since 0.1.0: import "
                                   "agent_rl.envs.calculator")
