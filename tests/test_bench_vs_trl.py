"""bench/vs_trl.py and its work (bench/shared/vs_trl_work.py) without running either trainer: the shared reward
under both trainers' calling conventions, the task rows, the warm-up rule of the summary, and one-line errors for
bad set-up."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from agent_rl.core.env import as_reward
from agent_rl.core.types import Message

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench/ is scripts, not an installed package

from bench.shared.vs_trl_work import bench_rows, correct, load_tasks, make_env  # noqa: E402
from bench.vs_trl import summarise  # noqa: E402


def test_rows_are_trl_conversational_and_a_stable_prefix():
    rows = bench_rows(6)
    assert rows[:3] == bench_rows(3)
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert rows[2]["prompt"][1]["content"] == "What is (998 + 533) * 17?" and rows[2]["answer"] == 26027
    assert load_tasks(4, seed=7) == bench_rows(4)  # one row order whatever the run's seed
    from agent_rl.core.registry import load_env

    # agent-rl's side: rollout.env=bench.shared.vs_trl_work
    assert load_env("bench.shared.vs_trl_work").load_tasks(2) == bench_rows(2)


def test_reward_on_trl_completions():
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "6 * 4"}}}]}
    completions = [
        [call, {"role": "tool", "name": "calculator", "content": "24"}, {"role": "assistant", "content": "It is 24."}],
        [{"role": "assistant", "content": "The answer is 1,234."}],
        [{"role": "assistant", "content": "24 or maybe 25"}],  # the last number counts
        [call, {"role": "tool", "name": "calculator", "content": "24"}],  # cut after the tool: no reply
        [call],  # ends on a call
    ]
    assert correct(None, completions, [24, 1234, 24, 24, 24]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_reward_through_agent_rl_env():
    task = bench_rows(2)[1]  # What is 2 * 6?
    env = make_env(task)

    async def play(*replies: Message) -> float:
        return as_reward(await env.reward([*await env.initial_messages(), *replies])).value

    call = Message("assistant", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 * 12"}}\n'
                                '</tool_call>')
    assert asyncio.run(play(call, Message("tool", "12", name="calculator"), Message("assistant", "12."))) == 1.0
    assert asyncio.run(play(Message("assistant", "The answer is 13."))) == 0.0
    assert asyncio.run(play(call)) == 0.0  # the numbers inside a tool call are no answer


def test_summary_skips_the_warm_up_step():
    steps = [{"step_s": 100.0, "gen_s": 50.0, "sampled_tokens": 1000, "rollouts": 32, "tool_rollouts": 0},
             {"step_s": 10.0, "gen_s": 4.0, "sampled_tokens": 300, "rollouts": 32, "tool_rollouts": 8},
             {"step_s": 30.0, "gen_s": 6.0, "sampled_tokens": 500, "rollouts": 32, "tool_rollouts": 16}]
    s = summarise(steps)
    assert s["measured_steps"] == 2 and s["step_s_mean"] == 20.0 and s["gen_s_mean"] == 5.0
    assert s["tokens_per_step_s"] == 20.0  # (300 + 500) / (10 + 30)
    assert s["tool_call_rate"] == 0.375  # 24 / 64
    assert summarise(steps[:1])["measured_steps"] == 1  # a single step is all there is


@pytest.mark.parametrize("argv, message", [
    (["--adapter", "/nonexistent/adapter"], "error: --adapter /nonexistent/adapter: no adapter_config.json"),
    (["--steps", "0"], "error: --steps must be >= 1"),
])
def test_bad_setup_is_one_error_line(argv, message, tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--only", "agent-rl", "--out", str(tmp_path),
                        *argv], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and p.stderr.startswith(message)
