"""Demonstrations (exact chat format and loss mask of rollouts) and the cold-start SFT."""

from __future__ import annotations

import json

import pytest
import torch

from agent_rl.config.file import load_config
from agent_rl.core.registry import load_env
from agent_rl.demos import make_demos, read_demos, write_demos
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.sft import nll_step, sft


async def test_demos_have_the_rollout_format_and_mask(renderer):
    demos, stats = await make_demos(load_env("calculator"), renderer, 10, seed=1, direct_share=0.3)
    assert stats == {"demos": 10.0, "dropped": 0.0, "direct_share": 0.3, "imperfect_share": 0.0, "tool_use_rate": 0.7,
                     "tokens_mean": pytest.approx(sum(len(d.token_ids) for d in demos) / 10)}
    tool_demo = next(d for d in demos if d.used_tools)
    task = next(t for t in load_env("calculator").load_tasks(10, seed=1) if t["id"] == tool_demo.task_id)
    ids, mask = tool_demo.token_ids, tool_demo.loss_mask
    # the assistant's own tokens, and only those, are trained on: two turns, each closed by <|im_end|>
    sampled = renderer.render_text([i for i, m in zip(ids, mask) if m])
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{task["expression"]}"}}}}\n</tool_call>'
    assert sampled == f"{call}<|im_end|>The answer is {task['answer']}.<|im_end|>"
    # the masked-out part is the prompt, the template scaffolding and the tool's output
    assert f"<tool_response>\n{task['answer']}\n</tool_response>" in renderer.render_text(
        [i for i, m in zip(ids, mask) if not m])
    # the same tokens a full render of the finished conversation gives: the chat template, exactly
    env = load_env("calculator").make_env(task)
    full = renderer.render(list(tool_demo.messages), env.tool_schemas, add_generation_prompt=False)
    assert list(ids) == full[: len(ids)] and len(full) - len(ids) <= 1  # full ends with the newline after <|im_end|>
    direct = [d for d in demos if not d.used_tools]
    assert len(direct) == 3 and all(d.messages[-1].content.startswith("The answer is ") for d in direct)


