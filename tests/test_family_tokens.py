"""Token-level truths of each model family, with real tokenizers where they exist offline.

Per family: the hand-written 3-turn, 2-call episode (the one of tests/test_rollout_tokens.py, whose
SmolLM2/ChatML version is there), its ids after the prompt written out literally with their text in
comments, and its loss mask; incremental rendering == full rendering for canonical replies; and the
malformed-call fixtures, each answered by exactly one tool message. Tokenizers: Qwen2.5's and
Gemma 3's real ones (from their GGUF files); Qwen3 runs on Qwen2.5's with Qwen3's four added
tokens (ids above Qwen2.5's padded vocabulary, so not Qwen3's own numbers); Llama 3 on SmolLM2's
with Llama 3's special tokens added, gpt-oss (harmony) on SmolLM2's with the harmony tokens (the
ids of a stand-in, checked for structure, not numbers).
"""

from __future__ import annotations

import pytest
from helpers import add_episode, script_of

from agent_rl.core.renderers.chatml import Qwen25Renderer
from agent_rl.core.renderers.gemma3 import Gemma3Renderer
from agent_rl.core.renderers.harmony import HarmonyRenderer
from agent_rl.core.renderers.llama3 import Llama3Renderer
from agent_rl.core.renderers.qwen3 import Qwen3Renderer, format_thinking
from agent_rl.core.types import Message, StopReason, ToolCall

FAMILIES = {
    "qwen2_5": (Qwen25Renderer, "qwen25_tokenizer"),
    "qwen3": (Qwen3Renderer, "qwen3_standin"),
    "llama3": (Llama3Renderer, "llama3_standin"),
    "gemma3": (Gemma3Renderer, "gemma3_tokenizer"),
    "harmony": (HarmonyRenderer, "harmony_standin"),
}


@pytest.fixture(params=list(FAMILIES))
def family(request):
    cls, tokenizer = FAMILIES[request.param]
    return request.param, cls(request.getfixturevalue(tokenizer))


def replies(name: str) -> list[Message]:
    """Two calls then the answer, as each family writes them (Qwen3 reasons first)."""
    think = (lambda r, a="": format_thinking(r, a)) if name == "qwen3" else (lambda r, a="": a)
    return [Message("assistant", think("2 + 3 first."), (ToolCall("add", {"a": 2, "b": 3}),)),
            Message("assistant", think("Then + 4."), (ToolCall("add", {"a": 5, "b": 4}),)),
            Message("assistant", think("Done.", "It is 9."))]


