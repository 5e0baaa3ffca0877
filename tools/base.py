"""Tools are typed Python functions; this module turns one into a schema and a safe call.

Owns: `Tool` (name, description, JSON schema from the signature and docstring through pydantic,
argument validation, calling sync or async functions with a deadline that holds), `tool_options`
(a function's own defaults: deadline, isolation), `ToolError`, and `ToolLike`, the interface every
tool has (`Tool`, and MCP servers' tools in `tools.mcp`).
Does not own: parsing tool calls out of model text (`agent_rl.core.renderers.toolcalls`), rendering schemas
into a prompt (`agent_rl.core.renderers.chatml`), or the threads and worker processes sync tools run in
(`tools.runners`, `tools.worker_pool`).

A tool function returns a string (what the model reads) or anything JSON-serialisable. It raises
`ToolError` to tell the model something went wrong; any other exception is reported to the model
too, as a tool failure, never raised out of the rollout loop.

Where a call runs, so that its deadline (`timeout_s`) holds and the event loop never stalls:
- an async function: awaited on the loop and cancelled at the deadline (it must await to yield);
- a sync function: in a thread of its own, stopped at the deadline (`tools.runners.run_in_thread`);
  that covers pure-Python code, and bound methods whose state lives in this process (GUI actions,
  search), all cheap by construction;
- a sync function with `isolate=True` (or `@tool_options(isolate=True)`): in a worker process that
  is killed at the deadline (`tools.worker_pool.run_in_worker`). For tools whose cost the model's arguments choose,
  such as the calculator: one C call (big-int `**`) holds the GIL and no thread can stop it.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import orjson
import pydantic

from agent_rl.core.deadline import deadline
from agent_rl.tools.runners import function_address, run_in_thread
from agent_rl.tools.worker_pool import run_in_worker


class ToolError(Exception):
    """Raised by a tool to send the model a readable error message."""


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    content: str  # the text the model sees in the tool message
    error: str | None = None


def tool_options(*, isolate: bool | None = None, timeout_s: float | None = None) -> Callable:
    """Decorator: the defaults `Tool` takes for this function (the function itself is unchanged)."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        options = {k: v for k, v in (("isolate", isolate), ("timeout_s", timeout_s)) if v is not None}
        setattr(fn, "__tool_options__", options)  # noqa: B010  (an attribute functions do not declare)
        return fn

    return mark


def tool_content(out: Any) -> str:
    """What the model reads of a tool's return value."""
    return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)


_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into a summary and per-argument descriptions."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    args: dict[str, str] = {}
    section = "summary"
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            section, current = "args", None
            continue
        if stripped.lower() in ("returns:", "raises:", "examples:", "example:", "yields:"):
            section, current = "other", None
            continue
        if section == "summary":
            summary.append(line)
        elif section == "args" and stripped:
            m = _ARG_LINE.match(line)
            if m and not line.startswith(" " * 8):
                current = m.group(1).lstrip("*")
                args[current] = m.group(3).strip()
            elif current:
                args[current] = (args[current] + " " + stripped).strip()
    return "\n".join(summary).strip(), args


