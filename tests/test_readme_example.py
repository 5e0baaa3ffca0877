"""The environment example in README.md is real code: extract it, import it, play it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from agent_rl.core.types import StopReason
from agent_rl.rollout.runner import EpisodeLimits, rollout_groups

README = Path(__file__).resolve().parents[1] / "README.md"


def load_example(tmp_path, name: str = "env"):
    text = README.read_text()
    block = re.search(rf"<!-- example:{name} -->\n```python\n(.*?)```\n<!-- /example:{name} -->", text, re.DOTALL)
    assert block, f"README lost its {name} example"
    code = block.group(1)
    assert len(code.strip().splitlines()) <= 45  # "about 30 lines" of environment, plus the task loader
    path = tmp_path / f"my_{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(f"my_{name}", path)
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


async def test_readme_dataset_env_scores_with_trl_style_functions(tmp_path, scripted, renderer):
    module = load_example(tmp_path, "dataset")

    def script(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            expression = "17 * 23" if "17 * 23" in prompt else "999 + 1"
            return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        return "It is " + prompt.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0] + "."

    groups = await rollout_groups(module.load_tasks(2), module.make_env, scripted(script), renderer, EpisodeLimits(), 1)
    right, second = groups[0].trajectories[0], groups[1].trajectories[0]
    assert right.reward == 1.0 and right.reward_parts == {"exact": 1.0, "brevity": -0.10}
    assert right.messages[0].content == "Use the calculator, then answer." and right.tool_calls[0].ok
    assert second.reward == 1.0 and second.messages[-1].content == "It is 1000."
    groups = await rollout_groups(module.load_tasks(1), module.make_env, scripted(lambda p: "It is 390."), renderer,
                                  EpisodeLimits(), 1)
    assert groups[0].trajectories[0].reward == 0.0  # the weight-0 brevity metric adds nothing


async def test_readme_mcp_environment_plays_and_rewards(tmp_path, monkeypatch, scripted, renderer):
    """The MCP example starts the real example server (a path from the repository root, as documented)."""
    from tools.mcp import close_shared

    monkeypatch.chdir(README.parent)
    module = load_example(tmp_path, "mcp")

    def script(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            args = '{"value": 5, "from_unit": "mi", "to_unit": "km"}' if "5 mi?" in prompt else \
                '{"value": 10, "from_unit": "lb", "to_unit": "kg"}'
            return f'<tool_call>\n{{"name": "convert", "arguments": {args}}}\n</tool_call>'
        return "It is " + prompt.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0].split(" = ")[1] + "."

    try:
        groups = await rollout_groups(module.load_tasks(2), module.make_env, scripted(script), renderer,
                                      EpisodeLimits(), 2)
    finally:
        close_shared()
    trajs = [t for g in groups for t in g.trajectories]
    assert [t.reward for t in trajs] == [1.0] * 4, [t.error for t in trajs]
    assert trajs[0].messages[3].content == "5 mi = 8.04672 km" and trajs[2].messages[3].content == "10 lb = 4.53592 kg"
    assert all(t.stop_reason is StopReason.NO_TOOL_CALL and [c.ok for c in t.tool_calls] == [True] for t in trajs)