# After the prompt: sampled turn 1, tool reply 5, sampled turn 2, tool reply 9, answer (text in comments).
EXPECTED = {
    "qwen2_5": dict(prompt_len=181, parts=[
        # '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
        [151657, 198, 4913, 606, 788, 330, 718, 497, 330, 16370, 788, 5212, 64, 788, 220, 17, 11, 330, 65, 788,
         220, 18, 11248, 151658, 151645],
        # '\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
        [198, 151644, 872, 198, 27, 14172, 9655, 397, 20, 198, 522, 14172, 9655, 29, 151645, 198, 151644, 77091, 198],
        [151657, 198, 4913, 606, 788, 330, 718, 497, 330, 16370, 788, 5212, 64, 788, 220, 20, 11, 330, 65, 788,
         220, 19, 11248, 151658, 151645],
        [198, 151644, 872, 198, 27, 14172, 9655, 397, 24, 198, 522, 14172, 9655, 29, 151645, 198, 151644, 77091, 198],
        [2132, 374, 220, 24, 13, 151645],  # 'It is 9.<|im_end|>'
    ]),
    "qwen3": dict(prompt_len=181, parts=[
        # '<think>\n2 + 3 first.\n</think>\n\n<tool_call>\n{...}\n</tool_call><|im_end|>'
        [151938, 198, 17, 488, 220, 18, 1156, 624, 151939, 271, 151657, 198, 4913, 606, 788, 330, 718, 497, 330,
         16370, 788, 5212, 64, 788, 220, 17, 11, 330, 65, 788, 220, 18, 11248, 151658, 151645],
        # '\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
        # (Qwen3's <tool_response> tags are single added tokens)
        [198, 151644, 872, 198, 151936, 198, 20, 198, 151937, 151645, 198, 151644, 77091, 198],
        [151938, 198, 12209, 488, 220, 19, 624, 151939, 271, 151657, 198, 4913, 606, 788, 330, 718, 497, 330,
         16370, 788, 5212, 64, 788, 220, 20, 11, 330, 65, 788, 220, 19, 11248, 151658, 151645],
        [198, 151644, 872, 198, 151936, 198, 24, 198, 151937, 151645, 198, 151644, 77091, 198],
        # '<think>\nDone.\n</think>\n\nIt is 9.<|im_end|>'
        [151938, 198, 17453, 624, 151939, 271, 2132, 374, 220, 24, 13, 151645],
    ]),
    "llama3": dict(prompt_len=235, parts=[
        # '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>'
        [39428, 1245, 1799, 476, 2104, 1002, 476, 11582, 1799, 9583, 81, 1799, 216, 34, 28, 476, 82, 1799, 216,
         35, 17859, 49155],
        # '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
        # '<|start_header_id|>assistant<|end_header_id|>\n\n'
        [49153, 15780, 2792, 49154, 198, 198, 18, 37, 18, 49155, 49153, 520, 9531, 49154, 1116],
        [39428, 1245, 1799, 476, 2104, 1002, 476, 11582, 1799, 9583, 81, 1799, 216, 37, 28, 476, 82, 1799, 216,
         36, 17859, 49155],
        [49153, 15780, 2792, 49154, 198, 198, 18, 41, 18, 49155, 49153, 520, 9531, 49154, 1116],
        [1589, 314, 216, 41, 30, 49155],  # 'It is 9.<|eot_id|>'
    ]),
    "gemma3": dict(prompt_len=226, parts=[
        # '[add(a=2, b=3)]<end_of_turn>'
        [236840, 1282, 236769, 236746, 236784, 236778, 236764, 518, 236784, 236800, 7066, 106],
        # '\n<start_of_turn>user\n```tool_output\n5\n```<end_of_turn>\n<start_of_turn>model\n'
        [107, 105, 2364, 107, 2717, 13205, 236779, 4606, 107, 236810, 107, 2717, 106, 107, 105, 4368, 107],
        # '[add(a=5, b=4)]<end_of_turn>'
        [236840, 1282, 236769, 236746, 236784, 236810, 236764, 518, 236784, 236812, 7066, 106],
        [107, 105, 2364, 107, 2717, 13205, 236779, 4606, 107, 236819, 107, 2717, 106, 107, 105, 4368, 107],
        [1509, 563, 236743, 236819, 236761, 106],  # 'It is 9.<end_of_turn>'
    ]),
    "harmony": dict(prompt_len=167, parts=[
        # ' to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>'
        [288, 45, 22942, 30, 2104, 49155, 3591, 529, 7221, 49154, 39428, 81, 1799, 216, 34, 28, 476, 82, 1799,
         216, 35, 109, 49156],
        # '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"5"<|end|><|start|>assistant'
        [49152, 22942, 30, 2104, 288, 45, 520, 9531, 49155, 3591, 529, 49154, 18, 37, 18, 49153, 49152, 520, 9531],
        [288, 45, 22942, 30, 2104, 49155, 3591, 529, 7221, 49154, 39428, 81, 1799, 216, 37, 28, 476, 82, 1799,
         216, 36, 109, 49156],
        [49152, 22942, 30, 2104, 288, 45, 520, 9531, 49155, 3591, 529, 49154, 18, 41, 18, 49153, 49152, 520, 9531],
        [49155, 17254, 49154, 1589, 314, 216, 41, 30, 49157],  # '<|channel|>final<|message|>It is 9.<|return|>'
    ]),
}
PROMPT_ENDS = {"qwen2_5": "<|im_start|>user\n2+3+4?<|im_end|>\n<|im_start|>assistant\n",
               "qwen3": "<|im_start|>user\n2+3+4?<|im_end|>\n<|im_start|>assistant\n",
               "llama3": "}\n\n2+3+4?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
               "gemma3": "]\n\n2+3+4?<end_of_turn>\n<start_of_turn>model\n",
               "harmony": "<|end|><|start|>user<|message|>2+3+4?<|end|><|start|>assistant"}


