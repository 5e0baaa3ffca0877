"""The environment examples in README.md and docs/ are real code, and the commands after them work as written.

The examples are extracted (from whichever page holds each marked block: tests/doc_pages.py), imported and
played with the scripted sampler; then each is saved under the page's file name in an empty folder and the
page's own command lines are run there in a
shell, through the venv's `agent-rl` console script, as a reader would run them. The `play` lines
run exactly as written (stdin is part of the line). The lines that sample from a model (`rollout`,
`train`) run as written with arguments appended, to reach the session's test server on the tiny
model and keep the run small: what they check is the documented part, the `--env` / `rollout.env`
handling. PYTHONPATH holds only the repository root (so this checkout's code runs even from an
installed venv of another one), never the folder: the environment is found from the current folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from doc_pages import ROOT, marked_block, page_with, readme_commands
from helpers import AGENT_RL, SMALL_ROLLOUT, SMALL_TRAIN

from agent_rl.core.types import StopReason
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.runs.traces import read_traces

FILES = {"env": "my_env.py", "dataset": "my_dataset_env.py", "agent": "my_agent.py"}


def load_example(tmp_path, name: str = "env"):
    code = marked_block("example", name)
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
    from agent_rl.tools.mcp import close_shared

    monkeypatch.chdir(ROOT)
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


async def test_readme_agent_is_token_identical_to_the_native_calculator(tmp_path, scripted, renderer):
    """The openai-client agent of "Bring your own agent", played by the runner through the proxy: the same
    ids, mask, log-probs and messages as `envs.calculator` for the same script, and the same rewards."""
    pytest.importorskip("openai", reason="the documented agent is written with the openai client")
    from agent_rl.envs import calculator

    module = load_example(tmp_path, "agent")
    tasks = module.load_tasks(3)
    by_question = {t["question"]: t for t in tasks}
    wrong = {tasks[1]["id"]}

    def script(messages):
        task = by_question[messages[1].content]
        if task["id"] in wrong and any(m.role == "tool" for m in messages):
            return "The answer is 0."
        return calculator.solve(task, messages)

    native = await rollout_groups(tasks, calculator.make_env, scripted(script, on_messages=True), renderer,
                                  EpisodeLimits(), 2)
    agent = await rollout_groups(tasks, module.make_env, scripted(script, on_messages=True), renderer,
                                 EpisodeLimits(), 2)
    for n, a in zip([t for g in native for t in g.trajectories], [t for g in agent for t in g.trajectories]):
        assert (a.token_ids, a.loss_mask, a.logprobs, a.turns, a.messages) == \
            (n.token_ids, n.loss_mask, n.logprobs, n.turns, n.messages)
        assert (a.reward, a.stop_reason, a.error) == (n.reward, n.stop_reason, None)
        assert a.reward == (0.0 if a.task_id in wrong else 1.0) and [c.ok for c in a.tool_calls] == [True]


def in_fresh_folder(tmp_path: Path, name: str, line: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Save the documented `name` example under its file name in an empty folder and run `line` there."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / FILES[name]).write_text(marked_block("example", name))
    env = {**os.environ, "PATH": f"{AGENT_RL.parent}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "-c", line], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_readme_names_its_files_and_commands_as_the_tests_run_them():
    for name, file in FILES.items():
        assert f"Save this as `{file}`" in page_with(f"<!-- example:{name} -->").read_text()
        assert readme_commands(name)[0].endswith(f"| agent-rl play {file.removesuffix('.py')}")
    assert AGENT_RL.exists(), "the venv has no agent-rl console script"


@pytest.mark.parametrize("name", FILES)
def test_readme_play_lines_run_as_written_in_a_fresh_folder(tmp_path, smol_dir, name):
    [line] = [c for c in readme_commands(name) if "agent-rl play" in c]
    proc = in_fresh_folder(tmp_path, name, line, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["reward"] == 1.0 and summary["stop_reason"] == "no_tool_call"
    assert [c["ok"] for c in summary["tool_calls"]] == [True]


@pytest.mark.integration
@pytest.mark.parametrize("name", FILES)
def test_readme_model_lines_run_in_a_fresh_folder_against_the_test_server(tmp_path, vllm_server, name):
    lines = [c for c in readme_commands(name) if "agent-rl play" not in c]
    assert any("rollout --env" in c for c in lines)
    for line in lines:
        if " rollout " in line:
            extra = f"--server-url {vllm_server.url} --model {vllm_server.model_dir} {SMALL_ROLLOUT}"
        else:
            extra = (f"--set model.name={vllm_server.model_dir} --set sampler.server_urls=[{vllm_server.url}] "
                     f"{SMALL_TRAIN}")
        proc = in_fresh_folder(tmp_path, name, f"{line} {extra}", timeout_s=280)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        out = proc.stdout.strip().splitlines()  # train ends with a table and names its metrics file; rollout: JSON
        named = [x.split(": ", 1)[1] for x in out if x.startswith("metrics: ")]
        metrics = json.loads((tmp_path / name / named[0]).read_text().splitlines()[-1] if named else out[-1])
        assert metrics, line


TRACE_TRAIN = ("--set rollout.tasks_per_step=2 --set rollout.group_size=2 --set rollout.max_turns=2 "
               "--set rollout.max_tokens_per_turn=24 --set rollout.max_total_tokens=1024 --set run.tensorboard=false "
               "--set model.lora_rank=4 --set model.lora_alpha=8 --set sampler.max_model_len=2048 --no-plot")


def page_data(path: Path) -> dict:
    page = path.read_text()
    return json.loads(re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', page, re.DOTALL)[1])


@pytest.mark.integration
def test_readme_trace_lines_train_then_view_against_the_test_server(tmp_path, vllm_server):
    """A real two-step run (calculator config, the test server) leaves traces that `view` renders."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "calculator_grpo.yaml").write_text(
        (ROOT / "examples" / "calculator_grpo.yaml").read_text())
    env = {**os.environ, "PATH": f"{AGENT_RL.parent}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    for line in readme_commands("traces"):
        extra = (f"--set model.name={vllm_server.model_dir} --set sampler.server_urls=[{vllm_server.url}] "
                 f"{TRACE_TRAIN}") if " train " in line else ""
        proc = subprocess.run(["bash", "-c", f"{line} {extra}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=280)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
    run = tmp_path / "runs" / "traced"
    steps = read_traces(run)
    assert sorted(steps) == [1, 2]
    for step, records in steps.items():  # both groups of each step (trace_groups: 2), both rollouts of each
        assert [(r["step"], r["group"], r["index"]) for r in records] == [(step, g, i) for g in (0, 1) for i in (0, 1)]
        for r in records:
            [seg] = r["segments"]
            assert len(seg["token_ids"]) == len(seg["loss_mask"]) == len(seg["logprobs"]) == r["num_tokens"] > 0
            assert sum(seg["loss_mask"]) == r["num_sampled"] > 0 and r["stop_reason"] != "error"
            sampled = "".join(run["text"] for run in seg["runs"] if run["sampled"])
            assert [m["content"] in sampled for m in r["messages"] if m["role"] == "assistant"] == \
                [True] * len(r["turns"])
            assert (r["advantage"] is None) == (r["dropped"] is not None)
    data = page_data(run / "traces.html")
    assert [s["step"] for s in data["steps"]] == [1, 2] and "reward_mean" in data["steps"][0]["metrics"]
    assert [s["step"] for s in page_data(tmp_path / "step2.html")["steps"]] == [2]
