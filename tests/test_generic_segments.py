"""The generic fallback renderer, training segments, and picking a renderer automatically.

The "unknown model" is a small byte-level BPE tokenizer trained here in milliseconds, with no
special token of any known family and a chat template of its own that, like DeepSeek-R1's, drops
the reasoning of earlier assistant turns: the case where one append-only buffer is impossible.
"""

from __future__ import annotations

import pytest
import torch
from helpers import add_episode, script_of, trajectory

from agent_rl.config.file import load_config
from agent_rl.core.config import ConfigError
from agent_rl.core.renderers import choose as renderers
from agent_rl.core.renderers.choose import GENERIC_NOTICE, detect, get_renderer
from agent_rl.core.renderers.generic import GenericRenderer
from agent_rl.core.types import Message, Segment, StopReason, ToolCall
from agent_rl.learn.batching import collate
from agent_rl.runs.metrics import rollout_metrics

TEMPLATE = (
    "{{ bos_token }}{% if tools %}[TOOLS]{{ tools | length }}\n{% endif %}{% for m in messages %}"
    "{% if m.role == 'assistant' %}{% set c = m.content %}"
    "{% if not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}"
    "[ASSISTANT]{{ c }}{{ eos_token }}"
    "{% else %}[{{ m.role | upper }}]{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


@pytest.fixture(scope="module")
def unknown_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # role markers are special tokens, as in real templates, so text never merges across them
    markers = ["[ASSISTANT]", "[USER]", "[SYSTEM]", "[TOOL]", "[TOOLS]"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", *markers],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Use tools. What is 2+3+4? It is 9. <tool_call> add arguments name think"] * 20, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=markers)
    out.chat_template = TEMPLATE
    return out


CALL_1 = Message("assistant", "", (ToolCall("add", {"a": 2, "b": 3}),))
CALL_2 = Message("assistant", "", (ToolCall("add", {"a": 5, "b": 4}),))
ANSWER = Message("assistant", "It is 9.")


def thinking(m: Message) -> Message:
    return Message("assistant", "<think>hm</think> " + m.content, m.tool_calls)


def test_an_unknown_tokenizer_gets_the_generic_renderer_and_one_notice(unknown_tokenizer, capsys, monkeypatch):
    monkeypatch.setattr(renderers, "_noticed", False)
    assert detect(unknown_tokenizer) == "generic"
    assert isinstance(get_renderer(unknown_tokenizer), GenericRenderer)
    get_renderer(unknown_tokenizer)
    assert capsys.readouterr().err == f"notice: {GENERIC_NOTICE}\n"  # once per process
    r = get_renderer(unknown_tokenizer)
    assert r.stop_token_ids == [unknown_tokenizer.eos_token_id]  # what the template writes after a reply


def test_without_a_template_it_is_one_clear_error(unknown_tokenizer):
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=unknown_tokenizer.backend_tokenizer, eos_token="</s>")
    with pytest.raises(ValueError, match="matches no known family and has no chat template"):
        get_renderer(bare)


def test_families_are_detected(smol_tokenizer, qwen25_tokenizer, qwen3_standin, llama3_standin, gemma3_tokenizer):
    assert [detect(t) for t in (smol_tokenizer, qwen25_tokenizer, qwen3_standin, llama3_standin, gemma3_tokenizer)] \
        == ["chatml", "qwen2_5", "qwen3", "llama3", "gemma3"]


def test_renderer_name_in_the_config_is_checked():
    assert load_config(None, ["model.renderer=llama3"]).model.renderer == "llama3"
    with pytest.raises(ConfigError, match=r"^config error: model.renderer: .*unknown renderer 'llama9'"):
        load_config(None, ["model.renderer=llama9"])


