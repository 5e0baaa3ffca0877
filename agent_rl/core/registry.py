"""Environment lookup by name: a short built-in name, the user's own module, or a `.py` file.

Owns: `load_env(name) -> EnvSpec`: a built-in name (`BUILTIN`); a module name, found on the import
path or else in the current folder (so `agent-rl rollout --env my_env` finds `./my_env.py`, as
`python -m` would, although a console script does not put the current folder on the path); or a
path to a `.py` file (`./my_env.py`, `/abs/env.py`), imported under its file name with its folder
added to the import path, so that worker processes (`tools.runners`) import it the same way.
An environment module exposes `make_env(task) -> Env` and `load_tasks(n: int, seed: int, split:
str) -> list[dict]`, and may expose a scripted solver for demonstrations, `solve(task, messages,
direct: bool) -> Message`: the next assistant reply given the conversation so far as messages (tool
results in the tool messages); the reply's `content` is its prose and its `tool_calls` the calls to
make, which the renderer writes in the model's format; with `direct` it answers without calling a
tool. It may also expose a group-level reward, `group_reward(task, trajectories) -> list[float | Reward]`
(sync or async): called once the G episodes of a task have ended, with the finished trajectories (those
without an infrastructure error), one reward per trajectory, added to its own (`rollout.runner`).
It may also expose `mistake(task, messages, rng) -> Message | None`: a plausible wrong next
reply from which `solve` recovers (what imperfect demonstrations are made of; None: no mistake fits
here). `EnvSpec.with_task_args` binds keyword arguments of `load_tasks` (`rollout.env_args`).
A benchmark (`EVAL_ONLY`: BFCL) is refused under any spelling (`bfcl`, `agent_rl.bfcl`, a `bfcl.py`).
Does not own: the environments themselves (`envs`), the protocol they implement (`core.env`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from agent_rl.core.env import Env
from agent_rl.core.types import Message

BUILTIN = {name: f"agent_rl.envs.{name}" for name in
           ("calculator", "coding", "gui", "gui_browser", "kg_qa", "math", "mcp_time", "mcp_units", "search_qa",
            "text_game", "toy")}
# benchmarks that must never be trained on: refused as an environment under any spelling
EVAL_ONLY = {"bfcl": "agent-rl eval --benchmark bfcl"}


@dataclass(frozen=True)
class EnvSpec:
    name: str
    make_env: Callable[[dict[str, Any]], Env]
    load_tasks: Callable[..., list[dict[str, Any]]]
    solve: Callable[[dict[str, Any], Sequence[Message], bool], Message] | None = None
    group_reward: Callable[..., Any] | None = None  # (task, trajectories) -> one float or Reward each
    mistake: Callable[..., Message | None] | None = None  # (task, messages, rng) -> a wrong reply or None

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
    module = _import_env(name)
    missing = [f for f in ("make_env", "load_tasks") if not callable(getattr(module, f, None))]
    if missing:
        raise ValueError(f"environment module {module.__name__!r} lacks {' and '.join(missing)}")
    solve, group_reward, mistake = (getattr(module, f, None) for f in ("solve", "group_reward", "mistake"))
    return EnvSpec(name, module.make_env, module.load_tasks, solve if callable(solve) else None,
                   group_reward if callable(group_reward) else None, mistake if callable(mistake) else None)


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
        raise ValueError(f"environment {name!r} failed to import: {e}") from None
    except Exception as e:  # a bug in the user's module: one line, not a traceback
        raise ValueError(f"environment {name!r} failed to import: {type(e).__name__}: {e}") from None
