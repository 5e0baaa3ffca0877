"""verifiers environments (`verifiers` 0.4, its v1 API) as agent-rl episodes, loaded as verifiers loads one.

Owns: `load_tasks` (a verifiers taskset's tasks as task rows: deterministic, disjoint train and eval
splits), `make_env` and `VerifiersEnv` (one task played by the environment's own `Env.run()` with
agent-rl's runner as the agent), and the one-line errors of both.
Does not own: the seat verifiers' `run()` talks to, the verifiers trace and the toolsets' tools
(`envs.verifiers_seat`); tokens, sampling and stop rules (the rollout runner).

Use it as any environment module, with the verifiers environment named in `rollout.env_args`:

    rollout:
      env: agent_rl.envs.verifiers_env
      env_args: {taskset: my_taskset, args: {num_tasks: 20}, env: ""}

`taskset` is a verifiers taskset id, resolved as `vf-eval` resolves it (`verifiers.v1.load_environment`:
a built-in such as `openenv`, or an installed package or module exporting its `Taskset` subclass in
`__all__`; a hub id `owner/name` imports `name`; a `.py` file is imported from its folder); `args` are its
`TasksetConfig` fields (`--env.taskset.*` in verifiers' CLI); `env` an `Env` id, empty for the taskset's
own or `SingleAgentEnv`. Every task of the taskset (an infinite one: its first `limit`) is a row; every
`eval_every`-th by position (idx 4, 9, 14, ... for 5) is the eval split, the others train.

Why our renderer and sampler drive the turns (route (a)) and not verifiers' harness against the recording
proxy (route (b)): a verifiers harness is a program verifiers launches in a runtime (`null` and `bash` are
PEP 723 scripts that `uv` resolves from the network, the others install CLIs in containers), reaching the
model through verifiers' interception server, which a training run would stack on top of our proxy. The
parts that make a verifiers environment what it is run unchanged in-process instead: the taskset's
tasks, the environment's own `run()` (the engine that plays the user: a game, an OpenEnv server, a
simulated user), the toolsets' `@vf.tool` methods and the task's `@vf.reward` / `@vf.metric` scoring.
The policy is the seat's agent: each segment it is asked for is sampled turn by turn by the runner, tool
calls answered by the toolsets, so the tokens are the runner's (ids, mask, log-probs), as with a native env.

Demonstrations: a taskset's module may define agent-rl's scripted solver, `solve(data, messages, direct)`
(`solve` here calls it), so `agent-rl demos` and a cold start work as for a built-in environment.

Reward: the trace's reward (the sum of weight x score over its rewards, as verifiers computes it), with
every reward's score and every metric as named parts.

Nothing is dropped silently. The task's `@vf.stop` hooks end the episode where verifiers' rollout would (a
response hook on the model's reply, before its calls run; trace and request hooks before each model call after
the first), the trace stopping with the hook's name (`StopReason.ENV_DONE`). Content no chat format of
agent-rl takes (an image in a prompt or a user message) ends the episode with a one-line error naming it. Not
supported, each one line: `@vf.intercept` hooks (they rewrite what the model is sent or sent back; here the
sampled tokens are the episode), environments whose episode runs an agent more than once or has a role that
does not train (best-of-n, judges: one token stream per episode), tasks that need a runtime (containers: their
runtime-bound hooks are skipped, as `Task.score` skips them offline), LLM judges without a reachable endpoint. An
exception inside the environment (its `run()`, a tool server's setup, a reward, a stop hook) is the episode's
one-line error (`StopReason.ERROR`, kept out of the update).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.episode import EnvInfo, Episode
    from verifiers.v1.trace import TraceTask
    from verifiers.v1.utils.decorators import discover_decorated
    from verifiers.v1.utils.loaders import import_taskset, load_environment, resolve_env_config
except ImportError as e:
    raise ImportError(f"verifiers is not installed ({e.name}): pip install 'agent-rl[verifiers]'") from None

from agent_rl.core.env import Env, StepResult
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, StopReason
from agent_rl.envs.base import ToolEnv
from agent_rl.envs.verifiers_seat import (
    Bridge,
    Request,
    Seats,
    add_nodes,
    from_verifiers,
    stop_hooks,
    stopped_by,
    toolset_tools,
)


class VerifiersError(Exception):
    """Something inside the verifiers environment failed; the message is one line."""


def one_line(e: BaseException) -> str:
    """An exception as one line: its type, then its message's lines joined (pydantic's errors included)."""
    errors = getattr(e, "errors", None)
    if callable(errors) and type(e).__name__ == "ValidationError":
        text = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in errors())
    else:
        text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:500]}" if text else type(e).__name__


@dataclass
class Loaded:
    """A verifiers environment, loaded once per process (its taskset, its shared tool servers)."""

    env: Any  # verifiers.v1.Env
    roles: tuple[str, ...]
    shared: list[Any]  # the taskset's shared Toolsets
    ready: weakref.WeakKeyDictionary  # event loop -> the shared toolsets' setup on it


@functools.lru_cache(maxsize=16)
def _loaded(taskset: str, args_json: str, env_id: str) -> Loaded:
    try:
        config = resolve_env_config({"id": env_id, "taskset": {"id": taskset, **json.loads(args_json)}})
        loaded = load_environment(config)
        shared = type(loaded.taskset).toolsets(loaded.taskset.config)
    except Exception as e:
        raise ValueError(f"verifiers environment {taskset!r}: {one_line(e)}") from None
    return Loaded(loaded, tuple(agent_config_fields(config)), list(shared), weakref.WeakKeyDictionary())


def _load(taskset: str, args: dict[str, Any] | None, env: str) -> Loaded:
    if not isinstance(taskset, str) or not taskset:
        raise ValueError("rollout.env_args.taskset: name the verifiers taskset (its id, as vf-eval takes it)")
    return _loaded(taskset_id(taskset), json.dumps(args or {}, sort_keys=True), env or "")


def taskset_id(taskset: str) -> str:
    """A verifiers taskset id as given, or a `.py` file's stem with its folder put on the import path (as
    agent-rl's own environment names take a file); a missing file is a one-line error."""
    if not taskset.endswith(".py"):
        return taskset
    path = Path(taskset).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"rollout.env_args.taskset: no file {taskset!r}")
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    return path.stem


