"""The Berkeley Function Calling Leaderboard (BFCL) as an evaluation: our renderer and sampler, bfcl-eval's checker.

Owns: `BFCLSettings` (which categories, how many questions of each, episodes of each, sampling), `QuestionEnv`
(one single-turn question: its messages as the prompt, its functions as the episode's tools, one assistant turn),
`pick` (the fixed subset of a category), `evaluate_bfcl` (every policy on the picked questions through
`evaluate.play_policies`, each episode judged by bfcl-eval; each reply kept with its verdict), `score` (the
figures of a category) and `format_table`.
Does not own: bfcl-eval's process, data and checker (`bfcl_checker`, `bfcl_worker`), the multi-turn episode
(`bfcl_multi_turn`), rendering and parsing (the model family's renderer, as in training), playing episodes,
serving adapters.

How a single-turn question is played: its messages and its functions (as OpenAI tool schemas, converted by
bfcl-eval itself) go through the model's renderer exactly as an environment's tools do, so the model
sees BFCL's functions in the format it is trained on; one turn is sampled (BFCL's default
temperature, 0.001); the renderer's parse of that turn gives the calls. A call the parser cannot
read (malformed JSON, an unclosed tag) is left out, as BFCL's Qwen handler leaves out a block whose
JSON does not load; no call at all is the answer the irrelevance category asks for. The multi-turn
categories (`multi_turn_base`, `_miss_func`, `_miss_param`, `_long_context`; `multi_turn` names all four) are
played turn by turn against bfcl-eval's executable API classes (`bfcl_multi_turn`).

Never a training environment: BFCL's questions reach only this module, through bfcl-eval's worker,
and only `agent-rl eval --benchmark bfcl` asks for them; `core.registry` refuses `bfcl` and this
module as a `rollout.env`, and the spec built here has no `load_tasks` (it raises).

The subset: `per_category` questions of each category, evenly spaced over BFCL's own file order
(question floor(i * N / n) for i < n, N the category's size), the same every run. Each is played `samples`
times (default 1): accuracy is over the episodes, pass@k and pass^k over each question's.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from statistics import fmean
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent_rl.core.config import ConfigError
from agent_rl.core.env import Env, StepResult
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, StopReason, Trajectory, TrajectoryGroup
from agent_rl.evaluation.bfcl_checker import BFCLChecker, bfcl_calls
from agent_rl.evaluation.bfcl_multi_turn import MultiTurnEnv, Verdicts, replies_key, turn_limit
from agent_rl.evaluation.evaluate import pass_figures, play_policies, resolve_policy
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.runs.metrics import sampled_replies, violation_metrics
from agent_rl.session import Session

# an episode with its question and bfcl-eval's verdict on it (None: an infrastructure error)
Judged = tuple[dict[str, Any], Trajectory, dict[str, Any] | None]

# accepted names -> bfcl-eval's category names (the single-turn ones judged by its AST checker)
SINGLE_TURN = {"simple": "simple_python", "simple_python": "simple_python", "multiple": "multiple",
               "parallel": "parallel", "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance",
               "live_simple": "live_simple", "live_multiple": "live_multiple", "live_parallel": "live_parallel",
               "live_parallel_multiple": "live_parallel_multiple", "live_irrelevance": "live_irrelevance",
               "live_relevance": "live_relevance"}
MULTI_TURN = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
CATEGORIES: dict[str, tuple[str, ...]] = {**{k: (v,) for k, v in SINGLE_TURN.items()},
                                          **{c: (c,) for c in MULTI_TURN}, "multi_turn": MULTI_TURN}
DEFAULT_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")


class BFCLSettings(BaseModel):
    """What `agent-rl eval --benchmark bfcl` plays."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    categories: tuple[str, ...] = Field(DEFAULT_CATEGORIES, min_length=1,
                                        description="BFCL categories, e.g. simple, multiple, parallel-multiple")
    per_category: int = Field(20, ge=1, description="questions of each category, evenly spaced over its file")
    temperature: float = Field(0.001, gt=0.0, description="sampling temperature (BFCL's own default)")
    max_tokens: int = Field(256, ge=16, description="tokens the model may write in a turn")
    seed: int = Field(12345, description="base of the per-request sampling seeds")
    samples: int = Field(1, ge=1, description="episodes of each question (pass@k and pass^k over them)")

    @field_validator("categories", mode="before")
    @classmethod
    def _known(cls, value: Any) -> tuple[str, ...]:
        names = value.split(",") if isinstance(value, str) else list(value)
        out = []
        for name in names:
            key = str(name).strip().lower().replace("-", "_")
            if key not in CATEGORIES:
                raise ValueError(f"unknown BFCL category {name!r} (known: {', '.join(sorted(CATEGORIES))}; "
                                 "Java, JavaScript, web search, memory and format sensitivity are not supported)")
            out += [c for c in CATEGORIES[key] if c not in out]
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


