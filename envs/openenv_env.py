"""OpenEnv environments (`openenv-core` 0.3) as agent-rl episodes, through openenv-core's own client.

Owns: `load_tasks` (one task row per reset: the server's `reset(seed=...)`, with disjoint seeds for the
train and eval splits), `make_env` and `OpenEnvEnv` (one WebSocket session of `GenericEnvClient` per
episode: the reset's observation opens it, each tool call is one `step`, a `done` ends it, the step
rewards add up), starting a local server the way an OpenEnv environment folder is served
(`local_server`), the scripted solver a served folder may bring (`solve`: its `solver.py`, for
demonstrations), and the one-line errors of all of these.
Does not own: the environment server (the OpenEnv environment's own code: `openenv.core.env_server`
classes behind `create_app`), tokens and sampling (the rollout runner), tool-call parsing (the renderer).

Use it as any environment module, with the OpenEnv environment named in `rollout.env_args`:

    rollout:
      env: agent_rl.envs.openenv_env
      env_args: {path: ./my_env}                   # an OpenEnv environment folder, served here
      # env_args: {url: http://127.0.0.1:8000}     # or a server that runs already (a Space, a container)

A folder is served as OpenEnv serves one without Docker (`uv run --project . server`, or uvicorn on the
`app` its `openenv.yaml` names, `server.app:app` by default): `python -m uvicorn APP` in the folder with
this interpreter, on a free port of 127.0.0.1, once per process and folder, stopped when the process
exits; its dependencies must be installed here. Its `/health` must answer within `start_timeout_s`.

Why our renderer and sampler drive the turns (route (a)): an OpenEnv environment is a server that answers
actions, not an agent; the policy is ours, so the runner samples every turn and the episode only turns
tool calls into actions. The actions are the model's tools: an MCP environment (its action schema is
OpenEnv's `CallToolAction` / `ListToolsAction`) offers the tools it lists, each call one
`call_tool` step; any other environment offers one tool, `step`, whose parameters are its action's JSON
schema (from `/schema`). A reply without a tool call ends the episode, as in every agent-rl env.

Failures: an action the server rejects (its validation or execution error) goes back to the model as the
tool's error, and the episode goes on; the server unreachable, dying or silent past `step_timeout_s` is
the episode's one-line error (`StopReason.ERROR`, an infrastructure error kept out of the update), and
the run goes on with the next episodes.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

try:
    from openenv.core.generic_client import GenericEnvClient
except ImportError as e:
    raise ImportError(f"openenv-core is not installed ({e.name}): pip install 'agent-rl[openenv]'") from None

from agent_rl.core.env import Env, StepResult
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, StopReason, ToolCall, ToolCallRecord

SYSTEM = ("You act in an environment through tool calls. Each call is one action; the environment answers "
          "with its observation. Keep acting until the observation says the episode is done.")
MCP_ACTIONS = {"Action", "CallToolAction", "ListToolsAction"}  # the titles of MCP environments' action schemas


class OpenEnvError(Exception):
    """The OpenEnv server failed (unreachable, died, silent); the message is one line."""


def load_tasks(n: int, seed: int = 0, split: str = "train", path: str | None = None, url: str | None = None,
               reset: dict[str, Any] | None = None, system: str = SYSTEM) -> list[dict[str, Any]]:
    """n episodes of the environment, each a `reset(seed=...)`: train seeds are even, eval seeds odd."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if (path is None) == (url is None):
        raise ValueError("rollout.env_args: give the OpenEnv environment as path (a folder to serve) or url "
                         "(a running server), one of the two")
    if path is not None and not (Path(path) / "openenv.yaml").is_file() and not (Path(path) / "server").is_dir():
        raise ValueError(f"rollout.env_args.path: {path!r} is not an OpenEnv environment folder (no openenv.yaml "
                         "or server/)")
    where = {"path": str(Path(path).resolve())} if path is not None else {"url": str(url).rstrip("/")}
    odd = int(split == "eval")
    return [{"id": f"openenv-{split}-{seed}-{i}", **where, "system": system,
             "reset": {**(reset or {}), "seed": 1_000_000 * seed + 2 * i + odd}} for i in range(n)]


def make_env(task: dict[str, Any]) -> OpenEnvEnv:
    return OpenEnvEnv(task)


