"""Environment lookup by name: a short built-in name, or `package.module` of the user's own.

Owns: `load_env(name) -> EnvSpec`. An environment module exposes `make_env(task) -> Env` and
`load_tasks(n: int, seed: int, split: str) -> list[dict]`, and may expose a scripted solver for
demonstrations, `solve(task, messages, direct: bool) -> Message`: the next assistant reply given
the conversation so far as messages (tool results in the tool messages); the reply's `content` is
its prose and its `tool_calls` the calls to make, which the renderer writes in the model's format;
with `direct` it answers without calling a tool.
Does not own: the environments themselves (`envs`), the protocol they implement (`core.env`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agent_rl.core.env import Env
from agent_rl.core.types import Message

BUILTIN = {"calculator": "envs.calculator", "coding": "envs.coding", "gui": "envs.gui", "gui_browser": "envs.gui_browser",
           "kg_qa": "envs.kg_qa", "math": "envs.math", "mcp_units": "envs.mcp_units", "search_qa": "envs.search_qa",
           "toy": "envs.toy"}


@dataclass(frozen=True)
class EnvSpec:
    name: str
    make_env: Callable[[dict[str, Any]], Env]
    load_tasks: Callable[..., list[dict[str, Any]]]
    solve: Callable[[dict[str, Any], Sequence[Message], bool], Message] | None = None


def load_env(name: str) -> EnvSpec:
    module_name = BUILTIN.get(name, name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"unknown environment {name!r} (built-in: {', '.join(BUILTIN)}; or a module path): {e}") from None
    missing = [f for f in ("make_env", "load_tasks") if not callable(getattr(module, f, None))]
    if missing:
        raise ValueError(f"environment module {module_name!r} lacks {' and '.join(missing)}")
    solve = getattr(module, "solve", None)
    return EnvSpec(name, module.make_env, module.load_tasks, solve if callable(solve) else None)
