"""The environment contract, `EnvSpec`, and environments by name.

Owns: `EnvSpec`, what an environment module exports as `ENV` (its make_env and load_tasks, and the
optional scripted solver, group reward, mistake and audit target), with `with_task_args` (keyword
arguments of `load_tasks`, `rollout.env_args`); and `load_env(name) -> EnvSpec`: a built-in name
(`BUILTIN`); a module name, found on the import path or else in the current folder (so `agent-rl
rollout --env my_env` finds `./my_env.py`, as `python -m` would, although a console script does not
put the current folder on the path); or a path to a `.py` file (`./my_env.py`, `/abs/env.py`),
imported under its file name with its folder added to the import path, so that worker processes
(`tools.runners`) import it the same way. The spec `load_env` returns is named by the name it was
given. Forms of before 0.1.0 are refused, each with one line saying what changed: a module that defines
`make_env` and `load_tasks` by name instead of exporting its spec (the line gives the spec to write), and the
top-level spelling of agent-rl's packages (`envs.calculator`, or a module importing `from envs... import`:
they are `agent_rl.envs`, `agent_rl.tools`, `agent_rl.rewards`). A benchmark (`EVAL_ONLY`: BFCL) is refused
under any spelling (`bfcl`, `agent_rl.evaluation.bfcl`, a `bfcl.py`).
Does not own: the environments themselves (`envs`), the protocol they implement (`core.env`), what an
audit target holds (`core.audit_target`), several environments as one (`core.mixture`).

An environment module ends with its spec, e.g.

    ENV = EnvSpec("calculator", make_env, load_tasks, solve=solve, audit=AuditTarget(ANSWERED, audit_target))
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from agent_rl.core.audit_target import AuditTarget, NotAudited
from agent_rl.core.env import Env, Task
from agent_rl.core.types import Message, Trajectory

BUILTIN = {name: f"agent_rl.envs.{name}" for name in
           ("calculator", "coding", "coding_tests", "gui", "gui_browser", "kg_qa", "math", "mcp_time", "mcp_units",
            "search_qa", "text_game", "toy")}
# benchmarks that must never be trained on: refused as an environment under any spelling
EVAL_ONLY = {"bfcl": "agent-rl eval --benchmark bfcl"}
SPEC = "ENV"  # the name an environment module exports its EnvSpec under
MOVED = ("envs", "tools", "rewards")  # top-level packages before 0.1.0, agent_rl.envs etc. since

# (task, the conversation so far, direct) -> the next assistant reply: its `content` is the prose and
# its `tool_calls` the calls to make (tool results are in the tool messages); with `direct` it answers
# without calling a tool. What demonstrations are made of (`demos`).
Solver = Callable[[Task, Sequence[Message], bool], Message]
# (task, the group's finished trajectories, infrastructure errors left out) -> one float or Reward each,
# or None for nothing; sync or async. Called once the G episodes of a task have ended, and added to
# each trajectory's own reward (`rollout.runner`).
GroupReward = Callable[[Task, Sequence[Trajectory]], Any]
# (task, the conversation so far, rng) -> a plausible wrong next reply that the solver recovers from,
# or None where no mistake fits (what imperfect demonstrations are made of)
Mistake = Callable[[Task, Sequence[Message], random.Random], Message | None]


@dataclass(frozen=True)
class EnvSpec:
    """An environment, as every command uses it; its module exports one as `ENV`."""

    name: str  # what commands, reports and mixtures call it (`load_env` sets the name it was asked for)
    make_env: Callable[[Task], Env]  # one single-use episode of a task
    load_tasks: Callable[..., list[Task]]  # (n, seed=0, split="train", **env_args): deterministic rows
    solve: Solver | None = None
    group_reward: GroupReward | None = None
    mistake: Mistake | None = None
    # what the reward audit plays (`core.audit_target`): None gives the generic target (rows with an
    # `answer` or `solution` column); NotAudited refuses the audit with its reason
    audit: AuditTarget | NotAudited | None = None

    def with_task_args(self, args: dict[str, Any]) -> EnvSpec:
        """This spec with `args` bound into every `load_tasks` call (e.g. {"levels": [1, 2]});
        a name `load_tasks` does not take is a ValueError naming it and the names it does take."""
        if not args:
            return self
        params = inspect.signature(self.load_tasks).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        fixed = {"n", "seed", "split"}
        for key in args:
            if key in fixed:
                raise ValueError(f"rollout.env_args: {key!r} is set by each command (n, seed and split are), "
                                 "not by env_args")
            if key not in params and not takes_any:
                extra = [p for p in params if p not in fixed and params[p].kind is not params[p].VAR_KEYWORD]
                raise ValueError(f"rollout.env_args: {self.name!r} load_tasks takes no argument {key!r} "
                                 f"(it takes: {', '.join(extra) or 'none besides n, seed and split'})")
        return dataclasses.replace(self, load_tasks=functools.partial(self.load_tasks, **args))


def load_env(name: str) -> EnvSpec:
    """The environment `name` (a built-in name, a module name or a .py file): its module's `ENV`,
    named `name`. Any problem is a ValueError of one line naming the module."""
    module = _import_env(name)
    spec = getattr(module, SPEC, None)
    if spec is None:
        named = [f for f in ("make_env", "load_tasks") if callable(getattr(module, f, None))]
        if named:  # written before 0.1.0, when the registry read these names
            raise ValueError(f"environment module {module.__name__!r} defines {' and '.join(named)} by name, which "
                             f"agent-rl no longer reads (0.1.0); export its spec: {_spec_line(module)}")
        raise ValueError(f"environment module {module.__name__!r} lacks {SPEC}: an environment module exports "
                         f"{_spec_line(module)}")
    if not isinstance(spec, EnvSpec):
        raise ValueError(f"environment module {module.__name__!r}: its {SPEC} is a {type(spec).__name__}, not an "
                         f"EnvSpec; write {_spec_line(module)}")
    return dataclasses.replace(spec, name=name)


def _spec_line(module: ModuleType) -> str:
    """The line that exports `module`'s spec, with the optional functions of `EnvSpec` it defines by name."""
    optional = [f.name for f in dataclasses.fields(EnvSpec) if f.name not in ("name", "make_env", "load_tasks")]
    named = "".join(f", {h}={h}" for h in optional if callable(getattr(module, h, None)))
    return (f'{SPEC} = EnvSpec("{module.__name__}", make_env, load_tasks{named}) '
            f"(from agent_rl.core.registry import EnvSpec)")


