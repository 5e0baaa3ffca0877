"""Gemma 3: `<start_of_turn>`/`<end_of_turn>` turns and Google's documented prompt-based tool calls.

Owns: `Gemma3Renderer`, token for token the official Gemma 3 chat template (tests/test_renderers.py),
with tools as Google's function-calling guide for Gemma describes them (Gemma has no tool tokens
and no tool role): the function definitions as JSON after an instruction in the system text (which
the template puts at the head of the first user turn), calls written as a Python-style list
`[add(a=2, b=3), mul(a=5, b=4)]` alone in a reply, results in the next user turn as
```tool_output``` blocks (one per call, consecutive tool messages sharing one user turn, since the
template requires user and model turns to alternate). Also the parser of that call syntax.
Does not own: checking names and arguments against the environment's tools (`envs.base.ToolEnv`).

Format:

    <bos><start_of_turn>user\\n{system}\\n\\n{tool instruction + schemas}\\n\\n{question}<end_of_turn>\\n
    <start_of_turn>model\\n[add(a=2, b=3)]<end_of_turn>\\n
    <start_of_turn>user\\n```tool_output\\n5\\n```<end_of_turn>\\n
    <start_of_turn>model\\n

Message text is trimmed, as the template does; sampled replies are kept as they are. A reply is a
call when it starts with `[name(` (optionally inside a ```tool_code fence); arguments must be
keywords with Python literal values.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.toolcalls import bad_call, short
from agent_rl.core.types import Message, ToolCall

TOOLS_PROMPT = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the "
    "format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n\n"
    "You SHOULD NOT include any other text in the response if you call a function\n"
)
_CALL_START = re.compile(r"^\[\s*[A-Za-z_][\w.]*\s*\(")
_FENCE = re.compile(r"^```tool_code\s*\n(.*?)\n?```$", re.DOTALL)


def py_literal(value: Any) -> str:
    """A JSON value written as a Python literal (True, None, "text", [..], {..})."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {py_literal(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    return repr(value)


def format_tool_calls(calls: Sequence[ToolCall]) -> str:
    return "[" + ", ".join(f"{c.name}(" + ", ".join(f"{k}={py_literal(v)}" for k, v in c.arguments.items()) + ")"
                           for c in calls) + "]"


def _one_call(node: ast.expr, index: int) -> ToolCall:
    if not isinstance(node, ast.Call):
        return bad_call(index, f"tool call {index}: expected name(arg=value, ...), "
                               f"got {short(ast.unparse(node), 40)!r}")
    name = ast.unparse(node.func)
    if node.args:
        return bad_call(index, f"tool call {index} ({name}): arguments must be keywords (name=value)", name)
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return bad_call(index, f"tool call {index} ({name}): **kwargs is not allowed", name)
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError):
            return bad_call(index, f"tool call {index} ({name}): argument {kw.arg} is not a literal value "
                                   f"({short(ast.unparse(kw.value), 40)!r})", name)
    return ToolCall(name=name, arguments=args, id=f"call_{index}")


def parse_python_calls(text: str) -> list[ToolCall]:
    """Every call of a reply written as `[f(a=1), g(b="x")]`; an empty list when it is not a call."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1).strip() if fenced else body
    if not _CALL_START.match(body):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as e:
        return [bad_call(1, f"tool call 1: not a Python list of calls ({e.msg}) in {short(body)!r}")]
    if not isinstance(tree, ast.List):
        return [bad_call(1, f"tool call 1: expected one list [f(a=1), ...], got {short(body)!r}")]
    return [_one_call(node, i) for i, node in enumerate(tree.elts, start=1)]


def tools_text(tools: Sequence[dict[str, Any]]) -> str:
    functions = [t.get("function", t) for t in tools]
    return TOOLS_PROMPT + json.dumps(functions, indent=2, ensure_ascii=False)


class Gemma3Renderer(Renderer):
    """Gemma 3 instruction-tuned models (and the base model's tokenizer, which shares the tokens)."""

    name = "gemma3"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.bos = self.special_id("<bos>")
        self.start = self.special_id("<start_of_turn>")
        self.end = self.special_id("<end_of_turn>")
        self.eos = self.special_id("<eos>")
        self.newline = self.encode("\n")
        self.generation_prompt = self.pieces(self.start, "model\n")

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.end, self.eos]

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        return parse_python_calls(text)

    def format_reply(self, content: str, tool_calls: Sequence[ToolCall] = ()) -> str:
        """Calls alone when there are any ("SHOULD NOT include any other text")."""
        return format_tool_calls(tool_calls) if tool_calls else content

    def _turn(self, role: str, text: str) -> list[int]:
        return self.pieces(self.start, f"{role}\n{text}", self.end, "\n")

    def _render_messages(self, messages: Sequence[Message], prefix: str = "") -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(messages):
            m = messages[i]
            if m.role == "tool":
                blocks = []
                while i < len(messages) and messages[i].role == "tool":
                    blocks.append(f"```tool_output\n{messages[i].content}\n```")
                    i += 1
                ids += self._turn("user", "\n".join(blocks).strip())
                continue
            if m.role == "assistant":
                ids += self.generation_prompt + self.encode(m.content) + [self.end] + self.newline
            elif m.role in ("user", "system"):  # a later system message: the template has none, say "user"
                ids += self._turn("user", prefix + m.content.strip())
                prefix = ""
            else:
                raise ValueError(f"unknown message role {m.role!r}")
            i += 1
        return ids

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (),
               add_generation_prompt: bool = True) -> list[int]:
        system = None
        if messages and messages[0].role == "system":
            system, messages = messages[0].content, messages[1:]
        if tools:
            system = (f"{system}\n\n" if system else "") + tools_text(tools)
        prefix = f"{system}\n\n" if system is not None else ""
        ids = [self.bos, *self._render_messages(messages, prefix)]
        return ids + self.generation_prompt if add_generation_prompt else ids

    def continuation(self, messages: Sequence[Message], after_stop: bool = True) -> list[int]:
        if any(m.role in ("assistant", "system") for m in messages):
            raise ValueError("an environment may only add user or tool messages between turns")
        head = self.newline if after_stop else [self.end, *self.newline]
        return head + self._render_messages(messages) + self.generation_prompt