async def test_three_turn_episode_ids_and_mask_by_hand(family):
    name, renderer = family
    traj, _, _ = await add_episode(renderer, script_of(replies(name)))
    want = EXPECTED[name]
    n = want["prompt_len"]
    assert traj.prompt_len == n and renderer.render_text(traj.token_ids[:n]).endswith(PROMPT_ENDS[name])
    parts = want["parts"]
    assert list(traj.token_ids[n:]) == [i for p in parts for i in p]
    assert list(traj.loss_mask) == [0] * n + [m for k, p in enumerate(parts) for m in [1 - k % 2] * len(p)]
    ends = [n + sum(len(p) for p in parts[:k + 1]) for k in range(5)]
    assert [(t.start, t.end) for t in traj.turns] == [(n, ends[0]), (ends[1], ends[2]), (ends[3], ends[4])]
    assert traj.stop_reason is StopReason.NO_TOOL_CALL and traj.reward == 1.0 and traj.segments == ()
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("add", True), ("add", True)]


async def test_incremental_rendering_equals_a_full_render(family):
    name, renderer = family
    traj, tools, sampler = await add_episode(renderer, script_of(replies(name)))
    full = renderer.render(list(traj.messages), tools, add_generation_prompt=False)
    assert full[: len(traj.token_ids)] == list(traj.token_ids)
    # what a full render adds after the last sampled stop token is only the turn's closing whitespace
    assert renderer.render_text(full[len(traj.token_ids):]) in ("", "\n")
    for before, after in zip(sampler.calls, sampler.calls[1:]):  # every prompt extends the previous one
        assert after[: len(before)] == before
    sampled = [i for i, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert sampled == [i for r in replies(name) for i in renderer.reply_ids(r)]


# The malformed-call fixtures, as each family would write them: (reply text, the tool message it gets).
MALFORMED = {
    "llama3": [
        ('{"name": "add", "parameters": {"a": 1,}}', "Error: tool call 1: malformed JSON (Expecting property name "
         "enclosed in double quotes at char 38) in '{\"name\": \"add\", \"parameters\": {\"a\": 1,}}'"),
        ('{"name": "sub", "parameters": {"a": 1, "b": 2}}', "Error: unknown tool 'sub'; available tools: add"),
        ('{"name": "add", "parameters": "{\\"a\\": 1, \\"b\\": 2}"}', "3"),  # string-encoded arguments are read
        ('{"name": "add", "parameters": {"a": 1, "b": 2', "Error: tool call 1: malformed JSON (Expecting ',' "
         "delimiter at char 45) in '{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2'"),
    ],
    "gemma3": [
        ("[add(a=1,, b=2)]", "Error: tool call 1: not a Python list of calls (invalid syntax) in '[add(a=1,, b=2)]'"),
        ("[sub(a=1, b=2)]", "Error: unknown tool 'sub'; available tools: add"),
        ('[add(a="1", b=2)]', "3"),  # a string argument is validated (and coerced) by the tool's schema
        ("[add(a=1, b=2)", "Error: tool call 1: not a Python list of calls ('[' was never closed) in '[add(a=1, b=2)'"),
    ],
    "harmony": [
        (' to=functions.add<|channel|>commentary json<|message|>{"a": 1,}',
         "Error: tool call 1 (add): malformed JSON (Expecting property name enclosed in double quotes at char 8) "
         "in '{\"a\": 1,}'"),
        (' to=functions.sub<|channel|>commentary json<|message|>{"a": 1, "b": 2}',
         "Error: unknown tool 'sub'; available tools: add"),
        (' to=functions.add<|channel|>commentary json<|message|>"{\\"a\\": 1, \\"b\\": 2}"', "3"),
        (' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2',
         "Error: tool call 1 (add): malformed JSON (Expecting ',' delimiter at char 15) in '{\"a\": 1, \"b\": 2'"),
        # a call written inside the analysis message is thinking; only the header's counts
        ('<|channel|>analysis<|message|>maybe to=functions.add {"a": 9, "b": 9}<|end|><|start|>assistant'
         ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}', "3"),
    ],
    "qwen3": [  # the Hermes fixtures are in tests/test_rollout_tokens.py; here what thinking changes
        ('<think>\nmaybe <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>?\n</think>\n\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
         "Error: tool call 1: malformed JSON (Expecting property name enclosed in double quotes at char 37) "
         "in '{\"name\": \"add\", \"arguments\": {\"a\": 1,}}'"),
    ],
}
TWO_CALLS_ONE_BAD = {
    "llama3": '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 1}}',
    "gemma3": "[add(a=1, b=2), add(a=1)]",
    "qwen3": '<think>\nTwo.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
}


def malformed_cases():
    return [(fam, reply, msg) for fam, cases in MALFORMED.items() for reply, msg in cases]


@pytest.mark.parametrize("fam,reply,message", malformed_cases())
async def test_malformed_calls_get_one_tool_message_and_the_episode_goes_on(request, fam, reply, message):
    cls, tokenizer = FAMILIES[fam]
    renderer = cls(request.getfixturevalue(tokenizer))
    it = iter([reply, "It is 3."])
    traj, _, _ = await add_episode(renderer, lambda messages: next(it))
    first = traj.turns[0]
    assert list(traj.token_ids[first.start:first.end]) == renderer.encode_reply(reply) + [renderer.stop_token_ids[0]]
    assert traj.messages[2].content == reply
    tools = [m for m in traj.messages if m.role == "tool"]
    assert [m.content for m in tools] == [message]
    assert len(traj.turns) == 2 and traj.stop_reason is StopReason.NO_TOOL_CALL


@pytest.mark.parametrize("fam", list(TWO_CALLS_ONE_BAD))
async def test_two_calls_one_bad_get_two_tool_messages(request, fam):
    cls, tokenizer = FAMILIES[fam]
    renderer = cls(request.getfixturevalue(tokenizer))
    it = iter([TWO_CALLS_ONE_BAD[fam], "It is 3."])
    traj, _, _ = await add_episode(renderer, lambda messages: next(it))
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools == ["3", "Error: invalid arguments for add: b: Field required"]
    assert [c.ok for c in traj.tool_calls] == [True, False]


# -- Qwen2.5's bare calls: `{"name": ..., "arguments": ...}` without <tool_call> tags (model.bare_tool_calls) -----
BARE_CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
# '{"', 'name', '":', ' "', 'add', '",', ' "', 'arguments', '":', ' {"', 'a', '":', ' ', '2', ',', ' "', 'b', '":',
# ' ', '3', '}}', '<|im_end|>'
BARE_CALL_IDS = [4913, 606, 788, 330, 718, 497, 330, 16370, 788, 5212, 64, 788, 220, 17, 11, 330, 65, 788, 220, 18,
                 3417, 151645]
MALFORMED["qwen2_5"] = [  # read leniently, then refused as a tagged call would be
    ('{"name": "sub", "arguments": {"a": 1, "b": 2}}', "Error: unknown tool 'sub'; available tools: add"),
    ('```json\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n```', "3"),  # fenced, string-encoded
    ('{"name": "add", "arguments": {"a": 1, "b": 2}, "required": ["a"]}',
     "Error: tool call 1 (add): unexpected keys ['required']; use {\"name\": ..., \"arguments\": {...}}"),
]
TWO_CALLS_ONE_BAD["qwen2_5"] = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "add", "arguments": {"a": 1}}'


