"""Parsing tool calls out of the text the policy sampled.

Owns: finding every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block in an assistant
turn and turning each malformed one into an error message the model can read.
Does not own: checking names and arguments against the environment's tools (`envs.base.ToolEnv`),
or the token ids (the sampled ids are never rebuilt from the parsed calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from agent_rl.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    """One attempted call, in order of appearance: a call, or the reason it is not one."""

    call: ToolCall | None
    error: str | None


def _short(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _parse_block(body: str, index: int) -> ParsedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ParsedCall(None, f"tool call {index}: malformed JSON ({e.msg} at char {e.pos}) in {_short(body)!r}")
    if not isinstance(obj, dict):
        return ParsedCall(None, f"tool call {index}: expected a JSON object with \"name\" and \"arguments\", "
                                f"got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(None, f"tool call {index}: missing \"name\" (a string naming the tool)")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ParsedCall(None, f"tool call {index} ({name}): \"arguments\" is a string that is not JSON ({e.msg})")
    if not isinstance(args, dict):
        return ParsedCall(None, f"tool call {index} ({name}): \"arguments\" must be a JSON object, "
                                f"got {type(args).__name__}")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return ParsedCall(None, f"tool call {index} ({name}): unexpected keys {extra}; "
                                f"use {{\"name\": ..., \"arguments\": {{...}}}}")
    return ParsedCall(ToolCall(name=name, arguments=args, id=f"call_{index}"), None)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every attempted tool call in `text`, in order; an empty list means the model did not try."""
    out: list[ParsedCall] = []
    end = 0
    for i, m in enumerate(_BLOCK.finditer(text), start=1):
        # an opening tag inside the block means an earlier call was never closed
        body = m.group(1)
        if OPEN in body:
            out.append(ParsedCall(None, f"tool call {i}: unclosed {OPEN} tag before another {OPEN}"))
            body = body[body.rfind(OPEN) + len(OPEN):]
        out.append(_parse_block(body.strip(), len(out) + 1))
        end = m.end()
    rest = text[end:]
    if OPEN in rest:
        tail = rest[rest.find(OPEN) + len(OPEN):]
        out.append(ParsedCall(None, f"tool call {len(out) + 1}: unclosed {OPEN} tag (no {CLOSE} after "
                                    f"{_short(tail, 40)!r})"))
    elif CLOSE in rest:
        out.append(ParsedCall(None, f"tool call {len(out) + 1}: {CLOSE} without a matching {OPEN}"))
    return out
