"""docs/environments.md's "Several environments in one run" and "Group rewards and an LLM judge" (found by their
marked blocks, wherever they live: tests/doc_pages.py): the example module plays and
scores as described, the command lines run as written (from a copy of examples/, against the test server,
with arguments appended to keep the runs small), and the failures the tables list are the lines a reader sees."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from doc_pages import ROOT, marked_block, page_with, readme_commands
from helpers import AGENT_RL, SMALL_ROLLOUT, SMALL_TRAIN, trajectory

from agent_rl.config.file import load_config
from agent_rl.core.config import ConfigError
from agent_rl.core.mixture import Mixture
from agent_rl.core.registry import EnvSpec, load_env
from agent_rl.core.types import EPISODE_REWARD
from agent_rl.rewards.judge import LLMJudge
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, score_group
from agent_rl.session import open_session


def written(folder: Path, proc: subprocess.CompletedProcess, name: str) -> dict:
    """What a command wrote and named at its end (`name: path`): eval's report, or train's last step of metrics."""
    path = folder / next(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith(f"{name}: "))
    return json.loads(path.read_text().strip().splitlines()[-1] if path.suffix == ".jsonl" else path.read_text())


def example(name: str) -> str:
    return marked_block("example", name)


def folder_with_examples(tmp_path: Path) -> Path:
    """A fresh folder with a copy of examples/ and the documented group example: relative run folders land here."""
    folder = tmp_path / "work"
    shutil.copytree(ROOT / "examples", folder / "examples")
    (folder / "my_group_env.py").write_text(example("group"))
    return folder


def run(folder: Path, line: str, timeout_s: float = 280) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{AGENT_RL.parent}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "-c", line], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s)


async def test_the_group_example_rewards_the_shorter_right_answers(tmp_path, scripted, renderer):
    path = tmp_path / "my_group_env.py"
    path.write_text(example("group"))
    spec = load_env(str(path))  # as the commands load it
    [task] = spec.load_tasks(1)
    answer = task["answer"]
    replies = iter([f"{answer}", f"The answer is {answer}.", f"I have thought about it a lot: {answer + 1}."])
    groups = await rollout_groups([task], spec.make_env, scripted(lambda prompt: next(replies)), renderer,
                                  EpisodeLimits(max_turns=1), 3, group_reward=spec.group_reward)
    ts = groups[0].trajectories
    n = [t.num_sampled for t in ts]
    lam = [0.5 - (k - min(n)) / (max(n) - min(n)) for k in n]
    assert [t.reward_parts[EPISODE_REWARD] for t in ts] == [1.0, 1.0, 0.0]
    assert [t.reward_parts["length"] for t in ts] == pytest.approx([lam[0], lam[1], min(0.0, lam[2])])
    assert ts[0].reward == pytest.approx(1.0 + 0.2 * 0.5) and ts[2].reward == pytest.approx(0.2 * -0.5)


def test_the_failures_the_mixture_table_lists_are_the_lines_a_reader_sees(tmp_path):
    folder = folder_with_examples(tmp_path)
    page = page_with("<!-- commands:mixed -->").read_text()  # the table follows the mixture's commands
    rows = dict(re.findall(r"^\| (.*?) \| `(error: .*?)`", page.split("<!-- commands:mixed -->")[1], re.M))
    both = run(folder, "agent-rl train examples/calculator_grpo.yaml --set 'rollout.envs={calculator: 3, toy: 1}'")
    assert both.returncode == 2 and both.stdout == ""
    assert both.stderr.strip() == rows[next(k for k in rows if k.startswith("`env` and `envs`"))]
    unknown = run(folder, "agent-rl train --set 'rollout.envs={calculater: 1, toy: 1}'")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert unknown.stderr.startswith("error: unknown environment 'calculater' (built-in: calculator, ")
    # the other rows, through the library calls those commands make
    for overrides, row in ((["rollout.envs={calculator: 3, toy: 0}"], "a weight of 0 or less"),
                           (["rollout.envs=[{name: toy}, {name: toy}]"], "an environment listed twice")):
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert f"error: {info.value}" == rows[row]
    mixture = Mixture((EnvSpec("mine", dict, lambda n, **kw: [{"id": 1, "env": "x"}]),), (1.0,), ("mine",))
    with pytest.raises(ValueError) as info:
        mixture.load_tasks(1)
    assert f"error: {info.value}" == rows[next(k for k in rows if k.startswith("tasks that have an `env` column"))]


async def test_the_failures_the_judge_table_lists_are_the_lines_a_reader_sees(monkeypatch, tmp_path):
    table = page_with("<!-- commands:judge -->").read_text().split("<!-- /commands:judge -->")[1].split("\n## ")[0]
    rows = [row.removesuffix(" |").split(" | ")[1] for row in re.findall(r"^\| .* \|$", table, re.M)[2:]]
    for overrides, row in ((["judge.url=run", "judge.prompt=prompts/judge.txt"], rows[1]),
                           (["judge.url=run", "judge.api_key_env=JUDGE_API_KEY"], rows[2])):
        monkeypatch.delenv("JUDGE_API_KEY", raising=False)
        with pytest.raises(ValueError) as info:
            open_session(load_config(None, overrides))
        assert f"`error: {info.value}`, at start" == row
    out = await score_group(lambda task, ts: [1.0] * 3, {"id": "q"}, [trajectory()] * 4, 5)
    assert f"`{out[0].error}`" in rows[3]
    reply = LLMJudge("http://unused")._neutral(4, "its reply ranks no permutation of answers 1..4: 'I like them all'")
    assert f"`judge: {reply.reason}; its group of 4 answers scores 0.5 each`" in rows[0]


@pytest.mark.integration
def test_readme_mixture_lines_run_against_the_test_server(tmp_path, vllm_server):
    folder = folder_with_examples(tmp_path)
    server = f"--set model.name={vllm_server.model_dir} --set sampler.server_urls=[{vllm_server.url}]"
    train, evaluate, override = readme_commands("mixed")
    proc = run(folder, f"{train} {server} {SMALL_TRAIN} --set rollout.tasks_per_step=4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    [step] = [json.loads(x) for x in (folder / "runs" / "mixed_grpo" / "metrics.jsonl").read_text().splitlines()]
    assert step["env/calculator/rollouts"] == 6 and step["env/math/rollouts"] == 2  # 3:1 of 4 tasks x 2
    assert (step["data_position/calculator"], step["data_position/math"]) == (3.0, 1.0)
    proc = run(folder, f"{evaluate} {server} --tasks 4 --set rollout.max_tokens_per_turn=24 --set rollout.max_turns=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = written(folder, proc, "report")
    for result in report["results"].values():
        assert (result["env/calculator/tasks"], result["env/math/tasks"]) == (3.0, 1.0)
        assert {"env/math/accuracy", "env/math/pass@2", "env/calculator/tool_use_rate"} <= set(result)
    assert report["eval"]["env"] == "calculator x3 + math x1"
    proc = run(folder, f"{override} {server} {SMALL_TRAIN} --set rollout.tasks_per_step=4 --set run.run_dir=runs/over")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "env/toy/reward_mean" in written(folder, proc, "metrics")


@pytest.mark.integration
def test_readme_group_and_judge_lines_run_against_the_test_server(tmp_path, vllm_server):
    folder = folder_with_examples(tmp_path)
    server = f"--set model.name={vllm_server.model_dir} --set sampler.server_urls=[{vllm_server.url}]"
    rollout, train = readme_commands("group")
    proc = run(folder, f"{rollout} --server-url {vllm_server.url} --model {vllm_server.model_dir} "
                       f"{SMALL_ROLLOUT.replace('--group-size 2', '')}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert metrics["rollouts"] == 4 and {"reward/length", "reward/episode_reward", "reward/correct"} <= set(metrics)
    proc = run(folder, f"{train} {server} {SMALL_TRAIN} --set run.run_dir=runs/group")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reward/length" in written(folder, proc, "metrics")
    [judge] = readme_commands("judge")
    proc = run(folder, f"{judge} {server} {SMALL_TRAIN} --set judge.max_tokens=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    final = written(folder, proc, "metrics")
    assert final["reward/judge"] == 0.5 and final["reward/judge_failed"] == 1.0  # the tiny model is no judge
    assert "judge: its reply ranks no permutation of answers 1..2" in proc.stderr
    assert (folder / "runs" / "judge_grpo" / "judge" / "prompt.txt").is_file()
