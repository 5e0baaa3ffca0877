"""What several test files share, written once: waits, factories of the project's nouns, stand-ins, scripted runs.

Owns: waits with a deadline (`until`, `until_sync`: a test waits for what it waits for, never a guessed time);
`trajectory` and `scored_groups` (episodes and groups written by hand); episodes (`AddEnv`, `EchoToolEnv`,
`script_of`, `call_text`, `play_episode`, `add_episode`; the traces' `PLAN` and `plan_groups`); the loop on a
scripted sampler (`here`, `not_here`, `TimedSampler`, `VersionSync`, `toy_tasks`, `scripted_run`, `run_loop`);
the update on the tiny model and runs against the test server (`tiny_config`, `make_batch`, `Row`,
`server_config`, `killed_after_step_2`, `server_logprobs`, `served_name_of`, `LOGPROB_TOL`); the stand-in vLLM
server (`StandInVLLM`, `serve_app`, `SavesAFile`); processes (`alive`, `accepts`, `mcp_over_http`); what a run or
command left (`total`, `essence`, `one_error_line`) and the documented commands' terms (`AGENT_RL`, `SMALL_ROLLOUT`,
`SMALL_TRAIN`); the sandbox cases' terms (`docker_or_skip`, `deadline_slack_s`).
Does not own: fixtures (tests/conftest.py, where pytest finds them), what one test file is about (that file),
reading the docs (tests/doc_pages.py), tool functions run in workers (tests/slow_tools.py), Ray kits
(tests/ray_kits.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from aiohttp import web

from agent_rl.core.returns import scored
from agent_rl.core.types import Message, StopReason, ToolCallRecord, Trajectory, TrajectoryGroup, Turn
from agent_rl.envs.base import Env, StepResult, ToolEnv
from agent_rl.rollout.players import LocalPlayers
from agent_rl.rollout.runner import EpisodeLimits, run_episode
from agent_rl.rollout.sampler import Completion, SamplerError
from agent_rl.rollout.scripted import ScriptedSampler
from agent_rl.rollout.serving.vllm.server import free_port


# -- waits: each for a condition, with a deadline that only a failing test waits out -----------------------------------
async def until(predicate: Callable[[], object], what: str, timeout_s: float = 30.0, every_s: float = 0.005) -> None:
    """Until `predicate()` holds, polled every `every_s`; past `timeout_s` it fails, naming `what`."""
    # the default bound is generous (a loaded machine runs a thread or a round trip late): only a failing test waits
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout_s:g} s"
        await asyncio.sleep(every_s)


def until_sync(predicate: Callable[[], object], what: str, timeout_s: float = 30.0, every_s: float = 0.01) -> None:
    """`until` for a thread with no event loop (a test driving a subprocess): polled every `every_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(every_s)


# -- the project's nouns, written by hand ------------------------------------------------------------------------------
def trajectory(reward: float = 0.0, stop: StopReason = StopReason.NO_TOOL_CALL, *, task_id: str = "t",
               ids: Sequence[int] = (), prompt_len: int | None = None, mask: Sequence[int] | None = None,
               logprobs: Sequence[float] | None = None, turns: Sequence[Turn | float] = (), states: Sequence[str] = (),
               messages: Sequence[Message] = (), calls: Sequence[ToolCallRecord] = (), **fields) -> Trajectory:
    """An episode written by hand, any field of `Trajectory` by keyword; token fields and turns as below."""
    # the first `prompt_len` ids (1 where unset) are the prompt, the rest sampled unless `mask` says, each sampled
    # token at log-prob -0.5 unless `logprobs` says; a turn's state from `states`; any other field by keyword
    prompt_len = (1 if ids else 0) if prompt_len is None else prompt_len
    mask = (0,) * prompt_len + (1,) * (len(ids) - prompt_len) if mask is None else mask
    logprobs = tuple(-0.5 if m else 0.0 for m in mask) if logprobs is None else logprobs
    states = states or [""] * len(turns)
    made = tuple(t if isinstance(t, Turn) else Turn(0, 0, "stop", 0, reward=t, state=s) for t, s in zip(turns, states))
    return Trajectory(task_id, tuple(ids), tuple(mask), tuple(logprobs), prompt_len, made, tuple(messages),
                      tuple(calls), stop, reward, **fields)


def scored_groups(groups, truncated_reward=None):
    """Hand-built groups with their returns set under `truncated_reward`, as the rollout engine stores them."""
    return [TrajectoryGroup(g.task_id, scored(g.trajectories, truncated_reward)) for g in groups]


# -- episodes ----------------------------------------------------------------------------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


class AddEnv(ToolEnv):
    """"Use tools." and `question`, the `add` tool (or `tools`); reward 1 when the last message holds `answer`."""
    # its prompt's token ids under SmolLM2's renderer are written out in tests/test_rollout_tokens.py

    def __init__(self, question: str = "2+3+4?", answer: str = "9", tools: Sequence = (add,)):
        super().__init__(tools)
        self.question, self.answer = question, answer

    async def initial_messages(self):
        return [Message("system", "Use tools."), Message("user", self.question)]

    async def reward(self, messages):
        return 1.0 if self.answer in messages[-1].content else 0.0


class EchoToolEnv(Env):
    """Every assistant turn is answered by a tool message, for `turns` turns: multi-turn on any model."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    async def initial_messages(self):
        return [Message("user", "Count with me.")]

    async def step(self, reply, turn):
        if turn + 1 >= self.turns:
            return StepResult(done=True)
        return StepResult(messages=(Message("tool", f"echo {turn}: {reply.content[:20]}", name="echo"),))

    async def reward(self, messages):
        return float(len(messages))


def script_of(replies):
    """The next of `replies` on each call (one episode per sampler): prompt text can be forged, a count cannot."""
    it = iter(replies)
    return lambda prompt: next(it)


def call_text(name: str, **arguments) -> str:
    """A tool call as the model writes it (SmolLM2's and Qwen's `<tool_call>` JSON)."""
    return '<tool_call>\n' + json.dumps({"name": name, "arguments": arguments}) + '\n</tool_call>'


async def play_episode(env, sampler, renderer, limits: EpisodeLimits | None = None, task_id: str = "t0",
                       index: int = 0) -> Trajectory:
    """One episode of `env`, entered here and closed after, through `sampler` (`rollout.runner.run_episode`)."""
    async with env:
        return await run_episode(env, sampler, renderer, limits or EpisodeLimits(), task_id, index)


async def add_episode(renderer, script, **limits):
    """`AddEnv`'s episode with `script(messages)` as the policy: (trajectory, tool schemas, sampler and its calls)."""
    sampler = ScriptedSampler(renderer, script, on_messages=True)
    env = AddEnv()
    return await play_episode(env, sampler, renderer, EpisodeLimits(**limits)), env.tool_schemas, sampler


def question_env_module(name: str, reward: str, imports: str = "") -> str:
    """The source of an environment module a user would write (tests/test_audit.py, tests/test_relative_audit.py):
    one question, "What is 4 + 7?" (answer "11"), no tools, no solver; `reward` is the expression of its reward over
    `self.task` and the last reply `messages[-1].content`."""
    return f"""{imports}
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward
from agent_rl.envs.base import ToolEnv

class QuestionEnv(ToolEnv):
    def __init__(self, task):
        super().__init__([])
        self.task = task

    async def initial_messages(self):
        return [Message("user", self.task["question"])]

    async def reward(self, messages):
        return Reward(float({reward}))

def make_env(task):
    return QuestionEnv(task)

def load_tasks(n, seed=0, split="train"):
    return [{{"id": "q4", "question": "What is 4 + 7?", "answer": "11"}}][:n]

ENV = EnvSpec({name!r}, make_env, load_tasks)
"""


# -- a plan of scripted episodes (tests/test_traces.py, tests/test_trace_page.py) --------------------------------------
ADD_CALL = call_text("add", a=2, b=3)
BAD_ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
HOSTILE = '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> It is 5.'
REPLIES = {  # what a scripted policy does, turn by turn (a string: the same every turn); any other kind crashes
    "tool_then_right": lambda p: ADD_CALL if "<tool_response>" not in p else "It is 5.",
    "wrong": lambda p: "It is 4.",
    "bad_call_then_right": lambda p: BAD_ADD_CALL if "<tool_response>" not in p else "It is 5.",
    "rambles": lambda p: "word " * 200,  # cut by max_tokens_per_turn: truncated
    "hostile": lambda p: HOSTILE,
}
PLAN = {  # 4 groups of 3: a learning group, a group without variance, one with a crash, one truncated
    "t-learn": ["tool_then_right", "wrong", "wrong"],
    "t-flat": ["wrong", "wrong", "wrong"],
    "t-crash": ["bad_call_then_right", "crash", "wrong"],
    "t-cut": ["rambles", "hostile", "wrong"],
}


def _crash(prompt):  # a sampler that fails: the episode's infrastructure error
    raise RuntimeError("sampler went away")


async def plan_groups(scripted, renderer, plan: dict[str, list[str]]) -> list[TrajectoryGroup]:
    """The scored groups of `plan` (task -> the `REPLIES` kind of each episode) on `AddEnv("2+3?", "5.")`."""

    async def one(kind: str, task_id: str, index: int) -> Trajectory:
        return await play_episode(AddEnv("2+3?", "5."), scripted(REPLIES.get(kind, _crash)), renderer,
                                  EpisodeLimits(max_tokens_per_turn=48), task_id, index)

    return [TrajectoryGroup(task, scored([await one(kind, task, i) for i, kind in enumerate(kinds)]))
            for task, kinds in plan.items()]


# -- the training loop on a scripted sampler ---------------------------------------------------------------------------
# (`trainer` is imported where used: its ~10 s of imports are paid only by the tests that run the loop)
def here(run, sampler) -> LocalPlayers:
    """`run`'s episodes played in this process through `sampler`, with the run's environments and renderer."""
    return LocalPlayers(run.session.env.make_env, sampler, run.session.renderer)


def not_here(sampler, renderer) -> LocalPlayers:
    """Players for a `rollout_workers` call with workers: never asked to play here (their environment says so)."""

    def no_env(task):
        raise AssertionError("an episode played here, where the workers should have played it")

    return LocalPlayers(no_env, sampler, renderer)


FAST_S = 0.01  # one request of an ordinary task; "snails" takes 10x that


def slow_snails(prompt: str) -> float:
    """A request's time: 10x `FAST_S` for the task about snails."""
    return 10 * FAST_S if "snails" in prompt else FAST_S


def toy_tasks(n: int, slow: int | None = None) -> list[dict]:
    """`n` toy tasks about cats, task `slow` about snails."""
    return [{"id": f"t{i}", "topic": "snails" if i == slow else "cats"} for i in range(n)]


class TimedSampler:
    """Replies "a" x (1 + seed mod 29) after `delay(prompt text)` seconds, tagged with the version served now."""

    def __init__(self, renderer, delay, fail=lambda prompt: False):
        self.renderer, self.delay, self.fail, self.policy_version = renderer, delay, fail, 0

    async def sample(self, prompt_ids, params, messages=()):
        prompt = self.renderer.render_text(prompt_ids)
        await asyncio.sleep(self.delay(prompt))  # the request's time on a server: what the stream schedules around
        if self.fail(prompt):
            raise SamplerError("server down")
        ids = [*self.renderer.encode_reply("a" * (1 + params.seed % 29)), self.renderer.stop_token_ids[0]]
        return Completion(tuple(ids), (-0.5,) * len(ids), "stop", self.policy_version)


class VersionSync:
    """A push makes the servers sample with the new version, and the episodes in flight go on."""

    def __init__(self, sampler):
        self.sampler = sampler

    async def push(self, model, version):
        self.sampler.policy_version = version
        return 0.0

    async def finish(self):
        pass


def scripted_run(tmp_path, smol_dir, renderer, tasks, *sets: str):
    """A `trainer.Run` of 8 steps x 3 toy tasks x 2 one-turn episodes, `sets` on top, on a one-weight policy."""
    import torch

    from agent_rl import trainer
    from agent_rl.config.file import load_config
    from agent_rl.learn.policy import Policy
    from agent_rl.rollout.runner import EpisodeLimits
    from agent_rl.session import Session, env_of

    env = [] if any(x.startswith("rollout.envs=") for x in sets) else ["rollout.env=toy"]
    cfg = load_config(None, [*env, "rollout.tasks_per_step=3", "rollout.group_size=2",
                             "rollout.max_turns=1", "run.steps=8", "run.seed=3", f"run.run_dir={tmp_path}",
                             "run.save_every=100", "run.tensorboard=false", "run.trace_groups=0", *sets])
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    return trainer.Run(cfg, tmp_path, Session(cfg, smol_dir, renderer, env_of(cfg)), policy, trainer.TaskStream(tasks),
                       EpisodeLimits.from_config(cfg.rollout))


async def run_loop(run, sampler, *, players=None, sync=None, train_s: float = 0.005, after_update=None):
    """`trainer.loop` with a scripted update: each step's groups (as the advantages got them) and metrics lines."""
    # `train_s`: each update's time, `after_update()` then runs in its thread; episodes played by `players`
    # (default: here, through `sampler`), pushes by `sync` (default: `VersionSync`)
    from agent_rl import trainer
    from agent_rl.learn.advantages import group_advantages
    from agent_rl.runs.runlog import RunLogger

    seen = []

    def advantages(groups, advantage_fn, credit):
        seen.append(groups)
        return group_advantages(groups, advantage_fn, credit)

    def update(policy, batch, algo, optim, temperature, seed, version):
        if train_s:
            time.sleep(train_s)  # a step's training time, in which the stream runs ahead
        policy.optimizer.step()  # no gradients: nothing moves (the loop steps the schedule after it)
        if after_update is not None:
            after_update()
        return {"loss": 0.0}

    with RunLogger(run.run_dir, run.cfg.run.steps, tensorboard=False, progress=False) as log:
        stages = trainer.Stages(advantages=advantages, update=update)
        await trainer.loop(run, players or here(run, sampler), sync or VersionSync(sampler), log, stages)
    return seen, [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]


# -- the update on the tiny model; runs against the test server --------------------------------------------------------
LOGPROB_TOL = 1e-4  # max abs gap server vs trainer, fp32 on CPU (observed ~1e-6; tests/test_weight_sync.py's bound)


@dataclass
class Row:
    """A sequence as `collate` reads it, with no episode around it."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...] = ()


def tiny_config(tiny_dir, **sets):
    """A config on the tiny model (LoRA rank 8, lr 0.05, 2 tasks x 4 episodes a step), `sets` on top."""
    from agent_rl.config.file import load_config

    base = {"model.name": str(tiny_dir), "model.lora_rank": 8, "model.lora_alpha": 16, "optim.lr": 0.05,
            "rollout.tasks_per_step": 2, "rollout.group_size": 4}
    return load_config(None, [f"{k}={v}" for k, v in {**base, **sets}.items()])


def make_batch(policy, sampler_shift: float = 0.0, rows: int = 8, length: int = 24):
    """`rows` sequences: a 6-token prompt, sampled tokens at the model's log-probs + `sampler_shift`, advantages ±2."""
    # advantages +2 / -2 alternating: strong, so a large learning rate pushes ratios past any clip range
    import torch

    from agent_rl.learn.batching import collate
    from agent_rl.learn.logprobs import token_logprobs

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (rows, length), generator=gen)
    with torch.no_grad():
        logp = token_logprobs(policy.model, ids, torch.ones_like(ids)).logp_B_T
    out = []
    for b in range(rows):
        n = length - b % 3  # different lengths: padding in every micro-batch
        mask = [0] * 6 + [1] * (n - 6)
        lp = [0.0] + [float(logp[b, t - 1]) + sampler_shift if mask[t] else 0.0 for t in range(1, n)]
        out.append(Row(tuple(ids[b, :n].tolist()), tuple(mask), tuple(lp)))
    return collate(out, [2.0 if b % 2 == 0 else -2.0 for b in range(rows)])


def server_config(server, run_dir: Path, steps: int, **extra: str):
    """A LoRA run of `steps` steps of 2 toy tasks x 4 episodes against `server`, `extra` on top."""
    from agent_rl.config.file import load_config

    sets = {
        "model.name": str(server.model_dir), "model.lora_rank": "8", "model.lora_alpha": "16",
        "sampler.server_urls": f"[{server.url}]", "sampler.max_model_len": "2048",
        "rollout.env": "toy", "rollout.tasks_per_step": "2", "rollout.group_size": "4", "rollout.max_turns": "1",
        "rollout.max_tokens_per_turn": "32", "rollout.max_total_tokens": "128", "optim.lr": "3e-3",
        "run.steps": str(steps), "run.run_dir": str(run_dir), "run.seed": "7", "run.tensorboard": "false", **extra,
    }
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def killed_after_step_2(monkeypatch, cfg) -> None:
    """Run `cfg` until its step-2 checkpoint is written, then stop it as a kill would."""
    from agent_rl import trainer

    original = trainer.save_checkpoint

    def save_then_die(run_dir, step, *args, **kwargs):
        path = original(run_dir, step, *args, **kwargs)
        if step == 2:
            raise KeyboardInterrupt("killed after step 2")
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(trainer.train(cfg))
    monkeypatch.setattr(trainer, "save_checkpoint", original)


def server_logprobs(url: str, model: str, ids: list[int]):
    """The server's log-prob of each of `ids` after the first, under `model` (vLLM's prompt_logprobs)."""
    import torch

    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = json.load(resp)
    entries = data["choices"][0]["prompt_logprobs"][1:]  # the first token has no prediction
    return torch.tensor([e[str(t)]["logprob"] for e, t in zip(entries, ids[1:])])


def served_name_of(url: str, adapter_dir: Path) -> str:
    """The name the server serves the adapter in `adapter_dir` under."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        cards = json.load(resp)["data"]
    names = [c["id"] for c in cards if Path(str(c.get("root", ""))).resolve() == adapter_dir.resolve()]
    assert len(names) == 1, cards
    return names[0]


# -- a stand-in vLLM server --------------------------------------------------------------------------------------------
TOKEN_S = 0.004  # seconds per sampled token


async def first_of(*events: asyncio.Event) -> None:
    """Until one of `events` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` served on a free local port: its runner (cleaned up by the caller) and its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


