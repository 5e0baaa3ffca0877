"""Rubrics: an explicit weighted list of reward functions, called the way TRL calls them.

Owns: `Rubric` (score one episode: total = sum(weight * value); every part reported by name;
weight-0 parts are metrics only; group terms score the G episodes of one task together: `score_group`),
`RewardTerm`, `Score`, checking what a reward function returns
(`RewardError`), and `final_reply` (the text a completion ends on).
Does not own: any particular reward (`rewards.answers`, `rewards.format`, `rewards.code`) or where
the prompt, completion and columns come from (`envs.dataset`).

The calling convention is TRL GRPOTrainer's, so its reward functions work here unchanged:

    fn(prompts=[...], completions=[...], **columns) -> list[float]    # may be `async def`

Every argument is a list with one entry per row: `prompts` and `completions` hold lists of message
dicts {"role", "content"} (conversational format) and each extra dataset column comes as a keyword
argument of the same name. An episode is one row, so here every list has length 1 and the function
must return exactly one number. The completion is every message after the prompt: the assistant's
turns and the tool messages between them. A group term (`RewardTerm(fn, weight, name, group=True)`, an
LLM judge that ranks answers, say) is called once per task with its G rows and returns G numbers;
`Rubric.score` leaves it out, `Rubric.score_group` calls only the group terms (through
`rewards.group.rubric_group_reward`, once the G episodes have ended). Sync functions run on the
event loop: keep them fast, or write them `async` (as `rewards.answers.correct_answer` is).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

RewardFn = Callable[..., Sequence[float] | Awaitable[Sequence[float]]]
Messages = list[dict[str, Any]]


class RewardError(ValueError):
    """A reward function failed or returned something that is not one number per completion."""


@dataclass(frozen=True)
class RewardTerm:
    fn: RewardFn
    weight: float  # 0.0: a metric, logged but not part of the reward
    name: str = ""  # defaults to fn.__name__; needed for lambdas and functools.partial
    group: bool = False  # called once with the G rows of a task's group (Rubric.score_group)


@dataclass(frozen=True)
class Score:
    total: float  # sum(weight * value)
    parts: dict[str, float]  # every term's unweighted value, by name


class Rubric:
    """Reward = sum(weight * fn(...)[0]) over an explicit list of `(fn, weight)` or `RewardTerm`s."""

    def __init__(self, terms: Sequence[RewardTerm | tuple[RewardFn, float]]):
        self.terms: list[RewardTerm] = []
        for item in terms:
            term = item if isinstance(item, RewardTerm) else RewardTerm(*item)
            name = term.name or getattr(term.fn, "__name__", "")
            if not name or name == "<lambda>":
                raise ValueError(f"reward function {term.fn!r} has no usable name: use RewardTerm(fn, weight, name)")
            if not isinstance(term.weight, numbers.Real) or not math.isfinite(term.weight):
                raise ValueError(f"reward function {name!r}: weight must be a finite number, got {term.weight!r}")
            self.terms.append(RewardTerm(term.fn, float(term.weight), name, term.group))
        names = [t.name for t in self.terms]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"duplicate reward names {dup}: give each a distinct RewardTerm name")
        if not self.terms:
            raise ValueError("a rubric needs at least one reward function")

    @property
    def group_terms(self) -> list[RewardTerm]:
        return [t for t in self.terms if t.group]

    async def score(self, prompt: Messages, completion: Messages, **columns: Any) -> Score:
        """Call every per-episode function on this one row; raise `RewardError` naming the function that failed."""
        [score] = await self._score([t for t in self.terms if not t.group], [prompt], [completion], columns)
        return score

    async def score_group(self, prompts: Sequence[Messages], completions: Sequence[Messages],
                          **columns: Any) -> list[Score]:
        """Call every group term once on the G rows of one task (its columns, the same for each row)."""
        return await self._score(self.group_terms, prompts, completions, columns)

    async def _score(self, terms: list[RewardTerm], prompts: Sequence[Messages], completions: Sequence[Messages],
                     columns: dict[str, Any]) -> list[Score]:
        for reserved in ("prompts", "completions"):
            if reserved in columns:
                raise RewardError(f"a dataset column may not be called {reserved!r} (TRL passes that argument itself)")
        n = len(completions)
        kwargs = {"prompts": list(prompts), "completions": list(completions),
                  **{k: [v] * n for k, v in columns.items()}}
        values = {term.name: await _call(term, kwargs, n) for term in terms}
        return [Score(sum(t.weight * values[t.name][i] for t in terms), {t.name: values[t.name][i] for t in terms})
                for i in range(n)]


async def _call(term: RewardTerm, kwargs: dict[str, Any], n: int) -> list[float]:
    try:
        out = term.fn(**kwargs)
        if inspect.isawaitable(out):
            out = await out
    except Exception as e:
        raise RewardError(f"reward function {term.name!r} raised {type(e).__name__}: {e}") from e
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardError(f"reward function {term.name!r} must return a list with one number per completion "
                          f"(here {n}), got {type(out).__name__}")
    if len(out) != n:
        raise RewardError(f"reward function {term.name!r} returned {len(out)} values for {n} "
                          f"completion{'s' if n != 1 else ''}")
    for value in out:
        if value is None or not isinstance(value, numbers.Real):
            raise RewardError(f"reward function {term.name!r} returned {value!r}, not a number")
        if not math.isfinite(value):
            raise RewardError(f"reward function {term.name!r} returned {value}, not a finite number")
    return [float(v) for v in out]


def final_reply(completion: str | Messages) -> str:
    """The text the completion ends on: the last message's content if the assistant wrote it, else ""
    (an episode cut after a tool message has no final reply). A plain string is its own reply."""
    if isinstance(completion, str):
        return completion
    if not completion or completion[-1].get("role") != "assistant":
        return ""
    return str(completion[-1].get("content") or "")