async def test_demo_file_round_trip_and_bad_lines(renderer, tmp_path):
    demos, _ = await make_demos(load_env("calculator"), renderer, 4, seed=0, direct_share=0.5)
    path = write_demos(tmp_path / "d.jsonl", demos)
    back = read_demos(path)
    assert [(d.token_ids, d.loss_mask) for d in back] == [(t.token_ids, t.loss_mask) for t in demos]
    assert sum(json.loads(line)["direct"] for line in path.read_text().splitlines()) == 2
    row = json.loads(path.read_text().splitlines()[0])
    path.write_text(path.read_text() + json.dumps({**row, "loss_mask": row["loss_mask"][:-1]}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:5: token_ids and loss_mask must have the same length"):
        read_demos(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: not a demonstration"):
        read_demos(path)
    with pytest.raises(ValueError, match="not found"):
        read_demos(tmp_path / "none.jsonl")


async def test_demos_need_a_solver_and_a_valid_share(renderer):
    with pytest.raises(ValueError, match="environment 'toy' has no scripted solver"):
        await make_demos(load_env("toy"), renderer, 2)
    with pytest.raises(ValueError, match=r"direct_share must be within \[0, 1\]"):
        await make_demos(load_env("calculator"), renderer, 2, direct_share=1.5)
    with pytest.raises(ValueError, match=r"direct_share \+ imperfect_share must be <= 1 \(got 0.6 \+ 0.5\)"):
        await make_demos(load_env("gui"), renderer, 2, direct_share=0.6, imperfect_share=0.5)
    with pytest.raises(ValueError, match="imperfect_share needs a mistake function in environment 'calculator'"):
        await make_demos(load_env("calculator"), renderer, 2, imperfect_share=0.5)


async def test_imperfect_demos_make_one_mistake_and_recover(renderer):
    """imperfect_share of the gui demonstrations slip once (the env's `mistake`) and the solver repairs it:
    every one is still solved, and only those have a refused action or an extra pair of clicks."""
    spec = load_env("gui").with_task_args({"levels": [1]})
    clean, clean_stats = await make_demos(spec, renderer, 20, seed=4)
    demos, stats = await make_demos(spec, renderer, 20, seed=4, imperfect_share=0.4)
    assert stats["demos"] == 20.0 and stats["dropped"] == 0.0 and stats["imperfect_share"] == 0.4
    assert clean_stats["imperfect_share"] == 0.0 and all(t.reward == 1.0 for t in demos)
    by_id = {t.task_id: t for t in clean}
    slipped = [t for t in demos if t.messages != by_id[t.task_id].messages]
    assert len(slipped) == 8  # round(20 * 0.4), each one longer than its clean twin by its slip (and fix)
    for t in slipped:
        extra = len(t.tool_calls) - len(by_id[t.task_id].tool_calls)
        refused = t.reward_parts["invalid_actions"]
        assert (refused, extra) in {(1.0, 1), (0.0, 2)}, (refused, extra)  # refused, or a toggle set back
    again, _ = await make_demos(spec, renderer, 20, seed=4, imperfect_share=0.4)
    assert [t.token_ids for t in again] == [t.token_ids for t in demos]  # seeded


async def test_a_slip_stays_in_the_context_but_out_of_the_loss(renderer):
    """SFT on an imperfect demonstration learns the repair, not the slip: the slipped turn's tokens are in
    the ids with loss mask 0, every other assistant turn is trained. A refused slip changes nothing else,
    so what is trained is then exactly the clean twin's trained tokens."""
    spec = load_env("gui").with_task_args({"levels": [1]})
    clean = {t.task_id: t for t in (await make_demos(spec, renderer, 20, seed=4))[0]}
    demos, _ = await make_demos(spec, renderer, 20, seed=4, imperfect_share=0.4)
    slipped = [t for t in demos if t.messages != clean[t.task_id].messages]
    refused = 0
    for t in slipped:
        untrained = [turn for turn in t.turns if not any(t.loss_mask[turn.start:turn.end])]
        assert len(untrained) == 1, t.task_id  # the slip, and only it
        assert all(all(t.loss_mask[turn.start:turn.end]) for turn in t.turns if turn not in untrained)
        [slip] = untrained
        assert set(t.logprobs[slip.start:slip.end]) == {0.0}
        assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns) - (slip.end - slip.start)
        twin = clean[t.task_id]
        trained = [i for i, m in zip(t.token_ids, t.loss_mask) if m]
        if t.reward_parts["invalid_actions"] == 1.0:  # refused: the page did not change
            refused += 1
            assert trained == [i for i, m in zip(twin.token_ids, twin.loss_mask) if m]
    assert refused >= 1 and len(slipped) == 8
    for t in demos:
        if t not in slipped:
            assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)


async def test_a_segment_left_with_nothing_to_train_is_not_written(renderer, tmp_path):
    """An earlier segment whose only sampled turn was a slip has an all-zero mask: read_demos would refuse
    that line, so write_demos leaves it out and keeps the rest of the demonstration."""
    from dataclasses import replace

    from agent_rl.core.types import Segment

    [demo], _ = await make_demos(load_env("calculator"), renderer, 1, seed=0)
    empty = Segment(demo.token_ids[:5], (0,) * 5, (0.0,) * 5)
    path = write_demos(tmp_path / "d.jsonl", [replace(demo, segments=(empty,))])
    assert [(d.token_ids, d.loss_mask) for d in read_demos(path)] == [(demo.token_ids, demo.loss_mask)]


async def test_demos_cut_by_the_rollout_limits_are_dropped_and_counted(renderer):
    demos, stats = await make_demos(load_env("calculator"), renderer, 3, limits=EpisodeLimits(max_tokens_per_turn=8))
    assert demos == [] and stats["dropped"] == 3.0


def _cfg(tiny_dir, tmp_path, demos, **sets):
    base = {"model.name": str(tiny_dir), "model.lora_rank": 8, "model.lora_alpha": 16, "sft.demos": str(demos),
            "sft.epochs": 3, "sft.batch_size": 4, "sft.lr": 3e-3, "sft.run_dir": str(tmp_path / "sft"),
            "run.tensorboard": "false", "run.save_every": 2}
    return load_config(None, [f"{k}={v}" for k, v in {**base, **sets}.items()])


async def test_sft_lowers_the_loss_and_writes_an_adapter(renderer, tiny_dir, tmp_path):
    demos, _ = await make_demos(load_env("calculator"), renderer, 4, seed=0, direct_share=0.25)
    path = write_demos(tmp_path / "d.jsonl", demos)
    out = sft(_cfg(tiny_dir, tmp_path, path, **{"sft.batch_size": 2}))
    # a random model starts near ln(49152) = 10.8 nats per token; its LoRA (the output layer is frozen)
    # moves that slowly: observed 10.44 -> 10.19 in these 6 steps
    assert out["sft/loss_before"] > 9.0 and out["sft/loss_after"] < out["sft/loss_before"] - 0.1, out
    assert (tmp_path / "sft" / "adapter" / "adapter_config.json").is_file()
    lines = (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]  # 3 epochs x 2 batches of 2
    assert (tmp_path / "sft" / "checkpoints" / "latest").read_text().strip() == "step-000006"


async def test_nll_is_the_same_whatever_the_micro_batching(renderer, tiny_dir, tmp_path):
    from agent_rl.learn.policy import apply_lora, load_causal_lm

    demos, _ = await make_demos(load_env("calculator"), renderer, 4, seed=2, direct_share=0.5)
    trajs = read_demos(write_demos(tmp_path / "d.jsonl", demos))
    model = apply_lora(load_causal_lm(str(tiny_dir)), rank=4, alpha=8)
    grads = []
    for tokens in (100_000, 1):  # one micro-batch, or one row each
        model.zero_grad(set_to_none=True)
        loss, n = nll_step(model, trajs, 0, tokens, 64, train=True)
        grads.append((loss, torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])))
    assert n == sum(sum(t.loss_mask[1:]) for t in trajs)
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6, rtol=1e-4)

