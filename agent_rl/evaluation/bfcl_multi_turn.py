"""BFCL's multi-turn categories, played turn by turn: our renderer and sampler, bfcl-eval's API classes and checker.

Owns: `MultiTurnEnv` (one multi-turn entry as an episode: its user turns one after another, each call run on the
episode's own instances of BFCL's executable API classes, BFCL's step limit per user turn, bfcl-eval's multi-turn
verdict as the reward), `turn_limit` (the sampled turns an entry may take at most) and `replies_key` (what a
verdict is filed under: the entry and the episode's replies).
Does not own: bfcl-eval's process, API classes and checker (`bfcl_worker`, through `bfcl_checker`), the calls a
reply holds (`bfcl_checker.bfcl_calls`: the renderer's parse), picking entries and scoring them (`bfcl`).

How an entry is played: as BFCL's generation step plays a locally served model
(`BaseHandler.inference_multi_turn_prompting`, bfcl-eval 2026.3.23):
- user turn k's message arrives; the model replies; a reply with readable calls is a step: its calls run on the
  episode's API instances (file system, messaging, trading, travel, vehicle, ...) and their results come back as
  tool messages, one per call in order, and the model replies again; a reply without a readable call ends the user
  turn (an unreadable call is left out, as BFCL's Qwen handler drops a block whose JSON does not load);
- a function-holdout turn (`miss_func`) has no user message in the data: BFCL's own message listing the
  held-out functions stands in for it (the worker writes it); the system prompt's tools stay as they were;
- more than `max_steps` (BFCL's MAXIMUM_STEP_LIMIT, 20) steps with calls in one user turn: BFCL forces the
  entry to quit, and the episode ends there;
- the episode's record, each user turn's steps with each step's readable calls, is judged by bfcl-eval's own
  multi-turn check: fewer user turns than the entry has is `multi_turn:force_terminated`; else, turn by turn,
  the state of every API instance and the execution results against the ground truth's.
Where ours differs, each by necessity: a reply cut at max_tokens ends the episode (the runner stitches nothing
after a cut turn), as does the context filling up; the user turns not played then count as force-terminated.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from agent_rl.core.env import Env, StepResult
from agent_rl.core.types import Message, Reward, StopReason, ToolCallRecord
from agent_rl.evaluation.bfcl_checker import BFCLChecker, BFCLError, bfcl_calls

# bfcl-eval's verdicts, filed by question and answer: a single-turn reply's calls, a multi-turn episode's replies
Verdicts = dict[tuple[str, Any], dict[str, Any]]


def turn_limit(question: dict[str, Any]) -> int:
    """The sampled turns an entry may take: per user turn, `max_steps` + 1 steps with calls (the last one forces
    the quit) or `max_steps` with calls and one without."""
    return len(question["turns"]) * (question["max_steps"] + 1)


def replies_key(task_id: str, replies: Sequence[Message]) -> tuple[str, tuple[str, ...]]:
    """What an episode's verdict is filed under: the entry and the texts of its replies (which fix its calls, and
    BFCL's executable classes and checker are deterministic)."""
    return task_id, tuple(m.content for m in replies)


def _failed(result: str) -> str | None:
    """The error of a call's result: the executor's exception, or an API method's `{"error": ...}`; else None."""
    if result.startswith("Error during execution"):
        return result
    try:
        parsed = json.loads(result)
    except ValueError:
        return None
    return str(parsed["error"]) if isinstance(parsed, dict) and "error" in parsed else None


class MultiTurnEnv(Env):
    """One BFCL multi-turn entry (module doc). `task` is {"id", "category", "question"}, the question as the
    worker gives it: {"turns", "tools", "holdout", "max_steps"}."""

    def __init__(self, task: dict[str, Any], checker: BFCLChecker, verdicts: Verdicts):
        self.task, self.checker, self.verdicts = task, checker, verdicts
        self.question = task["question"]
        self.episode = uuid.uuid4().hex  # the worker keeps this episode's API instances under it
        self.record: list[list[list[dict[str, Any]]]] = [[]]  # per user turn, per step: the step's calls
        self.steps = 0  # steps with calls in the current user turn
        self.checked = False

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self.question["tools"])

    def _messages(self, turn: int) -> list[Message]:
        return [Message(m["role"], m["content"]) for m in self.question["turns"][turn]]

    async def initial_messages(self) -> list[Message]:
        return self._messages(0)

    async def step(self, reply: Message, turn: int) -> StepResult:
        calls = bfcl_calls(reply)
        self.record[-1].append(calls)
        unreadable = tuple(ToolCallRecord("<invalid>", False, c.error, 0.0, turn) for c in reply.tool_calls if not c.ok)
        if not calls:  # the user turn ends; the next one begins, or the entry is done
            if len(self.record) == len(self.question["turns"]):
                return StepResult(done=True, stop_reason=StopReason.NO_TOOL_CALL, tool_calls=unreadable)
            self.record.append([])
            self.steps = 0
            return StepResult(messages=tuple(self._messages(len(self.record) - 1)), tool_calls=unreadable)
        t0 = time.perf_counter()
        results = await self.checker.execute(self.task["category"], self.task["id"], self.episode, calls)
        latency = (time.perf_counter() - t0) / len(calls)
        names = [next(iter(c)) for c in calls]
        records = tuple(ToolCallRecord(name, (error := _failed(r)) is None, error, latency, turn)
                        for name, r in zip(names, results))
        self.steps += 1
        if self.steps > self.question["max_steps"]:  # BFCL forces the entry to quit
            return StepResult(done=True, stop_reason=StopReason.ENV_DONE, tool_calls=unreadable + records)
        return StepResult(messages=tuple(Message("tool", r, name=n) for n, r in zip(names, results)),
                          tool_calls=unreadable + records)

    async def reward(self, messages: Sequence[Message]) -> Reward:
        verdict = await self.checker.check_turns(self.task["category"], self.task["id"], self.episode, self.record)
        self.checked = True
        replies = [m for m in messages if m.role == "assistant"]
        self.verdicts[replies_key(self.task["id"], replies)] = verdict
        valid = float(verdict["valid"])
        return Reward(valid, {"valid": valid, "user_turns": float(len(self.record)),
                              "steps": float(sum(bool(step) for turn in self.record for step in turn))})

    async def close(self) -> None:
        if not self.checked:  # ended before its verdict (an error, a cut turn): free its API instances
            try:
                await self.checker.forget(self.episode)
            except BFCLError:
                pass  # the worker is gone, and its instances with it