def solve(task: dict[str, Any], messages: Sequence[Message], direct: bool = False) -> Message:
    """The scripted solver of demonstrations (`agent-rl demos`): verifiers has none, so a taskset's module may
    define one, `solve(data, messages, direct) -> Message` over its task data; without it, one line says so."""
    name = taskset_id(task["taskset"])
    solver = getattr(import_taskset(name), "solve", None)
    if not callable(solver):
        raise ValueError(f"verifiers taskset {name!r} has no scripted solver: define solve(data, messages, direct) "
                         "in its module for demonstrations")
    loaded = _load(task["taskset"], task.get("taskset_args"), task.get("vf_env", ""))
    data_type = type(loaded.env.taskset).task_type().data_type()
    return solver(data_type.model_validate(task["data"]), messages, direct)


def load_tasks(n: int, seed: int = 0, split: str = "train", taskset: str = "", args: dict[str, Any] | None = None,
               env: str = "", limit: int = 10_000, eval_every: int = 5) -> list[dict[str, Any]]:
    """n task rows of the split, shuffled by `seed` (cycled when the split has fewer)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    loaded = _load(taskset, args, env)
    try:
        tasks = list(loaded.env.taskset.take(limit))
    except Exception as e:
        raise ValueError(f"verifiers taskset {taskset!r} failed to load its tasks: {one_line(e)}") from None
    rows = [_row(t, taskset, args, env) for t in tasks if ((t.data.idx or 0) % eval_every == eval_every - 1)
            == (split == "eval")]
    if not rows:
        raise ValueError(f"verifiers taskset {taskset!r}: no {split} tasks among its {len(tasks)} (every "
                         f"{eval_every}th is eval; set rollout.env_args.eval_every)")
    random.Random(seed).shuffle(rows)
    return [dict(rows[i % len(rows)]) for i in range(n)]


def _row(task: Any, taskset: str, args: dict[str, Any] | None, env: str) -> dict[str, Any]:
    data = task.data
    task_id = str(data.id) if data.id is not None else f"{taskset_id(taskset)}/{data.idx}"
    return {"id": task_id, "taskset": taskset, "taskset_args": dict(args or {}), "vf_env": env,
            "data": data.model_dump(mode="json")}


def make_env(task: dict[str, Any]) -> VerifiersEnv:
    return VerifiersEnv(task)


class VerifiersEnv(Env):
    """One task row played by its verifiers environment's own `run()`; the runner is the agent.

    Deadlines, each ending the episode with one line: `step_timeout_s` bounds each tool server's setup and
    the environment's time from a segment's answer to its next request or the end of its `run()` (a game
    step, an OpenEnv call; below the runner's env_timeout_s, so the error names the environment);
    `finish_timeout_s` its time to finish once the runner has ended the episode."""

    def __init__(self, task: dict[str, Any], step_timeout_s: float = 100.0, finish_timeout_s: float = 30.0):
        self.row = task
        self.step_timeout_s, self.finish_timeout_s = step_timeout_s, finish_timeout_s
        self.loaded = _load(task["taskset"], task.get("taskset_args"), task.get("vf_env", ""))
        vf_env = self.loaded.env
        task_cls = type(vf_env.taskset).task_type()
        try:
            self.task = task_cls(task_cls.data_type().model_validate(task["data"]), vf_env.taskset.config.task)
        except Exception as e:
            raise ValueError(f"task {task.get('id')!r} is not a task of {task['taskset']!r}: {one_line(e)}") from None
        self.stops = _stops(self.task, task["taskset"])
        self.bridge = Bridge()
        self._calls = _ToolCalls([])
        self._run: asyncio.Task | None = None
        self._pending: Request | None = None
        self._segment: list[Message] = []  # the segment being sampled: replies with calls and their results
        self._seen = 0  # messages of the runner's conversation the environment has been told of

    async def __aenter__(self) -> VerifiersEnv:
        own: list[Any] = []
        try:
            await asyncio.wait_for(self._shared_ready(), self.step_timeout_s)
            own = type(self.task).toolsets(self.task.config)
            for toolset in own:
                await asyncio.wait_for(toolset.setup(), self.step_timeout_s)
                await asyncio.wait_for(toolset.setup_task(self.task), self.step_timeout_s)
        except TimeoutError:
            raise VerifiersError(f"a tool server of {self.row['taskset']!r} did not set up within "
                                 f"{self.step_timeout_s:g} s") from None
        except Exception as e:
            raise VerifiersError(f"a tool server of {self.row['taskset']!r} failed to start: {one_line(e)}") from None
        tools = [t for ts in [*self.loaded.shared, *own] for t in toolset_tools(ts, self.bridge)]
        self._calls = _ToolCalls(tools)
        self.tools = self._calls.tools
        return self

    async def _shared_ready(self) -> None:
        loop = asyncio.get_running_loop()
        ready = self.loaded.ready
        if loop not in ready:
            ready[loop] = loop.create_task(_setup_all(self.loaded.shared))
        await asyncio.shield(ready[loop])

    # -- the runner's side --------------------------------------------------------------------------
    async def initial_messages(self) -> list[Message]:
        self._run = asyncio.create_task(self._play(), name=f"verifiers {self.row.get('id')}")
        request = await self._next()
        if request is None:
            raise VerifiersError("the environment's run() ended before asking the model anything")
        opening = [from_verifiers(n.message) for n in self.bridge.traces[-1].nodes]
        self._seen = len(opening)
        return opening

    async def step(self, reply: Message, turn: int) -> StepResult:
        self._seen += 1
        if await self._stopped(reply):  # a response hook: the reply is the last, its calls never run
            self._segment.append(reply)
            return StepResult(done=True, stop_reason=StopReason.ENV_DONE)
        if reply.tool_calls:
            result = await self._calls.step(reply, turn)
            self._segment += [reply, *result.messages]
            self._seen += len(result.messages)
            if await self._stopped():
                return StepResult(done=True, stop_reason=StopReason.ENV_DONE, tool_calls=result.tool_calls)
            return result
        self._answer([*self._segment, reply])
        request = await self._next()
        if request is None:
            return StepResult(done=True, stop_reason=StopReason.NO_TOOL_CALL)
        if not request.messages:
            raise VerifiersError("the environment asked for another segment without a user message")
        self._seen += len(request.messages)
        if await self._stopped():
            return StepResult(done=True, stop_reason=StopReason.ENV_DONE)
        return StepResult(messages=tuple(request.messages))

    async def _stopped(self, reply: Message | None = None) -> bool:
        """Whether a `@vf.stop` hook ends the episode here (on `reply`, else before the next model call); the trace
        then stops with the hook's name, as verifiers' rollout stops it."""
        trace = self.bridge.traces[-1]
        try:
            name = await stopped_by(self.stops, trace, self._segment, reply)
        except Exception as e:
            raise VerifiersError(f"a @vf.stop hook raised {one_line(e)}") from None
        if name is not None:
            trace.stop(name)
        return name is not None

    async def reward(self, messages: Sequence[Message]) -> Reward:
        if self._pending is not None:  # the runner ended it (turn or token limit, a turn cut at max_tokens)
            trace = self.bridge.traces[-1]
            add_nodes(trace, [*self._segment, *messages[self._seen:]], sampled=True)
            self._answer(None)
        run = self._run
        assert run is not None
        if not (await asyncio.wait({run}, timeout=self.finish_timeout_s))[0]:
            raise VerifiersError(f"the environment's run() did not finish within {self.finish_timeout_s:g} s "
                                 "of the episode's end")
        if (failure := run.exception()) is not None:
            raise VerifiersError(f"the environment raised {one_line(failure)}")
        trace = self.bridge.traces[-1]
        parts = {name: r.score for name, r in trace.rewards.items() if r is not None}
        parts.update({name: v for name, v in trace.metrics.items() if v is not None and name not in parts})
        return Reward(float(trace.reward), {k: float(v) for k, v in parts.items()})

    async def close(self) -> None:
        run = self._run
        if self._pending is not None:
            self._answer(None)
        if run is not None and not run.done():
            if not (await asyncio.wait({run}, timeout=self.finish_timeout_s))[0]:
                run.cancel()
                await asyncio.wait({run}, timeout=self.finish_timeout_s)
        if run is not None and run.done() and not run.cancelled():
            run.exception()  # retrieved: its failure is the episode's error, not a warning at exit

    # -- the environment's side ---------------------------------------------------------------------
    async def _play(self) -> None:
        vf_env, seats = self.loaded.env, Seats(self.bridge, self.loaded.roles)
        await vf_env.setup(seats)
        if idle := [name for name in self.loaded.roles if not getattr(seats, name).trainable]:
            raise VerifiersError(f"its role {idle[0]!r} does not train; an episode here is one token stream")
        await vf_env.run(self.task, seats)
        episode = Episode(env=EnvInfo(id=vf_env.config.env_id), traces=list(self.bridge.traces),
                          task=TraceTask(type=type(self.task).__name__, data=self.task.data, key=self.task.key,
                                         hash=self.task.hash))
        await vf_env.finalize(self.task, episode)

    async def _next(self) -> Request | None:
        """The environment's next request, or None when its `run()` returned; its failure raised as one line."""
        run = self._run
        assert run is not None
        get = asyncio.ensure_future(self.bridge.inbox.get())
        try:
            await asyncio.wait({get, run}, timeout=self.step_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            self._pending = get.result()
            if len(self.bridge.traces) > 1:
                raise VerifiersError("it runs its agent more than once per episode (best-of-n, a judge); an "
                                     "episode here is one token stream")
            return self._pending
        if not run.done():
            raise VerifiersError(f"the environment's run() neither asked the model again nor ended within "
                                 f"{self.step_timeout_s:g} s (VerifiersEnv step_timeout_s)")
        if (failure := run.exception()) is not None:
            raise VerifiersError(f"the environment raised {one_line(failure)}")
        return None

    def _answer(self, segment: list[Message] | None) -> None:
        pending, self._pending, self._segment = self._pending, None, []
        if pending is not None and not pending.reply.done():
            pending.reply.set_result(segment)


def _stops(task: Any, taskset: str) -> list[tuple[type, Any]]:
    """The task's `@vf.stop` hooks; a hook verifiers would refuse, or any `@vf.intercept` hook (it rewrites what the
    model is sent or sent back, and here the sampled tokens are the episode), is a one-line error."""
    intercepts = [fn.__name__ for fn in discover_decorated(task, "intercept")]
    if intercepts:
        raise ValueError(f"verifiers taskset {taskset!r}: its @vf.intercept hook {intercepts[0]!r} rewrites the "
                         "model's requests or responses, which agent-rl does not do (the sampled tokens are the "
                         "episode)")
    try:
        return stop_hooks(task)
    except Exception as e:
        raise ValueError(f"verifiers taskset {taskset!r}: {one_line(e)}") from None


class _ToolCalls(ToolEnv):
    """`ToolEnv`'s dispatch of a turn's calls (one tool message per attempted call), and nothing else."""

    async def initial_messages(self) -> list[Message]:
        raise NotImplementedError

    async def reward(self, messages: Sequence[Message]) -> Reward:
        raise NotImplementedError


async def _setup_all(toolsets: Sequence[Any]) -> None:
    for toolset in toolsets:
        await toolset.setup()


ENV = EnvSpec("verifiers_env", make_env, load_tasks, solve=solve)

__all__ = ["VerifiersEnv", "VerifiersError", "load_tasks", "make_env", "solve", "vf"]
