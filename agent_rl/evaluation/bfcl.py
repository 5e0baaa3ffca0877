"""The Berkeley Function Calling Leaderboard (BFCL) as an evaluation: our renderer and sampler, bfcl-eval's checker.

Owns: `BFCLSettings` (which categories, how many questions of each, sampling), `bfcl_calls` (the
calls the renderer parsed out of a reply, in BFCL's decoded form `[{name: {arg: value}}]`), `QuestionEnv`
(one question: its messages as the prompt, its functions as the episode's tools, one assistant turn),
`pick` (the fixed subset of a category), `evaluate_bfcl` (every policy on the picked questions through
`evaluate.play_policies`, each answer judged by bfcl-eval) and `format_table`.
Does not own: bfcl-eval's process, data and checker (`bfcl_checker`, `bfcl_worker`), rendering and
parsing (the model family's renderer, as in training), playing episodes, serving adapters.

How a question is played: its messages and its functions (as OpenAI tool schemas, converted by
bfcl-eval itself) go through the model's renderer exactly as an environment's tools do, so the model
sees BFCL's functions in the format it is trained on; one turn is sampled (BFCL's default
temperature, 0.001); the renderer's parse of that turn gives the calls. A call the parser cannot
read (malformed JSON, an unclosed tag) is left out, as BFCL's Qwen handler leaves out a block whose
JSON does not load; no call at all is the answer the irrelevance category asks for.

Never a training environment: BFCL's questions reach only this module, through bfcl-eval's worker,
and only `agent-rl eval --benchmark bfcl` asks for them; `core.registry` refuses `bfcl` and this
module as a `rollout.env`, and the spec built here has no `load_tasks` (it raises).

The subset: `per_category` questions of each category, evenly spaced over BFCL's own file order
(question floor(i * N / n) for i < n, N the category's size), the same every run.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent_rl.core.config import ConfigError
from agent_rl.core.env import Env, StepResult
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, StopReason, Trajectory, TrajectoryGroup
from agent_rl.evaluation.bfcl_checker import BFCLChecker
from agent_rl.evaluation.evaluate import play_policies, resolve_policy
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.session import Session

# accepted names -> bfcl-eval's category names (the single-turn ones judged by its AST checker)
CATEGORIES = {"simple": "simple_python", "simple_python": "simple_python", "multiple": "multiple",
              "parallel": "parallel", "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance",
              "live_simple": "live_simple", "live_multiple": "live_multiple", "live_parallel": "live_parallel",
              "live_parallel_multiple": "live_parallel_multiple", "live_irrelevance": "live_irrelevance",
              "live_relevance": "live_relevance"}
DEFAULT_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")


class BFCLSettings(BaseModel):
    """What `agent-rl eval --benchmark bfcl` plays."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    categories: tuple[str, ...] = Field(DEFAULT_CATEGORIES, min_length=1,
                                        description="BFCL categories, e.g. simple, multiple, parallel-multiple")
    per_category: int = Field(20, ge=1, description="questions of each category, evenly spaced over its file")
    temperature: float = Field(0.001, gt=0.0, description="sampling temperature (BFCL's own default)")
    max_tokens: int = Field(256, ge=16, description="tokens the model may write in its one turn")
    seed: int = Field(12345, description="base of the per-request sampling seeds")

    @field_validator("categories", mode="before")
    @classmethod
    def _known(cls, value: Any) -> tuple[str, ...]:
        names = value.split(",") if isinstance(value, str) else list(value)
        out = []
        for name in names:
            key = str(name).strip().lower().replace("-", "_")
            if key not in CATEGORIES:
                raise ValueError(f"unknown BFCL category {name!r} (known: {', '.join(sorted(CATEGORIES))}; "
                                 "multi-turn, Java and JavaScript ones are not supported)")
            if CATEGORIES[key] not in out:
                out.append(CATEGORIES[key])
        return tuple(out)


def bfcl_settings(**values: Any) -> BFCLSettings:
    """`BFCLSettings(**values)`; a bad value is a ConfigError line naming the field."""
    try:
        return BFCLSettings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        problem = msg if err["type"] == "value_error" else f"{msg} (got {err.get('input')!r})"
        raise ConfigError(f"bfcl.{field}", problem) from None


def bfcl_calls(reply: Message) -> list[dict[str, Any]]:
    """The reply's readable calls as BFCL decodes a model's output: `[{name: {argument: value}}]`."""
    return [{call.name: dict(call.arguments)} for call in reply.tool_calls if call.ok]