class Tool:
    """A typed Python function exposed to the model."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, timeout_s: float | None = None,
                 isolate: bool | None = None):
        options = getattr(fn, "__tool_options__", {})
        self.fn = fn
        self.name = name or fn.__name__
        self.timeout_s = timeout_s if timeout_s is not None else options.get("timeout_s", 60.0)
        self.isolate = isolate if isolate is not None else options.get("isolate", False)
        self.is_async = inspect.iscoroutinefunction(fn)  # asked once: inspect's check costs more than a call's routing
        if self.isolate and self.is_async:
            raise TypeError(f"tool {self.name}: isolate=True is for synchronous functions; this one is async")
        self._address = function_address(fn) if self.isolate else None
        self.description, self.params_model = _arguments_model(fn, self.name)
        self._validator = self.params_model.__pydantic_validator__  # model_validate's own, without its wrapper

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema, as put in the system prompt (a fresh copy each time: parsed from
        its JSON text, a third of a deepcopy's cost, and asked for at every turn of every episode; by orjson, in a
        third of json's time, unless it would read a number otherwise: an integer past 64 bits becomes a float)."""
        text, exact = _schema(self.params_model, self.name, self.description)
        return orjson.loads(text) if exact else json.loads(text)

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Validated keyword arguments, or `ToolError` with a one-line reason."""
        if not isinstance(arguments, dict):
            raise ToolError(f"arguments of {self.name} must be a JSON object, got {type(arguments).__name__}")
        try:
            parsed = self._validator.validate_python(arguments)  # half model_validate's cost
        except pydantic.ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}" for err in e.errors()
            )
            raise ToolError(f"invalid arguments for {self.name}: {problems}") from None
        return dict(parsed.__dict__)  # the fields' values, and nothing else: extra="forbid" (`_build_arguments_model`)

    async def call(self, arguments: Any) -> ToolResult:
        """Validate and run; every failure becomes a `ToolResult` with ok=False."""
        try:
            out = await self._run(self.validate(arguments))
        except ToolError as e:
            return ToolResult(ok=False, content=f"Error: {e}", error=str(e))
        except TimeoutError:
            msg = f"{self.name} did not finish within {self.timeout_s:g} s"
            return ToolResult(ok=False, content=f"Error: {msg}", error=msg)
        except _WorkerFailure as e:
            msg = f"{self.name} failed: {e}"
            return ToolResult(ok=False, content=f"Error: {msg}", error=msg)
        except Exception as e:  # a tool bug is the model's problem to read about, not a crash
            msg = f"{self.name} failed: {type(e).__name__}: {e}"
            return ToolResult(ok=False, content=f"Error: {msg}", error=msg)
        return ToolResult(ok=True, content=tool_content(out))

    async def _run(self, kwargs: dict[str, Any]) -> Any:
        if self.is_async:
            async with deadline(self.timeout_s):
                return await self.fn(**kwargs)
        if self._address is None:
            return await run_in_thread(self.fn, kwargs, self.timeout_s, self.name)
        kind, text = await run_in_worker(self._address, kwargs, self.timeout_s)
        if kind == "refused":
            raise ToolError(text)
        if kind == "failed":
            raise _WorkerFailure(text)
        return text


class _WorkerFailure(Exception):
    """A tool raised in its worker process; the message is already "Type: text"."""


@functools.lru_cache(maxsize=1024)
def _schema(params_model: type[pydantic.BaseModel], name: str, description: str) -> tuple[str, bool]:
    """A tool's schema as JSON text, built once (pydantic's model_json_schema is slow, and every
    episode renders its tools' schemas into its prompt), and whether orjson reads it as json does."""
    params = params_model.model_json_schema()
    params.pop("title", None)
    for prop in params.get("properties", {}).values():
        prop.pop("title", None)
    text = json.dumps({"type": "function", "function": {"name": name, "description": description,
                                                        "parameters": params}})
    try:
        return text, orjson.loads(text) == json.loads(text)
    except orjson.JSONDecodeError:  # NaN or Infinity, which json writes and orjson refuses
        return text, False


# function -> {(name, bound): (description, arguments model)}; weak, so a function defined per
# environment (a closure) takes its entry with it
_MODELS: weakref.WeakKeyDictionary[Any, dict[tuple[str, bool], tuple[str, type[pydantic.BaseModel]]]] = (
    weakref.WeakKeyDictionary())


def _arguments_model(fn: Callable[..., Any], name: str) -> tuple[str, type[pydantic.BaseModel]]:
    """The description and pydantic arguments model of a tool function, built once per function:
    pydantic's create_model is slow (docs/performance.md#smaller-measurements), and every episode builds its
    environment's tools anew."""
    target = fn.__func__ if inspect.ismethod(fn) else fn
    if not inspect.isfunction(target):  # a callable object or a partial: built each time
        return _build_arguments_model(fn, name)
    models = _MODELS.setdefault(target, {})
    key = (name, inspect.ismethod(fn))  # a bound method's signature leaves out its first parameter
    if key not in models:
        models[key] = _build_arguments_model(fn, name)
    return models[key]


def _build_arguments_model(fn: Callable[..., Any], name: str) -> tuple[str, type[pydantic.BaseModel]]:
    description, arg_docs = _parse_docstring(fn.__doc__ or "")
    sig = inspect.signature(fn)
    hints = _type_hints(fn)
    fields: dict[str, Any] = {}
    for pname, param in sig.parameters.items():
        if pname == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname not in hints:
            raise TypeError(f"tool {name}: parameter {pname!r} has no type annotation")
        default = ... if param.default is param.empty else param.default
        fields[pname] = (hints[pname], pydantic.Field(default, description=arg_docs.get(pname)))
    model = pydantic.create_model(f"{name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    return description, model


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing

    target = fn.__func__ if inspect.ismethod(fn) else fn
    return typing.get_type_hints(target)


@runtime_checkable
class ToolLike(Protocol):
    """What an environment needs of a tool; `Tool` and `tools.mcp.MCPTool` both are one."""

    name: str
    timeout_s: float

    @property
    def schema(self) -> dict[str, Any]: ...

    async def call(self, arguments: Any) -> ToolResult: ...


def as_tools(fns: list[Callable[..., Any] | ToolLike]) -> list[ToolLike]:
    """Wrap plain functions as tools (objects that are already tools pass as they are); names must be unique."""
    # `Tool` first: on Python 3.11 the protocol check evaluates the `schema` property; a function is never
    # a `ToolLike`, and checking it against the protocol costs more than the rest of building its tool
    tools = [f if isinstance(f, Tool) or (not inspect.isroutine(f) and isinstance(f, ToolLike)) else Tool(f)
             for f in fns]
    names = [t.name for t in tools]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate tool names: {sorted(dup)}")
    return tools
