"""agent-rl: multi-turn tool-use GRPO for LLM agents.

Owns: the one import name everything installs under. The repository keeps `envs/`, `tools/` and
`rewards/` beside `agent_rl/`; they install as `agent_rl.envs`, `agent_rl.tools` and `agent_rl.rewards`
(pyproject.toml maps the folders), so a project with its own `tools/` package never shadows ours.
Code written for the old top-level spelling (`from envs.calculator import make_env`) fails with one
line that names the new import (`_MovedPackages`, the last finder on `sys.meta_path`: it speaks only
when no other finder found the module).
Does not own: anything else; the map of the code is in README.md.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec

MOVED = ("envs", "tools", "rewards")


class _MovedPackages:
    """`import envs...` / `tools...` / `rewards...` that no other finder resolved: a ModuleNotFoundError
    saying where agent-rl's modules of that name are now."""

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None = None, target: object = None) -> ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top not in MOVED:
            return None
        raise ModuleNotFoundError(f"No module named {fullname!r}; agent-rl's {top} package is agent_rl.{top} "
                                  f"now: import agent_rl.{fullname}", name=fullname)


if not any(isinstance(f, type) and f.__name__ == "_MovedPackages" for f in sys.meta_path):
    sys.meta_path.append(_MovedPackages)