class StandInVLLM:
    """A stand-in vLLM server whose "weights" are a version number: each token it samples has log-prob -version.

    It does what vLLM 0.32's endpoints do (read in its source: `entrypoints/rl/online/api_router.py`,
    `v1/engine/core.py` `pause_scheduler`, `v1/engine/output_processor.py` `abort_requests`): a paused server
    queues new requests; `/pause?mode=abort` ends every running request with the tokens it has and finish_reason
    "abort"; `/abort_requests` with no ids ends every request it holds, queued ones with no tokens;
    `/collective_rpc reload_weights` swaps the weights; `/resume` runs the queue. Its tokens are 100 + their
    position in the sequence, so a request continued from its partial output must come out as one unbroken run.

    `slow_prompt`: a request whose prompt starts with it takes `slow_s` to reach the engine, or, with
    `slow_s=None`, reaches it only once a pause has come (a request still in transit then). `hold_at`: a request
    that has sampled that many tokens waits (counted in `held`) until it is aborted or `release` is set; a pause
    sets it. A test then knows where the requests are when its push comes, however late a loaded machine runs it:
    a fixed sleep let requests end before the push, or start after it."""

    def __init__(self, slow_prompt: int | None = None, slow_s: float | None = 0.0, hold_at: int | None = None):
        self.weights, self.paused, self.url = 1, False, ""
        self.adapters: set[str] = set()
        self.calls: list[str] = []
        self.running: dict[int, asyncio.Event] = {}  # request -> its abort flag
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.slow_prompt, self.slow_s = slow_prompt, slow_s
        self.hold_at, self.held = hold_at, 0
        self.release, self.pause_came = asyncio.Event(), asyncio.Event()
        self.served: list[tuple[tuple[int, ...], str, int]] = []  # (prompt, model, tokens) of each request

    def version_of(self, model: str) -> int:
        return int(model.rsplit("-v", 1)[1]) if "-v" in model else self.weights

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt, model = body["prompt"], body["model"]
        if self.slow_prompt is not None and prompt[0] == self.slow_prompt:
            await (self.pause_came.wait() if self.slow_s is None else asyncio.sleep(self.slow_s))
        abort = asyncio.Event()
        key = id(abort)
        self.running[key] = abort
        ids: list[int] = []
        lps: list[float] = []  # each token's, from the weights that sampled it
        finish = "length"
        try:
            while not self.resumed.is_set() and not abort.is_set():  # paused: queued
                await asyncio.wait([asyncio.ensure_future(self.resumed.wait()),
                                    asyncio.ensure_future(abort.wait())], return_when=asyncio.FIRST_COMPLETED)
            while len(ids) < body["max_tokens"] and not abort.is_set():
                if len(ids) == self.hold_at and not self.release.is_set():
                    self.held += 1
                    await first_of(self.release, abort)
                    self.held -= 1
                    continue
                await asyncio.sleep(TOKEN_S)
                if not abort.is_set():
                    ids.append(100 + len(prompt) + len(ids))
                    lps.append(-float(self.version_of(model)))
            if abort.is_set():
                finish = "abort"
        finally:
            del self.running[key]
        self.served.append((tuple(prompt), model, len(ids)))
        return web.json_response({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": lps},
                                               "finish_reason": finish, "prompt_token_ids": prompt}]})

    async def control(self, request: web.Request) -> web.Response:
        path = request.path_qs
        self.calls.append(path)
        body = await request.json() if request.can_read_body else {}
        if path == "/pause?mode=abort":
            self.paused = True
            self.resumed.clear()
            for flag in self.running.values():
                flag.set()
            self.release.set()
            self.pause_came.set()
        elif path == "/abort_requests":
            for flag in self.running.values():
                flag.set()
        elif path == "/collective_rpc":
            self.weights = int(Path(body["kwargs"]["weights_path"]).name.removeprefix("v"))
        elif path == "/resume":
            self.paused = False
            self.resumed.set()
        elif path == "/v1/load_lora_adapter":
            self.adapters.add(body["lora_name"])
        elif path == "/v1/unload_lora_adapter":
            self.adapters.discard(body["lora_name"])
        return web.json_response({})

    def routes(self, app: web.Application) -> None:
        """What the stand-in answers (a subclass adds its own before these: the last is a catch-all)."""
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/{path:.*}", self.control)

    async def __aenter__(self) -> StandInVLLM:
        app = web.Application()
        self.routes(app)
        self.runner, self.url = await serve_app(app)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


