"""Rubrics: an explicit weighted list of reward functions, called the way TRL calls them.

Owns: `Rubric` (score one episode: total = sum(weight * value); every part reported by name;
weight-0 parts are metrics only), `RewardTerm`, `Score`, checking what a reward function returns
(`RewardError`), and `final_reply` (the text a completion ends on).
Does not own: any particular reward (`rewards.answers`, `rewards.format`, `rewards.code`) or where
the prompt, completion and columns come from (`envs.dataset`).

The calling convention is TRL GRPOTrainer's, so its reward functions work here unchanged:

    fn(prompts=[...], completions=[...], **columns) -> list[float]    # may be `async def`

Every argument is a list with one entry per row: `prompts` and `completions` hold lists of message
dicts {"role", "content"} (conversational format) and each extra dataset column comes as a keyword
argument of the same name. An episode is one row, so here every list has length 1 and the function
must return exactly one number. The completion is every message after the prompt: the assistant's
turns and the tool messages between them. Sync functions run on the event loop: keep them fast,
or write them `async` (as `rewards.answers.correct_answer` is).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

RewardFn = Callable[..., Sequence[float] | Awaitable[Sequence[float]]]
Messages = list[dict[str, Any]]


class RewardError(ValueError):
    """A reward function failed or returned something that is not one number per completion."""


@dataclass(frozen=True)
class RewardTerm:
    fn: RewardFn
    weight: float  # 0.0: a metric, logged but not part of the reward
    name: str = ""  # defaults to fn.__name__; needed for lambdas and functools.partial


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
            self.terms.append(RewardTerm(term.fn, float(term.weight), name))
        names = [t.name for t in self.terms]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"duplicate reward names {dup}: give each a distinct RewardTerm name")
        if not self.terms:
            raise ValueError("a rubric needs at least one reward function")

    async def score(self, prompt: Messages, completion: Messages, **columns: Any) -> Score:
        """Call every function on this one row; raise `RewardError` naming the function that failed."""
        for reserved in ("prompts", "completions"):
            if reserved in columns:
                raise RewardError(f"a dataset column may not be called {reserved!r} (TRL passes that argument itself)")
        kwargs = {"prompts": [prompt], "completions": [completion], **{k: [v] for k, v in columns.items()}}
        parts: dict[str, float] = {}
        for term in self.terms:
            parts[term.name] = await _call(term, kwargs)
        return Score(sum(t.weight * parts[t.name] for t in self.terms), parts)


async def _call(term: RewardTerm, kwargs: dict[str, Any]) -> float:
    try:
        out = term.fn(**kwargs)
        if inspect.isawaitable(out):
            out = await out
    except Exception as e:
        raise RewardError(f"reward function {term.name!r} raised {type(e).__name__}: {e}") from e
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardError(f"reward function {term.name!r} must return a list with one number per completion "
                          f"(here 1), got {type(out).__name__}")
    if len(out) != 1:
        raise RewardError(f"reward function {term.name!r} returned {len(out)} values for 1 completion")
    value = out[0]
    if value is None or not isinstance(value, numbers.Real):
        raise RewardError(f"reward function {term.name!r} returned {value!r}, not a number")
    if not math.isfinite(value):
        raise RewardError(f"reward function {term.name!r} returned {value}, not a finite number")
    return float(value)


def final_reply(completion: str | Messages) -> str:
    """The text the completion ends on: the last message's content if the assistant wrote it, else ""
    (an episode cut after a tool message has no final reply). A plain string is its own reply."""
    if isinstance(completion, str):
        return completion
    if not completion or completion[-1].get("role") != "assistant":
        return ""
    return str(completion[-1].get("content") or "")
