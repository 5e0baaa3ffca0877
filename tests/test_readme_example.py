"""The environment example in README.md is real code: extract it, import it, play it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from agent_rl.rollout import EpisodeLimits, rollout_groups
from agent_rl.types import StopReason

README = Path(__file__).resolve().parents[1] / "README.md"


def load_example(tmp_path):
    text = README.read_text()
    block = re.search(r"<!-- example:env -->\n```python\n(.*?)```\n<!-- /example:env -->", text, re.DOTALL)
    assert block, "README lost its environment example"
    code = block.group(1)
    assert len(code.strip().splitlines()) <= 45  # "about 30 lines" of environment, plus the task loader
    path = tmp_path / "my_env.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("my_env", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_readme_environment_plays_and_rewards(tmp_path, scripted, renderer):
    env_module = load_example(tmp_path)

    def script(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            country = "France" if "capital of France?" in prompt else "Kenya"
            return f'<tool_call>\n{{"name": "lookup_capital", "arguments": {{"country": "{country}"}}}}\n</tool_call>'
        answer = prompt.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
        return f"The capital is {answer}."

    tasks = env_module.load_tasks(2)
    groups = await rollout_groups(tasks, env_module.make_env, scripted(script), renderer, EpisodeLimits(), 2)
    trajs = [t for g in groups for t in g.trajectories]
    assert [t.reward for t in trajs] == [1.0] * 4
    assert all(t.stop_reason is StopReason.NO_TOOL_CALL and len(t.tool_calls) == 1 and t.tool_calls[0].ok
               for t in trajs)
    assert trajs[0].messages[3].content == "Paris" and trajs[2].messages[3].content == "Nairobi"
