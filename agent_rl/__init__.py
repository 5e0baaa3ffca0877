"""agent-rl: multi-turn tool-use GRPO for LLM agents.

Owns: the one import name everything installs under. The repository keeps `envs/`, `tools/` and
`rewards/` beside `agent_rl/`; they install as `agent_rl.envs`, `agent_rl.tools` and `agent_rl.rewards`
(pyproject.toml maps the folders), so a project with its own `tools/` package never shadows ours.
Code written for the top-level spelling of before 0.1.0 (`from envs.calculator import make_env`) meets
Python's own ModuleNotFoundError; where agent-rl imports it (an environment module, `core.registry`) the
error is one line naming the new import.
Does not own: anything else; the map of the code is in README.md.
"""
