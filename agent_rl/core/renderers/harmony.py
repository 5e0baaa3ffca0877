"""gpt-oss (OpenAI's harmony format): channels, and tool calls addressed to `functions.NAME`.

Owns: `HarmonyRenderer`, token for token the official gpt-oss chat template for prompts and for
tool episodes written canonically (tests/test_renderers.py), and the parser of its tool calls.
Does not own: the JSON checks it shares (`core.renderers.toolcalls.call_from_json`), checking names and
arguments against the environment's tools (`envs.base.ToolEnv`).

Format:

    <|start|>system<|message|>{identity, knowledge cutoff, date, reasoning effort, channels}<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system}\\n\\n# Tools\\n\\n## functions ...<|end|>
    <|start|>user<|message|>{question}<|end|>
    <|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>
    <|start|>functions.add to=assistant<|channel|>commentary<|message|>"5"<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 9.<|return|>

One sampled turn runs from the generation prompt `<|start|>assistant` to `<|call|>` (a tool call)
or `<|return|>` (the answer), and may hold several messages (`<|channel|>analysis<|message|>...<|end|>
<|start|>assistant...`). A call is a message whose header (the text before `<|message|>`) names
`to=functions.NAME`, in either order harmony allows; its body is the JSON arguments. Text inside a
message body is never a call, so a call written while reasoning is not an attempt. One call per
turn: the model stops at `<|call|>`.

History, the choice made here: the official template re-renders earlier turns, dropping the
analysis messages of tool-call turns once a final answer follows and turning a final `<|return|>`
into `<|end|>`; this renderer keeps what was sampled (one append-only buffer), so the two agree for
episodes written canonically without analysis, and `test_harmony_where_the_template_rewrites_history`
pins where they differ.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.toolcalls import bad_call, call_from_json, short
from agent_rl.core.types import Message, ToolCall

IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
DATE = "2025-08-05"  # the template writes today's date; a fixed one keeps prompts reproducible
_TO = re.compile(r"to=functions\.([^\s<]+)")
_TS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean"}


def ts_type(spec: dict[str, Any]) -> str:
    """A JSON-schema type as the template's TypeScript (the common cases; anything else is any)."""
    kind = spec.get("type")
    if kind == "string" and spec.get("enum"):
        return '"' + '" | "'.join(spec["enum"]) + '"'
    if kind in _TS:
        return _TS[kind] + (" | null" if kind == "string" and spec.get("nullable") else "")
    if kind == "array":
        item = spec.get("items") or {}
        return (_TS[item["type"]] + "[]") if item.get("type") in _TS else "any[]"
    return "object" if kind == "object" and not spec.get("properties") else "any"


def tools_namespace(tools: Sequence[dict[str, Any]]) -> str:
    out = "## functions\n\nnamespace functions {\n\n"
    for tool in tools:
        fn = tool.get("function", tool)
        out += f"// {fn.get('description', '')}\ntype {fn['name']} = "
        params = fn.get("parameters") or {}
        if not params.get("properties"):
            out += "() => any;\n\n"
            continue
        out += "(_: {\n"
        required = params.get("required") or []
        for name, spec in params["properties"].items():
            out += f"// {spec['description']}\n" if spec.get("description") else ""
            out += name + ("" if name in required else "?") + ": " + ts_type(spec)
            if "default" in spec:
                out += ", // default: " + (str(spec["default"]) if spec.get("enum") else json.dumps(spec["default"]))
            out += ",\n"
        out += "}) => any;\n\n"
    return out + "} // namespace functions"


def parse_harmony_calls(text: str) -> list[ToolCall]:
    """The call of a sampled turn (at most one: the model stops at <|call|>)."""
    out: list[ToolCall] = []
    for message in text.split("<|start|>"):
        header, sep, body = message.partition("<|message|>")
        found = _TO.search(header) if sep else None
        if not found:
            continue
        out.append(_call(found.group(1), body.split("<|end|>", 1)[0].strip(), len(out) + 1))
    return out


