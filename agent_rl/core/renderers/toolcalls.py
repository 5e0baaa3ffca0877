"""The Hermes/Qwen tool-call syntax: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

Owns: finding every such block in an assistant turn's text and turning each malformed one into a
`ToolCall` whose `error` the model can read; and `parse_bare_calls`, the lenient reading of the same
calls written without their tags. Shared by the renderers of families that write calls this way
(`core.renderers.chatml`, ...).
Does not own: checking names and arguments against the environment's tools (`envs.base.ToolEnv`),
whether a renderer reads bare calls (its `bare_calls` switch, `model.bare_tool_calls`), or the token
ids (the sampled ids are never rebuilt from the parsed calls).

Bare calls. Small instruct models (Qwen2.5-Coder-0.5B-Instruct among them) often answer a tool prompt
with `{"name": "calculator", "arguments": {...}}` and no `<tool_call>` tags. Read leniently, a reply
that is nothing but such objects (whitespace, commas and ```json fences aside) is
that many calls, parsed exactly as tagged ones would be: an unknown tool or bad arguments get the
same error message back. Anything else stays text, so a final answer is never mistaken for a call:
prose around the JSON, JSON that does not parse, an object without a string "name" and an
"arguments" key. Only the parse changes: the sampled tokens stay as they are.

Parallel calls. A reply that means several calls at once is read as those calls in each of these forms:
several `<tool_call>` blocks; one block holding a JSON list of call objects, or several objects one after
another (whitespace or a comma between); and, read bare, a JSON list of call objects, or a ```json fence
holding a list or several objects. Each call gets its own index, as if written in blocks of its own.
(BFCL's own Qwen handler reads only one object per block and drops a block holding a list.)
"""

from __future__ import annotations

import json
import re
from typing import Any

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
    return call_from_object(obj, index, args_key)


def call_from_object(obj: Any, index: int, args_key: str = "arguments") -> ToolCall:
    """One call as its decoded JSON: {"name": ..., args_key: {...}}; anything else is a `bad_call`."""
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


def json_values(text: str) -> list[Any] | None:
    """The JSON values `text` is made of, one after another (whitespace, or one comma, between), or None when it
    is anything else."""
    decoder, out, pos, text = json.JSONDecoder(), [], 0, text.strip()
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        out.append(value)
        pos = _skip_separator(text, pos)
    return out or None


def _skip_separator(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if pos < len(text) and text[pos] == ",":
        pos += 1
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return pos


def _flat_objects(values: list[Any]) -> list[dict[str, Any]] | None:
    """The objects of `values`, a list's elements in its place (a parallel reply's list of calls); None unless
    every one is a JSON object."""
    objs = [o for v in values for o in (v if isinstance(v, list) else [v])]
    return objs if objs and all(isinstance(o, dict) for o in objs) else None


def calls_in_block(body: str, index: int) -> list[ToolCall]:
    """The calls of one `<tool_call>` block: one object, or (parallel calls written in one block, module doc) a
    list of objects or several objects one after another; a block that is none of these is one `bad_call`."""
    values = json_values(body)
    several = values is not None and (len(values) > 1 or isinstance(values[0], list))
    objs = _flat_objects(values) if several and values is not None else None
    if objs is None:
        return [call_from_json(body, index)]
    return [call_from_object(obj, index + k) for k, obj in enumerate(objs)]


_FENCED = re.compile(r"\A```(?:json)?[ \t]*\n(.*?)\n?```\Z", re.DOTALL)


def _is_call(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and "arguments" in obj


def _bare_objects(text: str) -> list[dict[str, Any]] | None:
    """The call objects of a reply made only of them: objects, lists of objects, each maybe in a ```json fence;
    None when the reply is anything else."""
    out: list[dict[str, Any]] = []
    pos, text = 0, text.strip()
    while pos < len(text):
        if text.startswith("```", pos):  # a fence: calls inside, nothing else
            end = text.find("```", pos + 3)
            fenced = _FENCED.match(text[pos:end + 3]) if end > 0 else None
            inner = _bare_objects(fenced.group(1)) if fenced else None
            if inner is None:
                return None
            out += inner
            pos = end + 3
        else:
            try:
                value, pos = json.JSONDecoder().raw_decode(text, pos)
            except json.JSONDecodeError:
                return None
            objs = value if isinstance(value, list) and value else [value]
            if not all(_is_call(o) for o in objs):
                return None
            out += objs
        pos = _skip_separator(text, pos)
    return out or None


def parse_bare_calls(text: str) -> list[ToolCall]:
    """The calls of a reply written as bare JSON objects without `<tool_call>` tags (module doc); [] when
    the reply is anything else."""
    return [call_from_object(obj, i) for i, obj in enumerate(_bare_objects(text) or (), start=1)]


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
        out.extend(calls_in_block(body.strip(), len(out) + 1))
        end = m.end()
    rest = text[end:]
    if OPEN in rest:
        tail = rest[rest.find(OPEN) + len(OPEN):]
        out.append(bad_call(len(out) + 1, f"tool call {len(out) + 1}: unclosed {OPEN} tag (no {CLOSE} after "
                                          f"{short(tail, 40)!r})"))
    elif CLOSE in rest:
        out.append(bad_call(len(out) + 1, f"tool call {len(out) + 1}: {CLOSE} without a matching {OPEN}"))
    return out
