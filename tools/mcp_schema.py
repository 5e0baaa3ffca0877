"""MCP's tool JSON as agent-rl's: listed schemas as parameters, argument checks, results as `ToolResult`.

Owns: pure translations, no I/O and no SDK import: `clean_schema` (a listed `inputSchema` as the
`parameters` of an OpenAI-style function schema), `ArgumentCheck` (why arguments do not fit that
schema, in one line), `to_tool_result` (a `CallToolResult` as the text the model reads), `error`.
Does not own: connections and calls (`tools.mcp`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from agent_rl.tools.base import ToolResult

_SDK_PREFIX = re.compile(r"^Error executing tool [^:\s]+: ")  # what MCPServer puts before a ToolError's text


def clean_schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    """The listed input schema without the titles the SDK generates ("A", "addArguments")."""
    params = {k: v for k, v in (schema or {"type": "object", "properties": {}}).items() if k != "title"}
    props = params.get("properties")
    if isinstance(props, dict):
        params["properties"] = {k: {kk: vv for kk, vv in v.items() if kk != "title"} if isinstance(v, dict) else v
                                for k, v in props.items()}
    return params


class ArgumentCheck:
    """Checks a call's arguments against a tool's JSON schema before the call goes out.

    Unknown argument names are mistakes unless the schema allows extra properties; a schema the
    validator itself rejects is left to the server to check.
    """

    def __init__(self, tool: str, schema: dict[str, Any]):
        import jsonschema

        self.tool, self.schema = tool, schema
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            cls.check_schema(schema)
            self._validator: Any = cls(schema)
        except jsonschema.SchemaError:
            self._validator = None

    def problem(self, arguments: Any) -> str | None:
        """Why `arguments` do not fit (one line, at most five problems named), or None."""
        if not isinstance(arguments, dict):
            return f"arguments of {self.tool} must be a JSON object, got {type(arguments).__name__}"
        problems = []
        known = self.schema.get("properties")
        if isinstance(known, dict) and self.schema.get("additionalProperties") in (None, False):
            problems += [f"unknown argument {k!r}" for k in arguments if k not in known]
        if self._validator is not None:
            for err in sorted(self._validator.iter_errors(arguments), key=lambda e: [str(p) for p in e.path]):
                where = ".".join(str(p) for p in err.path)
                problems.append(f"{where}: {err.message}" if where else err.message)
        return f"invalid arguments for {self.tool}: {'; '.join(problems[:5])}" if problems else None


def to_tool_result(name: str, result: Any) -> ToolResult:
    """A `CallToolResult` as a `ToolResult`: its text blocks; `isError` makes it an error message."""
    parts = []
    for block in result.content or []:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:  # images, audio, resources: the model reads text only
            parts.append(f"[{getattr(block, 'mime_type', None) or getattr(block, 'type', 'content')} content omitted]")
    text = _SDK_PREFIX.sub("", "\n".join(parts), count=1)
    if not parts and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False, default=str)
    if result.is_error:
        return error(text or f"{name} failed without a message", f"{name} failed: {first_line(text)}")
    return ToolResult(ok=True, content=text)


def error(message: str, short: str | None = None) -> ToolResult:
    """An error tool message: the model reads "Error: <message>"; `error` is one line for the metrics."""
    return ToolResult(ok=False, content=f"Error: {message}", error=short or first_line(message))


def first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:300]


def one_line(e: BaseException) -> str:
    """The innermost error of `e` (task groups wrap errors in groups) as `Type: message` on one line."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    text = first_line(str(e))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