def solve(task: dict[str, Any], messages: Sequence[Message], direct: bool = False) -> Message:
    """The scripted solver of demonstrations (`agent-rl demos`): OpenEnv has none, so a served folder may hold
    one, `solver.py` with `solve(task, messages, direct) -> Message`; without it, one line says so."""
    path = Path(task.get("path") or "") / "solver.py"
    if not task.get("path") or not path.is_file():
        raise ValueError(f"OpenEnv environment {task.get('path') or task.get('url')!r} has no scripted solver: put "
                         "solve(task, messages, direct) in a solver.py in its folder for demonstrations")
    spec = importlib.util.spec_from_file_location(f"openenv_solver_{abs(hash(str(path)))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.solve(task, messages, direct)


@dataclass(frozen=True)
class ActionTool:
    """One tool the model sees: an MCP tool of the environment, or its whole action as `step`."""

    name: str
    schema: dict[str, Any]
    mcp: bool  # a call is `call_tool(name, arguments)`; else the arguments are the action

    def action(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return {"type": "call_tool", "tool_name": self.name, "arguments": arguments} if self.mcp else arguments


class OpenEnvEnv(Env):
    """One episode: a WebSocket session of `GenericEnvClient` on the task's server."""

    def __init__(self, task: dict[str, Any], connect_timeout_s: float = 10.0, step_timeout_s: float = 60.0,
                 start_timeout_s: float = 60.0):
        self.task = task
        self.connect_timeout_s, self.step_timeout_s, self.start_timeout_s = (connect_timeout_s, step_timeout_s,
                                                                             start_timeout_s)
        self.client: GenericEnvClient | None = None
        self.total, self.steps, self.done = 0.0, 0, False
        self.tools: list[ActionTool] = []

    async def __aenter__(self) -> OpenEnvEnv:
        url = self.task.get("url") or await local_server(self.task["path"], self.start_timeout_s)
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=self.connect_timeout_s,
                                       message_timeout_s=self.step_timeout_s)
        try:
            await self.client.connect()
            self.tools = await self._tools(url)
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await asyncio.wait_for(client.close(), self.connect_timeout_s)

    async def _tools(self, url: str) -> list[ActionTool]:
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http, http.get(f"{url}/schema") as response:
                response.raise_for_status()
                action = (await response.json())["action"]
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as e:
            raise OpenEnvError(f"OpenEnv server {url}: its /schema failed: {type(e).__name__}: {e}") from None
        if action.get("title") not in MCP_ACTIONS:
            params = {k: v for k, v in action.items() if k != "title"}
            params["properties"] = {k: v for k, v in params.get("properties", {}).items() if k != "metadata"}
            description = action.get("description") or "Take one action in the environment."
            return [ActionTool("step", _function("step", description, params), mcp=False)]
        listed = await self._step({"type": "list_tools"})
        return [ActionTool(t["name"], _function(t["name"], t.get("description", ""), t.get("input_schema", {})),
                           mcp=True) for t in listed.observation.get("tools", [])]

    async def initial_messages(self) -> list[Message]:
        assert self.client is not None
        try:
            result = await self.client.reset(**self.task.get("reset", {}))
        except Exception as e:
            raise self._failure("reset", e) from None
        self.done = bool(result.done)
        return [Message("system", self.task.get("system") or SYSTEM), Message("user", _observation(result))]

    async def step(self, reply: Message, turn: int) -> StepResult:
        if not reply.tool_calls:
            return StepResult(done=True, stop_reason=StopReason.NO_TOOL_CALL)
        messages, records = [], []
        for call in reply.tool_calls:
            if self.done:
                error = "the episode is done; no further actions are taken"
                messages.append(Message("tool", f"Error: {error}", name=call.name or "<invalid>"))
                records.append(ToolCallRecord(call.name or "<invalid>", False, error, 0.0, turn))
                continue
            t0 = time.perf_counter()
            content, failed = await self._call(call)
            name = call.name if call.ok else "<invalid>"
            messages.append(Message("tool", content, name=name))
            records.append(ToolCallRecord(name, failed is None, failed, time.perf_counter() - t0, turn))
        return StepResult(messages=tuple(messages), tool_calls=tuple(records), done=self.done,
                          stop_reason=StopReason.ENV_DONE)

    async def _call(self, call: ToolCall) -> tuple[str, str | None]:
        """The tool message for one call and its error (None: the environment took the action)."""
        by_name = {t.name: t for t in self.tools}
        if call.error is not None:
            return f"Error: {call.error}", call.error
        if call.name not in by_name:
            error = f"unknown tool {call.name!r}; available tools: {', '.join(by_name) or 'none'}"
            return f"Error: {error}", error
        try:
            result = await self._step(by_name[call.name].action(call.arguments))
            content = _observation(result)
        except _Rejected as e:
            return f"Error: {e}", str(e)
        self.steps += 1
        self.total += float(result.reward or 0.0)
        self.done = bool(result.done)
        return content, None

    async def _step(self, action: dict[str, Any]) -> Any:
        assert self.client is not None
        try:
            return await self.client.step(action)
        except RuntimeError as e:  # the server's error reply: `Server error: ... (code: ...)`
            if str(e).startswith("Server error:") and any(c in str(e) for c in ("VALIDATION", "EXECUTION")):
                raise _Rejected(" ".join(str(e).removeprefix("Server error:").split())[:500]) from None
            raise self._failure("step", e) from None
        except Exception as e:
            raise self._failure("step", e) from None

    def _failure(self, what: str, e: Exception) -> OpenEnvError:
        where = self.task.get("url") or self.task.get("path")
        text = " ".join(str(e).split())[:300] or type(e).__name__
        return OpenEnvError(f"OpenEnv server {where} failed on {what}: {type(e).__name__}: {text}")

    async def reward(self, messages: Sequence[Message]) -> Reward:
        return Reward(self.total, {"openenv_reward": self.total, "steps": float(self.steps),
                                   "done": float(self.done)})


class _Rejected(Exception):
    """The server refused an action (validation or execution error): the model reads why."""


def _function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _observation(result: Any) -> str:
    """What the model reads of a step: the observation without the fields the result carries itself; an MCP
    tool's result as its text."""
    obs = result.observation if isinstance(result.observation, dict) else {"observation": result.observation}
    if "tool_name" in obs and ("result" in obs or "error" in obs):
        return _tool_result(obs)
    shown = {k: v for k, v in obs.items() if k not in ("done", "reward", "metadata") and v not in (None, "", [], {})}
    if result.done:
        shown["done"] = True
    return json.dumps(shown, ensure_ascii=False)


def _tool_result(obs: dict[str, Any]) -> str:
    """An MCP environment's `CallToolObservation`: its text content, or its error."""
    if obs.get("error"):
        raise _Rejected(str(obs["error"].get("message") if isinstance(obs["error"], dict) else obs["error"]))
    result = obs.get("result")
    blocks = result.get("content") if isinstance(result, dict) else None
    if isinstance(result, dict) and isinstance(blocks, list):
        text = "\n".join(str(b.get("text", b)) if isinstance(b, dict) else str(b) for b in blocks)
        if result.get("is_error"):
            raise _Rejected(text)
        return text
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


# -- serving a folder -------------------------------------------------------------------------------
@dataclass
class LocalServer:
    """One environment folder served by uvicorn in a process of its own (its own process group)."""

    path: str
    url: str
    process: subprocess.Popen
    log: str

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=10)