async def test_a_bare_call_is_a_call_for_qwen2_5_and_text_when_switched_off(qwen25_tokenizer):
    on, off = Qwen25Renderer(qwen25_tokenizer), Qwen25Renderer(qwen25_tokenizer)
    off.bare_calls = False
    assert on.bare_calls is True
    played = {}
    for name, renderer in (("on", on), ("off", off)):
        played[name], _, _ = await add_episode(renderer, script_of([BARE_CALL, "It is 5."]))
        traj, first = played[name], played[name].turns[0]
        # the sampled ids are the same whichever way they are read; only the parse differs
        assert list(traj.token_ids[first.start:first.end]) == BARE_CALL_IDS
        assert list(traj.loss_mask[first.start:first.end]) == [1] * len(BARE_CALL_IDS)
        assert traj.messages[2].content == BARE_CALL
    # on: one call, its result, the answer; off: the JSON is the final reply and the episode ends
    assert [m.content for m in played["on"].messages if m.role == "tool"] == ["5"] and len(played["on"].turns) == 2
    assert played["off"].tool_calls == () and len(played["off"].turns) == 1
    assert played["off"].stop_reason is StopReason.NO_TOOL_CALL


@pytest.mark.parametrize("reply", ['I would call {"name": "add", "arguments": {"a": 2, "b": 3}} now.',
                                   '{"name": "add", "arguments": {"a": 2, "b": 3}',  # broken JSON
                                   '{"a": 2, "b": 3}'])
async def test_a_reply_that_is_not_only_call_objects_ends_the_episode(qwen25_tokenizer, reply):
    traj, _, _ = await add_episode(Qwen25Renderer(qwen25_tokenizer), lambda messages: reply)
    assert traj.tool_calls == () and len(traj.turns) == 1 and traj.stop_reason is StopReason.NO_TOOL_CALL
