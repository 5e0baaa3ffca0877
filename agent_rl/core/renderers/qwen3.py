"""Qwen3: ChatML with `<think>` reasoning blocks and Hermes tool calls.

Owns: `Qwen3Renderer` (thinking on: the model opens its turn with `<think>`) and
`Qwen3NoThinkRenderer` (`enable_thinking=False`: the generation prompt carries an empty
`<think>\\n\\n</think>\\n\\n` block), both matching Qwen3's official chat template for the prompt and
for tool episodes (tests/test_renderers.py).
Does not own: ChatML itself (`core.renderers.chatml`), the `<tool_call>` JSON parser (`core.renderers.toolcalls`).

Differences from Qwen2.5: no default system prompt (no system turn at all without a system message
or tools); with tools, the system turn is "{system}\\n\\n# Tools..."; a reply is
"<think>\\n{reasoning}\\n</think>\\n\\n{answer}{tool calls}".

Earlier turns' reasoning, the choice made here: the official template re-renders history. It keeps
the reasoning of every assistant turn after the last user message (a tool-calling chain, i.e. all of
an agent episode whose environment answers with tool messages) and drops it from turns before it, and
it drops an *empty* think block from any turn but the last. This renderer never rewrites history:
the token buffer holds exactly what was sampled, reasoning included, in one append-only sequence.
So for a tool episode with non-empty reasoning the buffer *is* the official render; after an
environment adds a user message, or with thinking off (whose empty think blocks the template later
drops), the official template would show earlier turns without their think blocks, and the model is
trained on what it actually saw when sampling instead. tests/test_renderers.py pins both cases.

Tool calls are read only after `</think>`: a `<tool_call>` written while reasoning is thinking, not
an attempt (a turn whose `<think>` never closes makes no call); `calls_in_reasoning` counts them, for the
evaluation's violation counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent_rl.core.renderers.chatml import (
    TOOLS_POSTAMBLE,
    TOOLS_PREAMBLE,
    ChatMLRenderer,
    format_tool_call,
)
from agent_rl.core.renderers.toolcalls import parse_tool_calls
from agent_rl.core.types import ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def answer_part(text: str) -> str:
    """The text after the reasoning block ("" while the block is still open)."""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1]
    return "" if THINK_OPEN in text else text


def reasoning_part(text: str) -> str:
    """The text before the reasoning block closes (all of it while the block is still open; "" without one)."""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[0]
    return text if THINK_OPEN in text else ""


def format_thinking(reasoning: str, answer: str = "") -> str:
    """A reply's text with its reasoning, as Qwen3 writes it."""
    return f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n{answer.lstrip(chr(10))}"


class Qwen3Renderer(ChatMLRenderer):
    """Qwen3 with thinking on (the official template's default)."""

    name = "qwen3"

    def system_text(self, system: str | None, tools: Sequence[dict[str, Any]]) -> str | None:
        if not tools:
            return system
        schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        head = f"{system}\n\n" if system is not None else ""
        return head + TOOLS_PREAMBLE.lstrip("\n") + schemas + TOOLS_POSTAMBLE

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        return super().parse_tool_calls(answer_part(text))  # bare calls too, when switched on

    def calls_in_reasoning(self, text: str) -> int:
        return len(parse_tool_calls(reasoning_part(text)))

    def format_reply(self, content: str, tool_calls: Sequence[ToolCall] = ()) -> str:
        """`content` as given (it may open with a think block: `format_thinking`), then the calls,
        on a new line when the answer part is not empty (as the template writes them)."""
        if not tool_calls:
            return content
        calls = "\n".join(format_tool_call(c.name, c.arguments) for c in tool_calls)
        return content + ("\n" if answer_part(content).lstrip("\n") else "") + calls


class Qwen3NoThinkRenderer(Qwen3Renderer):
    """Qwen3 with `enable_thinking=False`: every generation prompt ends with an empty think block."""

    name = "qwen3_nothink"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.generation_prompt = [self.im_start, *self.encode(f"assistant\n{format_thinking('')}")]
