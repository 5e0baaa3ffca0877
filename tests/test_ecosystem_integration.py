"""verifiers and OpenEnv environments against a real vLLM server (the tiny random model): `agent-rl rollout`,
`agent-rl eval` and two GRPO steps, as a user runs them (envs.verifiers_env, envs.openenv_env).

The verifiers taskset is tests/vf_add_taskset.py, named by its file, with a dense reward plugged in through
verifiers' own `TaskConfig.rewards` (the tiny model never answers right, so without it no group would have
reward variance and the update would have nothing to learn from); the OpenEnv environment is
examples/openenv_guess, served by the run itself.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="the verifiers adapter needs pip install 'agent-rl[verifiers]'")
pytest.importorskip("openenv", reason="the OpenEnv adapter needs pip install 'agent-rl[openenv]'")

from agent_rl import trainer
from agent_rl.config.file import load_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # a CLI run starts a process and loads a model
ROOT = Path(__file__).resolve().parents[1]
TASKSET = str(ROOT / "tests" / "vf_add_taskset.py")
VF_ARGS = json.dumps({"taskset": TASKSET, "args": {"task": {"rewards": {
    "brevity": {"fn": "vf_add_taskset:brevity", "weight": 1.0}}}}})
GUESS_ARGS = json.dumps({"path": str(ROOT / "examples" / "openenv_guess")})


def cli(*args: str, timeout: float = 560) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent_rl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_rollout_cli_on_a_verifiers_taskset(vllm_server):
    out = cli("rollout", "--env", "agent_rl.envs.verifiers_env", "--env-args", VF_ARGS, "--model",
              str(vllm_server.model_dir), "--server-url", vllm_server.url, "--tasks", "2", "--group-size", "2",
              "--max-tokens", "24", "--max-turns", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["infra_error_rate"] == 0.0 and metrics["rollouts"] == 4
    assert "correct" in out.stdout and "brevity" in out.stdout  # the task's reward parts, printed per rollout


def test_eval_cli_on_the_verifiers_example(vllm_server, tmp_path):
    report = tmp_path / "eval.json"
    out = cli("eval", str(ROOT / "examples" / "verifiers_grpo.yaml"), "--set", f"model.name={vllm_server.model_dir}",
              "--set", f"sampler.server_urls=[{vllm_server.url}]", "--set", "rollout.max_tokens_per_turn=24",
              "--set", "eval.tasks=2", "--n", "2", "--adapter", "base", "--out", str(report))
    assert out.returncode == 0, out.stderr[-2000:]
    base = json.loads(report.read_text())["results"]["base"]
    assert base["rollouts"] == 4 and base["infra_error_rate"] == 0.0


def grpo(vllm_server, run_dir: Path, env: str, env_args: str, **extra: str):
    sets = {
        "model.name": str(vllm_server.model_dir), "model.lora_rank": "8", "model.lora_alpha": "16",
        "sampler.server_urls": f"[{vllm_server.url}]", "sampler.max_model_len": "2048",
        "rollout.env": env, "rollout.env_args": env_args, "rollout.tasks_per_step": "2", "rollout.group_size": "4",
        "rollout.max_turns": "2", "rollout.max_tokens_per_turn": "24", "rollout.max_total_tokens": "1024",
        "optim.lr": "3e-3", "run.steps": "2", "run.run_dir": str(run_dir), "run.seed": "7",
        "run.tensorboard": "false", **extra,
    }
    asyncio.run(trainer.train(load_config(None, [f"{k}={v}" for k, v in sets.items()])))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_grpo_steps_on_a_verifiers_taskset(vllm_server, tmp_path):
    steps = grpo(vllm_server, tmp_path / "run", "agent_rl.envs.verifiers_env", VF_ARGS)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["infra_error_rate"] == 0.0 for s in steps)
    assert steps[0]["train_tokens"] > 0  # the plugged dense reward gives the groups variance: an update ran
    assert (tmp_path / "run" / "adapters" / "v2").is_dir()


def test_rollout_cli_and_two_grpo_steps_on_an_openenv_folder(vllm_server, tmp_path):
    out = cli("rollout", "--env", "agent_rl.envs.openenv_env", "--env-args", GUESS_ARGS, "--model",
              str(vllm_server.model_dir), "--server-url", vllm_server.url, "--tasks", "2", "--group-size", "2",
              "--max-tokens", "24", "--max-turns", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["infra_error_rate"] == 0.0 and metrics["rollouts"] == 4
    assert "Guess the hidden number" in out.stdout  # the reset's observation opens every episode
    steps = grpo(vllm_server, tmp_path / "run", "agent_rl.envs.openenv_env", GUESS_ARGS)
    assert [s["step"] for s in steps] == [1, 2] and all(s["infra_error_rate"] == 0.0 for s in steps)