SERVERS: dict[str, LocalServer] = {}  # folder -> its server, one per process
_STARTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {folder: its start}


async def local_server(path: str, start_timeout_s: float = 60.0) -> str:
    """The URL of the folder's server, started by the first episode that needs it (again if it died)."""
    path = str(Path(path).resolve())
    server = SERVERS.get(path)
    if server is not None and server.process.poll() is None:
        return server.url
    starting = _STARTING.setdefault(asyncio.get_running_loop(), {})
    if path not in starting or starting[path].done():
        starting[path] = asyncio.ensure_future(asyncio.to_thread(_start, path, start_timeout_s))
    return (await asyncio.shield(starting[path])).url


def _start(path: str, timeout_s: float) -> LocalServer:
    app = _app_of(Path(path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, log = tempfile.mkstemp(prefix="openenv-server-", suffix=".log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)],
                               cwd=path, env=env, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(fd)
    server = LocalServer(path, f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise OpenEnvError(f"OpenEnv server of {path} exited with status {process.returncode} before it "
                               f"answered: {_tail(log)}")
        if _healthy(server.url):
            SERVERS[path] = server
            return server
        time.sleep(0.2)
    server.stop()
    raise OpenEnvError(f"OpenEnv server of {path} did not answer /health within {timeout_s:g} s: {_tail(log)}")


def _app_of(folder: Path) -> str:
    """The ASGI app an OpenEnv folder serves: `app:` in its openenv.yaml, else `server.app:app`."""
    manifest = folder / "openenv.yaml"
    if manifest.is_file():
        for line in manifest.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "app" and value.strip():
                return value.strip()
    return "server.app:app"


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _tail(log: str) -> str:
    try:
        lines = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-3:])[-400:] or "(no output)"


ENV = EnvSpec("openenv_env", make_env, load_tasks, solve=solve)


@atexit.register
def _stop_all() -> None:
    for server in list(SERVERS.values()):
        server.stop()