def pick(questions: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` questions evenly spaced over the category (all of them when it has no more)."""
    total = len(questions)
    return [questions[i * total // n] for i in range(n)] if n < total else list(questions)


class QuestionEnv(Env):
    """One BFCL question: its functions as the tools, one assistant turn, bfcl-eval's verdict as reward."""

    def __init__(self, task: dict[str, Any], checker: BFCLChecker, verdicts: Verdicts):
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


async def judge(checker: BFCLChecker, verdicts: Verdicts, task: dict[str, Any], reply: Message) -> dict[str, Any]:
    """bfcl-eval's verdict on a single-turn reply, asked once per distinct answer (kept in `verdicts`)."""
    calls = bfcl_calls(reply)
    key = (task["id"], json.dumps(calls, sort_keys=True, default=str))
    if key not in verdicts:
        verdicts[key] = await checker.check(task["category"], task["id"], calls)
    return verdicts[key]


def make_env(task: dict[str, Any], checker: BFCLChecker, verdicts: Verdicts) -> Env:
    """The episode of a question: turn by turn for a multi-turn category, one turn otherwise."""
    if task["category"] in MULTI_TURN:
        return MultiTurnEnv(task, checker, verdicts)
    return QuestionEnv(task, checker, verdicts)


def _no_tasks(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    raise ValueError("BFCL's questions are for evaluation only: agent-rl eval --benchmark bfcl")


def _turns(task: dict[str, Any]) -> int:
    return turn_limit(task["question"]) if task["category"] in MULTI_TURN else 1


async def evaluate_bfcl(session: Session, specs: Sequence[str], serve: Callable[[Path], Any],
                        settings: BFCLSettings, python: str | None = None,
                        judged_out: dict[str, list[Judged]] | None = None) -> dict[str, Any]:
    """Every policy of `specs` (`evaluate.resolve_policy`) on the picked questions of each category, judged by
    bfcl-eval running on `python` (`bfcl_checker.bfcl_python` when None); returns {"bfcl": what was played,
    "results": {policy: {category: figures}}}. `judged_out`, when given, receives each policy's episodes with
    bfcl-eval's verdict on each (None: an infrastructure error), the replies `agent-rl eval` keeps."""
    policies = [resolve_policy(s) for s in specs]  # every bad path fails before any sampling
    async with BFCLChecker(python) as bfcl:
        tasks = [{"id": q["id"], "category": category, "question": q} for category in settings.categories
                 for q in pick(await bfcl.questions(category), settings.per_category)]
        limits = EpisodeLimits(max_turns=max(_turns(t) for t in tasks), max_tokens_per_turn=settings.max_tokens,
                               max_total_tokens=session.cfg.sampler.max_model_len, temperature=settings.temperature,
                               seed=settings.seed)
        check_lengths(session, tasks, limits)
        verdicts: Verdicts = {}
        spec = EnvSpec("bfcl", lambda task: make_env(task, bfcl, verdicts), _no_tasks)
        cfg = session.cfg.model_copy(update={"eval": session.cfg.eval.model_copy(update={"samples": settings.samples})})
        groups = await play_policies(replace(session, cfg=cfg, env=spec), policies, tasks, limits, serve)
        judged = {p.label: await verdicts_of(groups[p.label], tasks, bfcl, verdicts) for p in policies}
    results = {label: score(rows, session.renderer.calls_in_reasoning) for label, rows in judged.items()}
    if judged_out is not None:
        judged_out.update(judged)
    about = {"bfcl_eval": bfcl.version, "model": session.cfg.model.name, "renderer": session.renderer.name,
             **settings.model_dump(), "questions": {c: [t["id"] for t in tasks if t["category"] == c]
                                                    for c in settings.categories}}
    return {"bfcl": about, "results": results}


def check_lengths(session: Session, tasks: Sequence[dict[str, Any]], limits: EpisodeLimits) -> None:
    """Every first prompt leaves room for an answer in the server's context, or one line naming the first that
    does not."""
    for task in tasks:
        question = task["question"]
        opening = question["turns"][0] if task["category"] in MULTI_TURN else question["messages"]
        n = len(session.renderer.render([Message(m["role"], m["content"]) for m in opening], question["tools"]))
        if n + limits.max_tokens_per_turn > limits.max_total_tokens:
            raise ValueError(f"BFCL question {task['id']}: its prompt is {n} tokens, and with max_tokens "
                             f"{limits.max_tokens_per_turn} it does not fit sampler.max_model_len "
                             f"{limits.max_total_tokens}; raise sampler.max_model_len")


async def verdicts_of(groups: Sequence[TrajectoryGroup], tasks: Sequence[dict[str, Any]], checker: BFCLChecker,
                      verdicts: Verdicts) -> list[Judged]:
    """Each episode with its question and bfcl-eval's verdict (None: an infrastructure error, counted wrong)."""
    by_id = {t["id"]: t for t in tasks}
    out: list[Judged] = []
    for g in groups:
        task = by_id[g.task_id]
        for traj in g.trajectories:
            if traj.infra_error:
                out.append((task, traj, None))
            elif task["category"] in MULTI_TURN:  # filed by the episode's own reward
                out.append((task, traj, verdicts[replies_key(task["id"], [m for m in traj.messages
                                                                          if m.role == "assistant"])]))
            else:
                reply = traj.messages[-1] if traj.messages and traj.messages[-1].role == "assistant" \
                    else Message("assistant", "")
                out.append((task, traj, await judge(checker, verdicts, task, reply)))
    return out


def score(judged: Sequence[Judged], calls_in_reasoning: Callable[[str], int] = lambda text: 0) -> dict[str, Any]:
    """Per category: questions, episodes, correct, accuracy (over the episodes), pass@k and pass^k (over each
    question's episodes, k = 1 and the most episodes of a question), infrastructure errors (counted wrong), BFCL's
    error types, and how the model answered: episodes with at least one readable call, calls the parser could not
    read, sampled turns, and the share of turns with each violation of the call format (`runs.metrics`)."""
    out: dict[str, Any] = {}
    for category in dict.fromkeys(task["category"] for task, _, _ in judged):
        rows = [(task, traj, v) for task, traj, v in judged if task["category"] == category]
        ok = [(traj, v) for _, traj, v in rows if v is not None]
        errors = Counter(v["error_type"] or "unknown" for _, v in ok if not v["valid"])
        counts: dict[str, list[int]] = {}
        for task, _, v in rows:
            n_c = counts.setdefault(task["id"], [0, 0])
            n_c[0] += 1
            n_c[1] += int(v is not None and v["valid"])
        fig: dict[str, Any] = {
            "questions": len(counts), "episodes": len(rows), "correct": sum(c for _, c in counts.values()),
            "infra_errors": len(rows) - len(ok),
            "answered_with_calls": sum(any(bfcl_calls(r) for r in sampled_replies(traj)) for traj, _ in ok),
            "unreadable_calls": sum(not c.ok for traj, _ in ok for r in sampled_replies(traj) for c in r.tool_calls),
            "turns_mean": fmean(len(traj.turns) for traj, _ in ok) if ok else 0.0}
        fig["accuracy"] = fig["correct"] / fig["episodes"]
        fig.update(pass_figures([(n, c) for n, c in counts.values()], sorted({1, *(n for n, _ in counts.values())})))
        fig.update(violation_metrics([traj for traj, _ in ok], calls_in_reasoning))
        if fig["infra_errors"]:
            errors["infra_error"] = fig["infra_errors"]
            fig["first_infra_error"] = next(traj.error for _, traj, v in rows if v is None)
        fig["errors"] = dict(errors.most_common())
        out[category] = fig
    return out


def format_table(report: dict[str, Any]) -> str:
    """Accuracy per category (rows) and policy (columns), `0.450 (9/20)` (with several episodes a question, its
    pass^k beside it: `^4 0.300`), and the mean over categories."""
    results = report["results"]
    labels = list(results)
    categories = report["bfcl"]["categories"]
    rows = [["category", *labels]]
    for c in categories:
        rows.append([c, *(_cell(results[lb][c]) for lb in labels)])
    rows.append(["mean", *(f"{sum(results[lb][c]['accuracy'] for c in categories) / len(categories):.3f}"
                           for lb in labels)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _cell(fig: dict[str, Any]) -> str:
    k = max(int(key[len("pass^"):]) for key in fig if key.startswith("pass^"))
    cell = f"{fig['accuracy']:.3f} ({fig['correct']}/{fig['episodes']})"
    return cell + (f" ^{k} {fig[f'pass^{k}']:.3f}" if k > 1 else "")