class SavesAFile:
    """What a weight sync needs of a model: `save_pretrained`, which writes a file."""

    def save_pretrained(self, folder, safe_serialization: bool) -> None:
        (folder / "model.safetensors").write_text("weights")


# -- processes ---------------------------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def accepts(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def mcp_over_http(argv: list[str], timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """The MCP server `argv` on a free port (`--http PORT`) once it listens: (process, URL); else killed, failed."""
    port = free_port()
    proc = subprocess.Popen([*argv, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until_sync(lambda: proc.poll() is not None or accepts(port), f"{argv[-1]} listening on port {port}",
                   timeout_s, every_s=0.05)
        assert proc.poll() is None, f"{argv[-1]} exited with status {proc.returncode} before it listened"
    except AssertionError:
        proc.kill()
        proc.wait(10)
        raise
    return proc, f"http://127.0.0.1:{port}/mcp"


# -- what a run or a command left; the documented commands -------------------------------------------------------------
def total(lines: list[dict], key: str) -> float:
    """`key` summed over a run's metrics lines (0 where a line lacks it)."""
    return sum(x.get(key, 0.0) for x in lines)


def essence(groups):
    """Each step's trajectories, everything but the seconds their reward took (a wall-clock figure)."""
    return [[(g.task_id, [replace(t, reward_s=0.0) for t in g.trajectories]) for g in step] for step in groups]


def one_error_line(capsys) -> str:
    """The one line a command wrote to stderr, which starts "error: "."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# the venv's console script, as a reader runs the documented commands; the arguments that keep a documented
# `rollout` or `train` line small against the test server (tests/test_readme_example.py, test_readme_mixture_judge.py)
AGENT_RL = Path(sys.executable).parent / "agent-rl"
SMALL_ROLLOUT = "--tasks 1 --group-size 2 --max-tokens 24 --max-turns 2"
SMALL_TRAIN = ("--set run.steps=1 --set rollout.tasks_per_step=1 --set rollout.group_size=2 --set rollout.max_turns=2 "
               "--set rollout.max_tokens_per_turn=24 --set rollout.max_total_tokens=1024 --set run.tensorboard=false "
               "--set model.lora_rank=4 --set model.lora_alpha=8 --set sampler.max_model_len=2048")


# -- sandboxes ---------------------------------------------------------------------------------------------------------
# set by .ci/run once its own Docker daemon is up: a Docker case that finds none then fails instead of skipping
REQUIRE_DOCKER = "AGENT_RL_REQUIRE_DOCKER"


def docker_or_skip() -> None:
    """Nothing where Docker with the sandbox image answers; else skip the case (fail it where REQUIRE_DOCKER is set)."""
    from agent_rl.tools.sandbox_docker import unavailable_reason

    if reason := unavailable_reason():
        if os.environ.get(REQUIRE_DOCKER):
            pytest.fail(f"docker unavailable although {REQUIRE_DOCKER} is set: {reason}", pytrace=False)
        pytest.skip(f"docker unavailable: {reason}")


def deadline_slack_s(backend) -> float:
    """How long past its deadline a killed sandbox call may end: the kill, and Docker's container start and removal."""
    # seconds for Docker on a loaded 2-core machine
    return 5.0 if backend.name == "docker" else 1.5
