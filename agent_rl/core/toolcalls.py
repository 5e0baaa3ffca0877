"""The Hermes/Qwen tool-call syntax: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

Owns: finding every such block in an assistant turn's text and turning each malformed one into a
`ToolCall` whose `error` the model can read. Shared by the renderers of families that write calls
this way (`core.chatml`, ...).
Does not own: checking names and arguments against the environment's tools (`envs.base.ToolEnv`),
or the token ids (the sampled ids are never rebuilt from the parsed calls).
"""

from __future__ import annotations

import json
import re

from agent_rl.core.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def short(text: str, n: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def bad_call(index: int, error: str, name: str = "") -> ToolCall:
    """An attempted call that could not be read; the model gets `error` back."""
    return ToolCall(name=name, arguments={}, id=f"call_{index}", error=error)


def call_from_json(body: str, index: int, args_key: str = "arguments") -> ToolCall:
    """One call written as a JSON object {"name": ..., args_key: {...}}; anything else is a `bad_call`."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return bad_call(index, f"tool call {index}: malformed JSON ({e.msg} at char {e.pos}) in {short(body)!r}")
    if not isinstance(obj, dict):
        return bad_call(index, f"tool call {index}: expected a JSON object with \"name\" and \"{args_key}\", "
                               f"got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return bad_call(index, f"tool call {index}: missing \"name\" (a string naming the tool)")
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return bad_call(index, f"tool call {index} ({name}): \"{args_key}\" is a string that is not JSON ({e.msg})",
                            name)
    if not isinstance(args, dict):
        return bad_call(index, f"tool call {index} ({name}): \"{args_key}\" must be a JSON object, "
                               f"got {type(args).__name__}", name)
    extra = sorted(set(obj) - {"name", args_key})
    if extra:
        return bad_call(index, f"tool call {index} ({name}): unexpected keys {extra}; "
                               f"use {{\"name\": ..., \"{args_key}\": {{...}}}}", name)
    return ToolCall(name=name, arguments=args, id=f"call_{index}")


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every attempted tool call in `text`, in order; an empty list means the model did not try."""
    out: list[ToolCall] = []
    end = 0
    for i, m in enumerate(_BLOCK.finditer(text), start=1):
        # an opening tag inside the block means an earlier call was never closed
        body = m.group(1)
        if OPEN in body:
            out.append(bad_call(len(out) + 1, f"tool call {i}: unclosed {OPEN} tag before another {OPEN}"))
            body = body[body.rfind(OPEN) + len(OPEN):]
        out.append(call_from_json(body.strip(), len(out) + 1))
        end = m.end()
    rest = text[end:]
    if OPEN in rest:
        tail = rest[rest.find(OPEN) + len(OPEN):]
        out.append(bad_call(len(out) + 1, f"tool call {len(out) + 1}: unclosed {OPEN} tag (no {CLOSE} after "
                                          f"{short(tail, 40)!r})"))
    elif CLOSE in rest:
        out.append(bad_call(len(out) + 1, f"tool call {len(out) + 1}: {CLOSE} without a matching {OPEN}"))
    return out