async def test_a_prefix_preserving_template_gives_one_segment(unknown_tokenizer):
    r = GenericRenderer(unknown_tokenizer)
    traj, tools, sampler = await add_episode(r, script_of([CALL_1, CALL_2, ANSWER]))
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and traj.reward == 1.0 and traj.segments == ()
    full = r.render(list(traj.messages), tools, add_generation_prompt=False)
    assert list(traj.token_ids) == full  # incremental == the template's own full render
    sampled = [i for i, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert sampled == [i for m in (CALL_1, CALL_2, ANSWER) for i in r.reply_ids(m)]


async def test_a_template_that_rewrites_history_starts_new_segments(unknown_tokenizer):
    r = GenericRenderer(unknown_tokenizer)
    replies = [thinking(CALL_1), thinking(CALL_2), thinking(ANSWER)]
    traj, tools, sampler = await add_episode(r, script_of(replies))
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and traj.reward == 1.0
    segs = traj.all_segments
    assert len(segs) == 3 and [t.segment for t in traj.turns] == [0, 1, 2]
    for k, (seg, turn, reply) in enumerate(zip(segs, traj.turns, replies)):
        # each segment: a context the template rendered, then exactly the ids that were sampled in it
        assert list(seg.token_ids[turn.start:turn.end]) == r.reply_ids(reply)
        assert seg.loss_mask == (0,) * turn.start + (1,) * (turn.end - turn.start)
        assert list(seg.token_ids[:turn.start]) == r.render(traj.messages[:2 + 2 * k], tools)
        assert list(seg.token_ids) == sampler.calls[k] + r.reply_ids(reply)  # what the sampler saw, then its reply
    # the fresh context shows the earlier turn as the template rewrote it: without its reasoning
    assert "<think>" not in r.render_text(segs[1].token_ids[:traj.turns[1].start])
    assert traj.num_sampled == sum(len(r.reply_ids(m)) for m in replies)


def test_collate_makes_a_row_per_segment_with_the_trajectory_advantage():
    a = Segment((1, 2, 3), (0, 1, 1), (0.0, -0.1, -0.2))
    b = Segment((1, 4, 5, 6), (0, 0, 1, 1), (0.0, 0.0, -0.3, -0.4))
    two = trajectory(1.0, ids=b.token_ids, mask=b.loss_mask, logprobs=b.logprobs, segments=(a,))
    one = trajectory(1.0, ids=(7, 8), mask=(0, 1), logprobs=(0.0, -0.5))
    batch = collate([two, one], [0.5, -0.5])
    assert batch.input_ids_B_T.tolist() == [[1, 2, 3, 0], [1, 4, 5, 6], [7, 8, 0, 0]]
    assert batch.advantage_B.tolist() == [0.5, 0.5, -0.5]
    assert batch.loss_mask_B_T.tolist() == [[True, True, False, False], [False, True, True, False],
                                            [True, False, False, False]]
    assert torch.allclose(batch.sampler_logp_B_T[1], torch.tensor([0.0, -0.3, -0.4, 0.0]))
    assert batch.step_num_sequences == 3 and batch.step_num_tokens == 5
    assert two.num_sampled == 4 and two.num_tokens == 7
    m = rollout_metrics([two, one])
    assert m["segments_mean"] == 1.5 and m["sampled_tokens_mean"] == 2.5 and m["tokens_mean"] == 4.5


def test_every_segment_must_be_aligned():
    with pytest.raises(ValueError, match="trajectory t segment 0: token_ids \\(2\\), loss_mask \\(1\\)"):
        trajectory(1.0, ids=(1,), mask=(0,), logprobs=(0.0,), segments=(Segment((1, 2), (0,), (0.0, 0.0)),))


def test_extend_or_restart_appends_only_to_a_buffer_the_render_extends(unknown_tokenizer):
    """The one prefix-or-new-segment rule (`Renderer.extend_or_restart`, used by `next_context` here and by
    the runner for an env's replaced history), on a render fixed by hand."""
    r = GenericRenderer(unknown_tokenizer)
    r.render = lambda messages, tools=(), add_generation_prompt=True: [1, 2, 3, 4]
    assert r.extend_or_restart([], [], []) == ([1, 2, 3, 4], False)
    assert r.extend_or_restart([], [], [1, 2]) == ([3, 4], False)
    assert r.extend_or_restart([], [], (1, 2, 3)) == ([4], False)
    assert r.extend_or_restart([], [], [1, 2, 3, 4]) == ([1, 2, 3, 4], True)  # nothing new: a new segment
    assert r.extend_or_restart([], [], [1, 9]) == ([1, 2, 3, 4], True)  # the template rewrote a token
    assert r.extend_or_restart([], [], [1, 2, 3, 4, 5]) == ([1, 2, 3, 4], True)  # shorter than the buffer
    assert r.next_context([], [], [], [1, 2]) == ([3, 4], False)