def _call(name: str, body: str, index: int) -> ToolCall:
    try:
        args = json.loads(body)
    except json.JSONDecodeError as e:
        return bad_call(index, f"tool call {index} ({name}): malformed JSON ({e.msg} at char {e.pos}) "
                               f"in {short(body)!r}", name)
    return call_from_json(json.dumps({"name": name, "arguments": args}), index)


class HarmonyRenderer(Renderer):
    """gpt-oss models (reasoning effort medium, the template's default)."""

    name = "harmony"
    date_string = DATE
    reasoning_effort = "medium"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.start, self.end, self.message = (self.special_id(t) for t in ("<|start|>", "<|end|>", "<|message|>"))
        self.channel, self.call, self.ret = (self.special_id(t) for t in ("<|channel|>", "<|call|>", "<|return|>"))
        self.generation_prompt = self.pieces(self.start, "assistant")

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.call, self.ret]

    def encode_reply(self, text: str) -> list[int]:
        """A reply's text keeps its channel markup as tokens (user and tool text never does: `encode`)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        return parse_harmony_calls(text)

    def format_reply(self, content: str, tool_calls: Sequence[ToolCall] = ()) -> str:
        """The text after `<|start|>assistant`, as the official template writes an assistant message."""
        if len(tool_calls) > 1:
            raise ValueError("harmony: one tool call per turn (the model stops at <|call|>)")
        if tool_calls:
            c = tool_calls[0]
            head = f"<|channel|>analysis<|message|>{content}<|end|><|start|>assistant" if content else ""
            return f"{head} to=functions.{c.name}<|channel|>commentary json<|message|>{json.dumps(c.arguments)}"
        return f"<|channel|>final<|message|>{content}"

    def reply_ids(self, reply: Message) -> list[int]:
        """A hand-written reply: a call ends with <|call|>, an answer with <|return|>."""
        return [*self.encode_reply(self.format_reply(reply.content, reply.tool_calls)),
                self.call if reply.tool_calls else self.ret]

    def _msg(self, header: str, text: str) -> list[int]:
        return [self.start, *self.encode(header), self.message, *self.encode(text), self.end]

    def system_text(self, tools: Sequence[dict[str, Any]]) -> str:
        text = (f"{IDENTITY}\nKnowledge cutoff: 2024-06\nCurrent date: {self.date_string}\n\n"
                f"Reasoning: {self.reasoning_effort}\n\n# Valid channels: analysis, commentary, final. "
                "Channel must be included for every message.")
        return text + ("\nCalls to these tools must go to the commentary channel: 'functions'." if tools else "")

    def _render_messages(self, messages: Sequence[Message], last_call: str | None = None) -> list[int]:
        ids: list[int] = []
        for m in messages:
            if m.role == "tool":
                name = m.name or last_call or "tool"
                ids += [self.start, *self.encode(f"functions.{name} to=assistant"), self.channel,
                        *self.encode("commentary"), self.message, *self.encode(json.dumps(m.content)), self.end]
            elif m.role == "assistant":
                stop = self.call if m.tool_calls else self.ret
                ids += self.generation_prompt + self.encode_reply(m.content) + [stop]
                last_call = m.tool_calls[0].name if m.tool_calls else None
            elif m.role in ("user", "system"):
                ids += self._msg(m.role, m.content)
            else:
                raise ValueError(f"unknown message role {m.role!r}")
        return ids

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (),
               add_generation_prompt: bool = True) -> list[int]:
        system = ""
        if messages and messages[0].role == "system":
            system, messages = messages[0].content, messages[1:]
        ids = self._msg("system", self.system_text(tools))
        if system or tools:
            text = (f"# Instructions\n\n{system}\n\n" if system else "") + \
                   (f"# Tools\n\n{tools_namespace(tools)}" if tools else "")
            ids += self._msg("developer", text)
        ids += self._render_messages(messages)
        return ids + self.generation_prompt if add_generation_prompt else ids

    def continuation(self, messages: Sequence[Message], after_stop: bool = True) -> list[int]:
        if any(m.role in ("assistant", "system") for m in messages):
            raise ValueError("an environment may only add user or tool messages between turns")
        head = [] if after_stop else [self.end]
        return head + self._render_messages(messages) + self.generation_prompt