def _import_env(name: str) -> ModuleType:
    stem = Path(name).stem if name.endswith(".py") else name.rpartition(".")[2]
    if stem in EVAL_ONLY or stem.startswith("bfcl_"):
        raise ValueError(f"{name!r} is a benchmark, never a training environment: its questions are for "
                         f"evaluation only ({EVAL_ONLY['bfcl']})")
    if name in BUILTIN:
        return _import(BUILTIN[name], name)
    if name.endswith(".py") or "/" in name or os.sep in name:
        return _import_file(name)
    _on_path(os.getcwd())  # last: a file in the current folder never shadows an installed module
    return _import(name, name)


def _import_file(name: str) -> ModuleType:
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"environment file {name!r} does not exist")
    if path.suffix != ".py" or not path.stem.isidentifier():
        raise ValueError(f"environment file {name!r} must be a .py file named like a Python module")
    _on_path(str(path.parent))
    module = _import(path.stem, name)
    if Path(getattr(module, "__file__", None) or "").resolve() != path:
        raise ValueError(f"environment file {name!r} cannot be imported as {path.stem!r}: that name is taken "
                         f"by {getattr(module, '__file__', None) or 'a built-in module'}; rename the file")
    return module


def _on_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.append(folder)


def _import(module_name: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if module_name.startswith("envs.") and e.name and module_name.startswith(e.name):  # the old spelling
            raise ValueError(f"unknown environment {name!r}: agent-rl's environments are agent_rl.envs now; write "
                             f"'agent_rl.{module_name}' (or a built-in name: {', '.join(BUILTIN)})") from None
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"unknown environment {name!r} (built-in: {', '.join(BUILTIN)}; or a module name, "
                             f"or a .py file): {e}") from None
        top = (e.name or "").partition(".")[0]
        if top in MOVED:  # the module imports agent-rl's packages under their names of before 0.1.0
            raise ValueError(f"environment {name!r} failed to import: {e}; agent-rl's {top} package is "
                             f"agent_rl.{top} since 0.1.0: import agent_rl.{e.name}") from None
        raise ValueError(f"environment {name!r} failed to import: {e}") from None
    except Exception as e:  # a bug in the user's module: one line, not a traceback
        raise ValueError(f"environment {name!r} failed to import: {type(e).__name__}: {e}") from None
