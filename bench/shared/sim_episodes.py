"""Calculator episodes on the simulated servers: the workload and a sampler whose replies are real token ids.

Owns: `Workload` (an episode's shape, where its calculator runs), `calculator_env` (the real environment, its
calculator in its worker or in the event loop), `SimSampler` (a `Sampler` timed by a `SimCluster`, doing
VLLMSampler's client-side work on each reply), the prefix cache's fingerprints, and `workload_shape` (an episode's
token counts, for the zero-overhead client).
Does not own: the servers (`sim_servers`), their responses' bytes (`sim_responses`), the runner, renderer,
environment and tool (the real ones), measuring (`sim_measure`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import Message, ToolCall
from agent_rl.envs.base import ToolEnv
from agent_rl.envs.calculator import SYSTEM, CalculatorEnv, arithmetic_tasks, calculator
from agent_rl.rollout.sampler import Completion, SamplingParams
from agent_rl.rollout.serving.vllm.sampler import read_response, request_body, response_completion
from bench.shared.sim_responses import Responses, ServerWork, token_pieces
from bench.shared.sim_servers import SimCluster

FILLER = ("Let me think about this step by step. First I read the question again, then I decide which "
          "tool helps, what arguments it needs, and how I will check the result before I answer. ")


@dataclass(frozen=True)
class Workload:
    """Episode shape: `turns` replies (all but the last call the calculator), filler tokens per reply; where the
    runner's calculator runs: "worker" (its own process, as shipped) or "loop" (called in the event loop, the
    same function and schema: what a turn costs the runner without the isolated tool path)."""

    turns: int = 3
    min_tokens: int = 96
    max_tokens: int = 416
    group_size: int = 8
    calculator: str = "worker"


async def calculator_in_loop(expression: str) -> str:
    return calculator(expression)


calculator_in_loop.__name__, calculator_in_loop.__doc__ = calculator.__name__, calculator.__doc__


def calculator_env(task: dict[str, Any], where: str) -> CalculatorEnv:
    """The real environment, its calculator where `where` says (`Workload.calculator`)."""
    env = CalculatorEnv(task)
    if where == "loop":
        ToolEnv.__init__(env, [calculator_in_loop])
    return env


class SimSampler:
    """A `Sampler` whose replies are real token ids and whose timing comes from a `SimCluster`.

    Turn t of an episode (t = assistant messages so far): filler tokens, then a calculator call on
    the question's expression, or, on the last turn, `<answer>{last tool result}</answer>`. The request's JSON
    is written and the response's read and checked as VLLMSampler does (not the socket I/O); the response itself,
    each reply's choice and the prefix cache's fingerprints are the servers' work, timed apart (`ServerWork`)."""

    def __init__(self, cluster: SimCluster, renderer: Renderer, work: Workload, seed: int = 0,
                 server: ServerWork | None = None):
        self.cluster, self.renderer, self.work = cluster, renderer, work
        self.server = server if server is not None else ServerWork()
        self.rng = random.Random(seed)
        self.policy_version = 0
        self.filler = renderer.encode(FILLER * (work.max_tokens // 20 + 1))[: work.max_tokens]
        self.stop = renderer.stop_token_ids[0]
        self.responses = Responses(self.filler, token_pieces(renderer))  # the servers' response JSON
        self.tails: dict[tuple[bool, str], list[int]] = {}  # (call?, text) -> the ids ending a reply: the
        # server's work, made once per text so that the client's CPU per turn does not count it

    def reply_plan(self, messages: Sequence[Message]) -> tuple[int, list[int]]:
        """How many filler tokens the reply starts with, and the ids that end it (call or answer, stop)."""
        turn = sum(1 for m in messages if m.role == "assistant")
        n = self.rng.randint(self.work.min_tokens, self.work.max_tokens)
        call = turn < self.work.turns - 1
        return n, self.ending(call, next(m.content for m in messages if m.role == "user") if call
                            else messages[-1].content)

    def ending(self, call: bool, text: str) -> list[int]:
        """The ids ending a reply: a calculator call on the question `text`, or the answer `text` (the last tool
        result); encoded once per text."""
        key = (call, text)
        if key not in self.tails:
            expression = text.removeprefix("What is ").removesuffix("?")
            tail = ("\n" + self.renderer.format_reply("", (ToolCall("calculator", {"expression": expression}),))
                    if call else f"\n<answer>{text.strip()}</answer>")
            self.tails[key] = [*self.renderer.encode(tail), self.stop]
        return self.tails[key]

    def prepare(self, tasks: Sequence[dict[str, Any]]) -> None:
        """The endings of every task's replies, made before the episodes start: the servers' work, which would
        otherwise fall in the measured window whenever a task with a new question begins."""
        for task in tasks:
            self.ending(True, task["question"])
            self.ending(False, calculator(task["expression"]))

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        server = self.server  # its work, timed apart: which reply, and the prefix cache's fingerprints
        n, tail = server.timed(self.reply_plan, messages)
        prompt = orjson.dumps(prompt_ids)
        request_body("sim", prompt, params)  # VLLMSampler's request body, written as it writes it
        conv = id(messages[0]) if messages else None  # the episode's first message object, one per episode
        await self.cluster.generate(conv, len(prompt_ids), n + len(tail),
                                    check=lambda k: server.timed(fingerprint, prompt_ids, k),
                                    tail=server.timed(reply_fingerprint, self.filler, n, tail))
        # the reply exists only once the server has answered, as with VLLMSampler's response
        raw = server.timed(self.responses.write, prompt, len(prompt_ids), n, tail)  # the server's work (the
        # ideal client's too): its echo is the request's JSON
        data = read_response(raw, "sim", prompt)  # read and checked as VLLMSampler does
        return response_completion(data, prompt_ids, self.policy_version, "sim")


def fingerprint(ids: Sequence[int], k: int) -> int:
    """What the simulated prefix cache compares of the context `ids[:k]`: its last 16 ids (the slice is the server's
    work too, timed with the hash)."""
    return hash(tuple(ids[k - 16:k]))


def reply_fingerprint(filler: Sequence[int], n: int, tail: Sequence[int]) -> int:
    """The fingerprint of a reply of `n` filler ids and then `tail`: its last 16 ids (`fingerprint`'s next time)."""
    return hash(tuple([*filler[max(0, n - 16):n], *tail][-16:]))


def workload_shape(renderer: Renderer) -> dict[str, int]:
    """Token counts of a calculator episode's pieces: the ideal client's prompt and reply lengths."""
    task = arithmetic_tasks(3)[2]
    env = CalculatorEnv(task)
    call = renderer.format_reply("", (ToolCall("calculator", {"expression": task["expression"]}),))
    system = [Message("system", SYSTEM)]
    return {"prompt": len(renderer.render([*system, Message("user", task["question"])], env.tool_schemas)),
            "system": len(renderer.render(system, env.tool_schemas, add_generation_prompt=False)),
            "call": len(renderer.encode("\n" + call)) + 1,
            "answer": len(renderer.encode(f"\n<answer>{task['answer']}</answer>")) + 1,
            "continuation": len(renderer.continuation([Message("tool", str(task["answer"]), name="calculator")]))}
