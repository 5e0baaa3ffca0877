"""Llama 3.1 / 3.2: header-delimited turns, JSON tool calls, tool results in `ipython` turns.

Owns: `Llama3Renderer`, token for token the official Llama 3.1 and 3.2 chat templates with custom
tools (tests/test_renderers.py), and the parser of its tool-call syntax.
Does not own: the `{"name", "arguments"}` JSON checks it shares (`core.renderers.toolcalls.call_from_json`),
checking names and arguments against the environment's tools (`envs.base.ToolEnv`).

Format (the templates' defaults: tools in the first user message, a fixed date):

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n
    Environment: ipython\\n               (only with tools)
    Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, ... {schemas}{question}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "add", "parameters": {"a": 2}}<|eot_id|>
    <|start_header_id|>ipython<|end_header_id|>\\n\\n{result}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n

Tool calls: a reply that starts with `{` (or `<|python_tag|>`) is a call, `{"name": ...,
"parameters": {...}}` (`"arguments"` is accepted too). The official templates allow one call per
turn (two raise an exception there); several calls are written as vLLM's llama3_json parser reads
them, JSON objects separated by "; ", and every one of them is parsed. Message text is trimmed, as
the templates do; sampled replies are kept as they are. Tool results are written JSON-encoded
(`"5"`, quotes included), exactly as the official templates write a string result.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.toolcalls import bad_call, call_from_json, short
from agent_rl.core.types import Message, ToolCall

DATE = "26 Jul 2024"  # the 3.1 template's fixed date; 3.2 uses today's unless date_string is given
TOOLS_INTRO = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)
PYTHON_TAG = "<|python_tag|>"


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def parse_json_calls(text: str) -> list[ToolCall]:
    """Every call of a Llama reply: nothing unless it starts with `{` or the python tag."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return []
    decoder, pos = json.JSONDecoder(), 0
    out: list[ToolCall] = []
    while pos < len(body):
        index = len(out) + 1
        try:
            _, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            out.append(call_from_json(body[pos:], index, args_key="parameters"))  # says what is malformed
            return out
        obj_text = body[pos:end]
        obj = json.loads(obj_text)
        key = "arguments" if isinstance(obj, dict) and "arguments" in obj and "parameters" not in obj else "parameters"
        out.append(call_from_json(obj_text, index, args_key=key))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            out.append(bad_call(len(out) + 1, f"tool call {len(out) + 1}: text after a call is not another "
                                              f"call: {short(body[pos:], 40)!r}"))
            return out
    return out


class Llama3Renderer(Renderer):
    """Llama 3.1 / 3.2 instruct models with custom (JSON) tools."""

    name = "llama3"
    date_string = DATE

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.bos = self.special_id("<|begin_of_text|>")
        self.start = self.special_id("<|start_header_id|>")
        self.end_header = self.special_id("<|end_header_id|>")
        self.eot = self.special_id("<|eot_id|>")
        self.eom = self.special_id("<|eom_id|>")
        self.generation_prompt = self._header("assistant")

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.eot, self.eom]

    def _header(self, role: str) -> list[int]:
        return self.pieces(self.start, role, self.end_header, "\n\n")

    def _turn(self, role: str, text: str) -> list[int]:
        return self.pieces(self.start, role, self.end_header, "\n\n" + text, self.eot)

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        return parse_json_calls(text)

    def format_reply(self, content: str, tool_calls: Sequence[ToolCall] = ()) -> str:
        """Calls alone when there are any (the format has no room for text beside a call)."""
        if tool_calls:
            return "; ".join(format_tool_call(c.name, c.arguments) for c in tool_calls)
        return content

    def _render_messages(self, messages: Sequence[Message]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            if m.role == "tool":  # the templates write a string result JSON-encoded (a string "is iterable")
                ids += self._turn("ipython", json.dumps(m.content, ensure_ascii=False))
            elif m.role == "assistant":
                ids += self.generation_prompt + self.encode(m.content) + [self.eot]
            elif m.role in ("user", "system"):
                ids += self._turn(m.role, m.content.strip())
            else:
                raise ValueError(f"unknown message role {m.role!r}")
        return ids

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (),
               add_generation_prompt: bool = True) -> list[int]:
        system = ""
        if messages and messages[0].role == "system":
            system, messages = messages[0].content.strip(), messages[1:]
        env = "Environment: ipython\n" if tools else ""
        head = f"{env}Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n{system}"
        ids = [self.bos, *self._turn("system", head)]
        if tools:
            if not messages or messages[0].role != "user":
                raise ValueError("llama3: tools go into the first user message, and there is none")
            schemas = "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools)
            ids += self._turn("user", TOOLS_INTRO + schemas + messages[0].content.strip())
            messages = messages[1:]
        ids += self._render_messages(messages)
        return ids + self.generation_prompt if add_generation_prompt else ids

    def continuation(self, messages: Sequence[Message], after_stop: bool = True) -> list[int]:
        if any(m.role in ("assistant", "system") for m in messages):
            raise ValueError("an environment may only add user or tool messages between turns")
        head = [] if after_stop else [self.eot]
        return head + self._render_messages(messages) + self.generation_prompt
