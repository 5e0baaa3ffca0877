"""Learning: GRPO on a dense reward moves the policy the right way, and the wrong way when negated.

The tiny random model plays `envs.toy` (reward = share of a 200-character budget left unused) with
a real vLLM server and LoRA hot-loading; a few steps must raise the mean reward by a clear margin.
The same run with the advantages negated must lower it: a sign error anywhere in advantages, loss,
masking or weight sync would fail one of the two. The rise is checked in float32 and bfloat16 and with
rollouts streaming up to two policy versions ahead of the trainer (`algorithm.max_staleness: 2`), the fall
in that last run.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from agent_rl import trainer
from agent_rl.config.file import load_config
from agent_rl.learn.advantages import group_advantages

pytestmark = pytest.mark.integration


def run(tmp_path, vllm_server, name: str, steps: int = 8, stages: trainer.Stages = trainer.Stages(),
        dtype: str = "auto", staleness: int = 0) -> list[float]:
    cfg = load_config(None, [f"model.dtype={dtype}", f"algorithm.max_staleness={staleness}",
        f"model.name={vllm_server.model_dir}", "model.lora_rank=8", "model.lora_alpha=16",
        f"sampler.server_urls=[{vllm_server.url}]", "sampler.max_model_len=2048",
        "rollout.env=toy", "rollout.tasks_per_step=4", "rollout.group_size=8", "rollout.max_turns=1",
        "rollout.max_tokens_per_turn=48", "rollout.max_total_tokens=128",
        "optim.lr=3e-3", "algorithm.tis_cap=null",
        f"run.steps={steps}", f"run.run_dir={tmp_path / name}", "run.save_every=100", "run.seed=1",
    ])
    asyncio.run(trainer.train(cfg, stages=stages))
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    return [x["reward_mean"] for x in lines]


def negated(groups, advantage_fn, credit):
    return group_advantages(groups, lambda rewards: -advantage_fn(rewards), credit)


@pytest.fixture(params=["float32", "bfloat16"])
def server_and_dtype(request):
    """The fp32 session server, or the bf16 one (trainer and server both in bfloat16, on the CPU)."""
    name = "vllm_server" if request.param == "float32" else "bf16_server"
    return request.getfixturevalue(name), request.param


def test_grpo_raises_a_dense_reward(tmp_path, server_and_dtype):
    vllm_server, dtype = server_and_dtype
    up = run(tmp_path, vllm_server, "up", dtype=dtype)
    first, last = sum(up[:2]) / 2, sum(up[-2:]) / 2
    assert last > first + 0.1, up


def test_grpo_raises_a_dense_reward_with_rollouts_two_versions_stale_and_negated_advantages_lower_it(
        tmp_path, vllm_server):
    """The sign check runs once, here: the same loss, advantages and sync as the run above with the stream two
    versions ahead (a negated run at staleness 0 as well cost the suite ~40 s and could catch nothing this one
    cannot: staleness changes which version sampled, not the update's sign)."""
    up = run(tmp_path, vllm_server, "up", staleness=2)
    assert sum(up[-2:]) / 2 > sum(up[:2]) / 2 + 0.1, up
    lines = [json.loads(x) for x in (tmp_path / "up" / "metrics.jsonl").read_text().splitlines()]
    assert max(x["lag/max"] for x in lines) == 2  # the stream did run two versions ahead

    down = run(tmp_path, vllm_server, "down", stages=trainer.Stages(advantages=negated), staleness=2)
    assert sum(down[-2:]) / 2 < sum(down[:2]) / 2 - 0.1, down