def pick(questions: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` questions evenly spaced over the category (all of them when it has no more)."""
    total = len(questions)
    return [questions[i * total // n] for i in range(n)] if n < total else list(questions)


class QuestionEnv(Env):
    """One BFCL question: its functions as the tools, one assistant turn, bfcl-eval's verdict as reward."""

    def __init__(self, task: dict[str, Any], checker: BFCLChecker, verdicts: dict[tuple[str, str], dict[str, Any]]):
        self.task, self.checker, self.verdicts = task, checker, verdicts

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self.task["question"]["tools"])

    async def initial_messages(self) -> list[Message]:
        return [Message(m["role"], m["content"]) for m in self.task["question"]["messages"]]

    async def step(self, reply: Message, turn: int) -> StepResult:
        return StepResult(done=True, stop_reason=StopReason.ENV_DONE if reply.tool_calls else StopReason.NO_TOOL_CALL)

    async def reward(self, messages: Sequence[Message]) -> Reward:
        reply = messages[-1] if messages and messages[-1].role == "assistant" else Message("assistant", "")
        verdict = await judge(self.checker, self.verdicts, self.task, reply)
        valid = float(verdict["valid"])
        return Reward(valid, {"valid": valid, "calls": float(len(bfcl_calls(reply))),
                              "unreadable_calls": float(sum(not c.ok for c in reply.tool_calls))})


async def judge(checker: BFCLChecker, verdicts: dict[tuple[str, str], dict[str, Any]], task: dict[str, Any],
                reply: Message) -> dict[str, Any]:
    """bfcl-eval's verdict on a reply, asked once per distinct answer (kept in `verdicts`)."""
    calls = bfcl_calls(reply)
    key = (task["id"], json.dumps(calls, sort_keys=True, default=str))
    if key not in verdicts:
        verdicts[key] = await checker.check(task["category"], task["id"], calls)
    return verdicts[key]


def _no_tasks(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    raise ValueError("BFCL's questions are for evaluation only: agent-rl eval --benchmark bfcl")


async def evaluate_bfcl(session: Session, specs: Sequence[str], serve: Callable[[Path], Any],
                        settings: BFCLSettings, python: str | None = None) -> dict[str, Any]:
    """Every policy of `specs` (`evaluate.resolve_policy`) on the picked questions of each category, judged by
    bfcl-eval running on `python` (`bfcl_checker.bfcl_python` when None); returns {"bfcl": what was played,
    "results": {policy: {category: figures}}}."""
    policies = [resolve_policy(s) for s in specs]  # every bad path fails before any sampling
    async with BFCLChecker(python) as bfcl:
        tasks = [{"id": q["id"], "category": category, "question": q} for category in settings.categories
                 for q in pick(await bfcl.questions(category), settings.per_category)]
        limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=settings.max_tokens,
                               max_total_tokens=session.cfg.sampler.max_model_len, temperature=settings.temperature,
                               seed=settings.seed)
        check_lengths(session, tasks, limits)
        verdicts: dict[tuple[str, str], dict[str, Any]] = {}
        spec = EnvSpec("bfcl", lambda task: QuestionEnv(task, bfcl, verdicts), _no_tasks)
        cfg = session.cfg.model_copy(update={"eval": session.cfg.eval.model_copy(update={"samples": 1})})
        groups = await play_policies(replace(session, cfg=cfg, env=spec), policies, tasks, limits, serve)
        results = {p.label: await score(groups[p.label], tasks, bfcl, verdicts) for p in policies}
    about = {"bfcl_eval": bfcl.version, "model": session.cfg.model.name, "renderer": session.renderer.name,
             **settings.model_dump(), "questions": {c: [t["id"] for t in tasks if t["category"] == c]
                                                    for c in settings.categories}}
    return {"bfcl": about, "results": results}


def check_lengths(session: Session, tasks: Sequence[dict[str, Any]], limits: EpisodeLimits) -> None:
    """Every prompt leaves room for the answer in the server's context, or one line naming the first that does not."""
    for task in tasks:
        env_prompt = [Message(m["role"], m["content"]) for m in task["question"]["messages"]]
        n = len(session.renderer.render(env_prompt, task["question"]["tools"]))
        if n + limits.max_tokens_per_turn > limits.max_total_tokens:
            raise ValueError(f"BFCL question {task['id']}: its prompt is {n} tokens, and with max_tokens "
                             f"{limits.max_tokens_per_turn} it does not fit sampler.max_model_len "
                             f"{limits.max_total_tokens}; raise sampler.max_model_len")


async def score(groups: Sequence[TrajectoryGroup], tasks: Sequence[dict[str, Any]], checker: BFCLChecker,
                verdicts: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per category: questions, correct, accuracy, infrastructure errors (counted wrong), BFCL's error types, and
    how the model answered: questions with at least one readable call, calls the parser could not read."""
    by_id = {t["id"]: t for t in tasks}
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        task, traj = by_id[g.task_id], g.trajectories[0]
        fig = out.setdefault(task["category"], {"questions": 0, "correct": 0, "infra_errors": 0, "errors": Counter(),
                                                "answered_with_calls": 0, "unreadable_calls": 0})
        fig["questions"] += 1
        if traj.infra_error:
            fig["infra_errors"] += 1
            fig["errors"]["infra_error"] += 1
            fig.setdefault("first_infra_error", traj.error)
            continue
        reply = _reply(traj)
        fig["answered_with_calls"] += int(bool(bfcl_calls(reply)))
        fig["unreadable_calls"] += sum(not c.ok for c in reply.tool_calls)
        verdict = await judge(checker, verdicts, task, reply)
        fig["correct"] += int(verdict["valid"])
        if not verdict["valid"]:
            fig["errors"][verdict["error_type"] or "unknown"] += 1
    for fig in out.values():
        fig["accuracy"] = fig["correct"] / fig["questions"]
        fig["errors"] = dict(fig["errors"].most_common())
    return out


def _reply(traj: Trajectory) -> Message:
    last = traj.messages[-1] if traj.messages else None
    return last if last is not None and last.role == "assistant" else Message("assistant", "")


def format_table(report: dict[str, Any]) -> str:
    """Accuracy per category (rows) and policy (columns), `0.450 (9/20)`, and the mean over categories."""
    results = report["results"]
    labels = list(results)
    categories = report["bfcl"]["categories"]
    rows = [["category", *labels]]
    for c in categories:
        rows.append([c, *(f"{results[lb][c]['accuracy']:.3f} ({results[lb][c]['correct']}/"
                          f"{results[lb][c]['questions']})" for lb in labels)])
    rows.append(["mean", *(f"{sum(results[lb][c]['accuracy'] for c in categories) / len(categories):.3f}"
                           for lb in labels)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                     for r in rows)
