"""Every family's renderer against the model's official chat template, text and tokens.

The official templates come from the `trl` package (`trl/chat_templates/*.jinja`, a test-only
dependency) and, for Qwen2.5, also from the tokenizer inside its GGUF file. For a fixed set of
conversations (system; user; assistant with one and with two tool calls; tool responses; a final
answer; with and without tools) the renderer's ids must be exactly the ids of the template's output
tokenised by the same tokenizer, and so its text the template's text.

Where a template cannot express a conversation, the test says so: Llama 3's refuses two calls in a
turn; Gemma 3's has no tools at all (the documented prompt convention is laid on it: tool
instructions in the system text, tool results as user turns); Qwen3's rewrites earlier reasoning
(`test_qwen3_where_the_template_rewrites_history`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_rl.core.renderers.chatml import ChatMLRenderer, Qwen25Renderer
from agent_rl.core.renderers.gemma3 import Gemma3Renderer, format_tool_calls, tools_text
from agent_rl.core.renderers.harmony import HarmonyRenderer
from agent_rl.core.renderers.llama3 import Llama3Renderer
from agent_rl.core.renderers.qwen3 import Qwen3NoThinkRenderer, Qwen3Renderer, format_thinking
from agent_rl.core.types import Message, ToolCall

trl = pytest.importorskip("trl", reason="trl ships the official chat templates (pip install -e '.[dev]')")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                                    "b": {"type": "integer", "description": "second"}},
                   "required": ["a", "b"]}}}
MUL = {"type": "function", "function": {
    "name": "mul", "description": "Multiply two numbers.",
    "parameters": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                   "required": ["x", "y"]}}}
TOOLS = [ADD, MUL]


def call(name, **arguments):
    return ToolCall(name, arguments)


# A conversation is a list of (role, content, calls, reasoning): reasoning only matters to Qwen3.
EPISODE = [
    ("system", "You are a careful calculator.", (), ""),
    ("user", "What is (2 + 3) * 4, and 2 + 2?", (), ""),
    ("assistant", "", (call("add", a=2, b=3),), "First the sum."),
    ("tool", "5", (), ""),
    ("assistant", "Now both at once.", (call("mul", x=5, y=4), call("add", a=2, b=2)), "Then the rest."),
    ("tool", "20", (), ""),
    ("tool", "4", (), ""),
    ("assistant", "It is 20, and 2 + 2 = 4.", (), "Done."),
]
ONE_CALL = EPISODE[:4] + [("assistant", "It is 5 times 4: 20.", (), "Easy.")]
CONVERSATIONS = {
    # name: (turns, tools, add_generation_prompt)
    "prompt_no_tools": (EPISODE[:2], [], True),
    "prompt_tools": (EPISODE[:2], TOOLS, True),
    "prompt_tools_no_system": (EPISODE[1:2], TOOLS, True),
    "answer_no_tools": (EPISODE[:2] + [("assistant", "20 and 4.", (), "Simple.")], [], False),
    "one_call_episode": (ONE_CALL, TOOLS, False),
    "after_one_call": (EPISODE[:4], TOOLS, True),
    "two_call_episode": (EPISODE, TOOLS, False),
    "after_two_calls": (EPISODE[:7], TOOLS, True),
}
TWO_CALLS = {"two_call_episode", "after_two_calls"}


def hf_messages(turns, reasoning: bool = False):
    """The conversation as chat-template dicts (OpenAI-style tool_calls)."""
    out = []
    for role, content, calls, thought in turns:
        m = {"role": role,
             "content": format_thinking(thought, content) if reasoning and role == "assistant" else content}
        if calls:
            m["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in calls]
        if role == "tool":
            m["name"] = "add"
        out.append(m)
    return out


def our_messages(renderer, turns, reasoning: bool = False):
    out = []
    for role, content, calls, thought in turns:
        if role == "assistant":
            text = format_thinking(thought, content) if reasoning else content
            out.append(Message("assistant", renderer.format_reply(text, calls), tool_calls=calls))
        else:
            out.append(Message(role, content))
    return out


def variants(turns):
    """The conversation as it is, and without its system message (when it has one)."""
    return [turns] + ([turns[1:]] if turns[0][0] == "system" else [])


def official(tokenizer, template: str, messages, tools, add_generation_prompt, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, chat_template=template,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def check(renderer, tokenizer, expected_text: str, ours: list[int], ids: bool = True):
    assert renderer.render_text(ours) == expected_text
    if ids:  # and the ids are the template's text tokenised as the model's serving stack would
        assert ours == tokenizer.encode(expected_text, add_special_tokens=False)


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


# -- ChatML / Qwen2.5 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_qwen2_5_equals_the_official_template(qwen25_tokenizer, name):
    turns, tools, gen = CONVERSATIONS[name]
    r = Qwen25Renderer(qwen25_tokenizer)
    for source in (template("qwen2_5"), qwen25_tokenizer.chat_template):  # trl's copy and the GGUF's own
        for ts in variants(turns):  # without a system message: Qwen's default system prompt
            expected = official(qwen25_tokenizer, source, hf_messages(ts), tools, gen)
            check(r, qwen25_tokenizer, expected, r.render(our_messages(r, ts), tools, gen))


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chatml_on_smollm2_equals_the_qwen2_5_template_given_a_system_message(smol_tokenizer, name):
    turns, tools, gen = CONVERSATIONS[name]
    if turns[0][0] != "system":
        turns = EPISODE[:1] + turns
    r = ChatMLRenderer(smol_tokenizer)
    expected = official(smol_tokenizer, template("qwen2_5"), hf_messages(turns), tools, gen)
    check(r, smol_tokenizer, expected, r.render(our_messages(r, turns), tools, gen))


# -- Qwen3 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_qwen3_equals_the_official_template(qwen3_standin, name):
    turns, tools, gen = CONVERSATIONS[name]
    r = Qwen3Renderer(qwen3_standin)
    for ts in variants(turns):
        expected = official(qwen3_standin, template("qwen3"), hf_messages(ts, reasoning=True), tools, gen)
        check(r, qwen3_standin, expected, r.render(our_messages(r, ts, reasoning=True), tools, gen))


def test_qwen3_nothink_prompt_equals_the_template_with_thinking_off(qwen3_standin):
    r = Qwen3NoThinkRenderer(qwen3_standin)
    for name in ("prompt_tools", "prompt_no_tools"):  # history: test_qwen3_where_the_template_rewrites_history
        turns, tools, gen = CONVERSATIONS[name]
        expected = official(qwen3_standin, template("qwen3"), hf_messages(turns, reasoning=True), tools, gen,
                            enable_thinking=False)
        assert expected.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        check(r, qwen3_standin, expected, r.render(our_messages(r, turns, reasoning=True), tools, gen))


def test_qwen3_where_the_template_rewrites_history(qwen3_standin):
    """Our buffer keeps every sampled think block; the official template drops (a) the reasoning of
    turns before the last user message and (b) empty think blocks of earlier turns. Exactly there,
    and nowhere else, the texts differ."""
    r = Qwen3Renderer(qwen3_standin)
    turns = ONE_CALL + [("user", "And 3 + 3?", (), ""), ("assistant", "6.", (), "Add again.")]
    ours = r.render_text(r.render(our_messages(r, turns, reasoning=True), TOOLS, False))
    theirs = official(qwen3_standin, template("qwen3"), hf_messages(turns, reasoning=True), TOOLS, False)
    dropped = ["<think>\nFirst the sum.\n</think>\n\n", "<think>\nEasy.\n</think>\n\n"]
    assert all(d in ours and d not in theirs for d in dropped)
    assert ours.replace(dropped[0], "").replace(dropped[1], "") == theirs
    # (b): thinking off, an earlier turn's empty block is dropped by the template, kept by us
    nothink = Qwen3NoThinkRenderer(qwen3_standin)
    ep = [(role, c, calls, "") for role, c, calls, _ in ONE_CALL]
    # the empty block is part of every generation prompt, so the sampled text has none
    ours = nothink.render_text(nothink.render(our_messages(nothink, ep), TOOLS, False))
    theirs = official(qwen3_standin, template("qwen3"), hf_messages(ep, reasoning=True), TOOLS, False,
                      enable_thinking=False)
    empty = "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>"
    assert empty in ours and ours.replace(empty, "<|im_start|>assistant\n<tool_call>") == theirs


# -- Llama 3.1 / 3.2 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["llama3_1", "llama3_2"])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_llama3_equals_the_official_template(llama3_standin, version, name):
    turns, tools, gen = CONVERSATIONS[name]
    r = Llama3Renderer(llama3_standin)
    kwargs = {"date_string": "26 Jul 2024"}  # 3.2 would write today's date otherwise
    if name in TWO_CALLS:  # the official templates allow one call per turn
        with pytest.raises(Exception, match="only supports single tool-calls"):
            official(llama3_standin, template(version), hf_messages(turns), tools, gen, **kwargs)
        text = r.render_text(r.render(our_messages(r, turns), tools, gen))
        assert ('{"name": "mul", "parameters": {"x": 5, "y": 4}}; '
                '{"name": "add", "parameters": {"a": 2, "b": 2}}') in text
        return
    for ts in variants(turns):
        expected = official(llama3_standin, template(version), hf_messages(ts), tools, gen, **kwargs)
        # text only: the stand-in's pre-tokeniser (SmolLM2's) merges "\n\n" with the text after a header
        # differently when they are tokenised apart; Llama 3's own splits newlines off either way
        check(r, llama3_standin, expected, r.render(our_messages(r, ts), tools, gen), ids=False)


# -- Gemma 3 -------------------------------------------------------------------------------------------
def gemma_template_messages(turns, tools):
    """The conversation as Gemma 3's template can take it: the documented tool prompt in the system
    text, calls as Python-style text, each run of tool results as one user turn of tool_output blocks."""
    out, system = [], None
    for role, content, calls, _ in turns:
        if role == "system":
            system = content
        elif role == "tool":
            block = f"```tool_output\n{content}\n```"
            if out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant":
            out.append({"role": "assistant", "content": format_tool_calls(calls) if calls else content})
        else:
            out.append({"role": role, "content": content})
    if tools:
        system = (f"{system}\n\n" if system else "") + tools_text(tools)
    return ([{"role": "system", "content": system}] if system is not None else []) + out


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_gemma3_equals_the_official_template(gemma3_tokenizer, name):
    turns, tools, gen = CONVERSATIONS[name]
    r = Gemma3Renderer(gemma3_tokenizer)
    for ts in variants(turns):
        expected = official(gemma3_tokenizer, template("gemma3"), gemma_template_messages(ts, tools), None, gen)
        check(r, gemma3_tokenizer, expected, r.render(our_messages(r, ts), tools, gen))


def test_gemma3_tool_prompt_is_the_documented_one(gemma3_tokenizer):
    r = Gemma3Renderer(gemma3_tokenizer)
    text = r.render_text(r.render(our_messages(r, EPISODE[1:2]), [ADD]))
    assert text.startswith("<bos><start_of_turn>user\nYou have access to functions. If you decide to invoke any of "
                           "the function(s), you MUST put it in the format of [func_name1(params_name1=params_value1")
    assert json.dumps([ADD["function"]], indent=2) + "\n\nWhat is (2 + 3) * 4" in text


# -- gpt-oss (harmony) ---------------------------------------------------------------------------------
HARMONY_CASES = ["prompt_no_tools", "prompt_tools", "prompt_tools_no_system", "answer_no_tools",
                 "one_call_episode", "after_one_call"]


def harmony_official(tokenizer, turns, tools, gen):
    return official(tokenizer, template("gptoss"), hf_messages(turns), tools, gen,
                    strftime_now=lambda fmt: HarmonyRenderer.date_string)


@pytest.mark.parametrize("name", HARMONY_CASES)
def test_harmony_equals_the_official_template(harmony_standin, name):
    turns, tools, gen = CONVERSATIONS[name]
    r = HarmonyRenderer(harmony_standin)
    for ts in variants(turns):
        # text only: a stand-in tokenizer (SmolLM2's with the harmony tokens added)
        check(r, harmony_standin, harmony_official(harmony_standin, ts, tools, gen),
              r.render(our_messages(r, ts), tools, gen), ids=False)


def test_harmony_two_calls_in_a_turn_cannot_be_written(harmony_standin):
    r = HarmonyRenderer(harmony_standin)
    with pytest.raises(ValueError, match="one tool call per turn"):
        r.format_reply("", (call("add", a=1, b=2), call("add", a=3, b=4)))


def test_harmony_where_the_template_rewrites_history(harmony_standin):
    """We keep the sampled analysis of a tool-call turn; the template drops it once a final answer follows."""
    r = HarmonyRenderer(harmony_standin)
    turns = [(role, "Let me add." if calls else c, calls, t) for role, c, calls, t in ONE_CALL]
    ours = r.render_text(r.render(our_messages(r, turns), TOOLS, False))
    theirs = harmony_official(harmony_standin, turns, TOOLS, False)
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Let me add.<|end|>"
    assert analysis in ours and analysis not in theirs and ours.replace(analysis, "") == theirs
