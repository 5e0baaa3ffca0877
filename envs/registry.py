"""Environment lookup by name: a short built-in name, or `package.module` of the user's own.

Owns: `load_env(name) -> EnvSpec`. An environment module exposes `make_env(task) -> Env` and
`load_tasks(n: int, seed: int, split: str) -> list[dict]`.
Does not own: the environments themselves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from envs.base import Env

BUILTIN = {"calculator": "envs.calculator", "toy": "envs.toy"}


@dataclass(frozen=True)
class EnvSpec:
    name: str
    make_env: Callable[[dict[str, Any]], Env]
    load_tasks: Callable[..., list[dict[str, Any]]]


def load_env(name: str) -> EnvSpec:
    module_name = BUILTIN.get(name, name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"unknown environment {name!r} (built-in: {', '.join(BUILTIN)}; or a module path): {e}") from None
    missing = [f for f in ("make_env", "load_tasks") if not callable(getattr(module, f, None))]
    if missing:
        raise ValueError(f"environment module {module_name!r} lacks {' and '.join(missing)}")
    return EnvSpec(name, module.make_env, module.load_tasks)
