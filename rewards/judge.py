"""An LLM judge: a model behind any OpenAI-compatible `/v1/chat/completions` ranks the answers of a group.

Owns: `LLMJudge` (one request per group: its prompt template filled with the task's question, the G final
answers and a reference answer where the task has one; the reply read as a ranking; scores from 1 for the
best answer down to 0 for the worst), `parse_ranking`, `rank_scores`, the cache of replies (in memory, and
as JSONL in `out_dir`, so that a resumed run gets the scores the first one got), the prompt template
written to `out_dir` once, and `DEFAULT_PROMPT`. An `LLMJudge` is also a TRL-style reward function over
the G completions of one task, so it can be a group term of a `Rubric`.
Does not own: when groups are judged and how the scores join the reward (`rewards.group`,
`rollout.runner`), starting servers.

A judge that cannot judge (unreachable, too slow, an HTTP error, a reply that is no ranking of 1..G)
logs one line saying why and scores the group neutral, 0.5 each: the same for every answer, so it
changes no advantage, and training goes on. A reply is cached before it is read, so a garbage reply is
asked for once; failed requests are not cached. A reply the server cut short (finish_reason "abort": a
weight push paused the run's own servers, `rollout.weight_sync.base`) is asked again, never cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent_rl.core.files import write_text
from agent_rl.core.http import SessionOwner
from agent_rl.rewards.rubric import Messages, final_reply

log = logging.getLogger(__name__)
NEUTRAL = 0.5

DEFAULT_PROMPT = """You are grading {n} answers to the same task.

Task:
{question}
{reference}
Answers:
{answers}

Rank all {n} answers from best to worst. A correct answer beats a wrong one; between answers that are
equally correct, the clearer and shorter one wins. Reply with the ranking only: the answer numbers
separated by ">", best first, for example "2 > 3 > 1" for three answers."""

_CHAIN = re.compile(r"\[?\d+\]?(?:\s*>\s*\[?\d+\]?)+")


class JudgeError(Exception):
    """The judge did not answer with a chat completion; the message says why, in one line."""


@dataclass(frozen=True)
class Verdict:
    scores: list[float]  # one per answer, in the answers' order
    ok: bool  # False: the neutral scores of a judge that could not judge
    reason: str = ""  # why not ok
    cached: bool = False


def parse_ranking(text: str, n: int) -> list[int] | None:
    """Answer indices (0-based), best first, from the last "a > b > ..." chain in `text` that ranks each
    of the answers 1..n exactly once; None when there is none."""
    for chain in reversed(_CHAIN.findall(text)):
        numbers = [int(x) for x in re.findall(r"\d+", chain)]
        if sorted(numbers) == list(range(1, n + 1)):
            return [k - 1 for k in numbers]
    return None


def rank_scores(ranking: Sequence[int]) -> list[float]:
    """Score of each answer (in answer order) from a ranking: 1 for the best, evenly down to 0 for the worst."""
    n = len(ranking)
    scores = [0.0] * n
    for place, answer in enumerate(ranking):
        scores[answer] = 1.0 - place / (n - 1) if n > 1 else NEUTRAL
    return scores


def question_of(prompt: Messages) -> str:
    """The task as the policy was asked it: the prompt's last user message."""
    users = [m for m in prompt if m.get("role") == "user"]
    return str((users or prompt or [{"content": ""}])[-1].get("content") or "")


class LLMJudge(SessionOwner):
    """Ranks a group's answers with the chat model `model` served at `url` (a base URL; /v1/chat/completions)."""

    def __init__(self, url: str, model: str = "base", *, prompt: str = DEFAULT_PROMPT,
                 out_dir: str | Path | None = None, reference: str | None = "answer", max_tokens: int = 128,
                 temperature: float = 0.0, timeout_s: float = 60.0, api_key: str | None = None, name: str = "judge",
                 max_answer_chars: int = 2000):
        missing = [p for p in ("{question}", "{answers}") if p not in prompt]
        if missing:
            raise ValueError(f"judge prompt template lacks {' and '.join(missing)} (placeholders: {{question}}, "
                             f"{{answers}}, {{n}}, {{reference}})")
        self.url, self.model, self.prompt, self.reference = url.rstrip("/"), model, prompt, reference
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s
        self.api_key, self.__name__, self.max_answer_chars = api_key, name, max_answer_chars
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.cache: dict[str, str] = {}
        self.stats: Counter[str] = Counter()  # requests, cache_hits, failures
        self.cache_path = None if out_dir is None else Path(out_dir) / "cache.jsonl"
        if out_dir is not None and self.cache_path is not None:
            write_text(Path(out_dir) / "prompt.txt", prompt)
            self.cache.update(_read_cache(self.cache_path))

    @property
    def name(self) -> str:
        return self.__name__

    async def __call__(self, prompts: Sequence[Messages], completions: Sequence[Messages],
                       **columns: Any) -> list[float]:
        """TRL-style group term: the G completions of one task (its columns repeated G times) -> G scores."""
        refs = columns.get(self.reference) if self.reference else None
        reference = None if not refs or refs[0] is None else str(refs[0])
        verdict = await self.judge(question_of(prompts[0]), [final_reply(c) for c in completions], reference)
        return verdict.scores

    async def judge(self, question: str, answers: Sequence[str], reference: str | None = None) -> Verdict:
        n = len(answers)
        if n < 2:
            return Verdict([NEUTRAL] * n, True)  # nothing to rank
        messages = [{"role": "user", "content": self.render(question, answers, reference)}]
        key = hashlib.sha256(json.dumps([self.model, messages, self.max_tokens, self.temperature]).encode()).hexdigest()
        reply = self.cache.get(key)
        cached = reply is not None
        self.stats["cache_hits" if cached else "requests"] += 1
        if reply is None:
            try:
                reply = await self._ask(messages)
            except JudgeError as e:
                return self._neutral(n, str(e))
            self._remember(key, reply)
        ranking = parse_ranking(reply, n)
        if ranking is None:
            return self._neutral(n, f"its reply ranks no permutation of answers 1..{n}: {reply[:160]!r}")
        return Verdict(rank_scores(ranking), True, cached=cached)

    def render(self, question: str, answers: Sequence[str], reference: str | None = None) -> str:
        """The prompt: the template's placeholders replaced (plain replacement: other braces stay as written)."""
        listed = "\n\n".join(f"[{i}] {_clip(a, self.max_answer_chars) if a.strip() else '(no final answer)'}"
                             for i, a in enumerate(answers, 1))
        ref = f"\nReference answer: {reference}\n" if reference else ""
        text = self.prompt
        for placeholder, value in (("{n}", str(len(answers))), ("{reference}", ref), ("{question}", question),
                                   ("{answers}", listed)):
            text = text.replace(placeholder, value)
        return text

    async def _ask(self, messages: list[dict[str, str]], tries: int = 3) -> str:
        """The judge's reply; one the server aborted (module doc) is asked again, `tries` times in all."""
        for _ in range(tries):
            content, finish = await self._post(messages)
            if finish != "abort":
                return content
        raise JudgeError(f"the judge at {self.url} aborted the request {tries} times in a row")

    async def _post(self, messages: list[dict[str, str]]) -> tuple[str, str | None]:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        endpoint = f"{self.url}/v1/chat/completions"
        try:
            async with self.http().post(endpoint, json=body, headers=headers) as resp:
                text = await resp.text()
        except TimeoutError:
            raise JudgeError(f"the judge at {self.url} did not answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise JudgeError(f"the judge at {self.url} is unreachable ({type(e).__name__}: {e})") from None
        if resp.status != 200:
            raise JudgeError(f"the judge at {endpoint} answered HTTP {resp.status}: {' '.join(text.split())[:200]}")
        try:
            choice = json.loads(text)["choices"][0]
            content, finish = choice["message"]["content"], choice.get("finish_reason")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise JudgeError(f"the judge at {endpoint} sent no chat completion: {text[:200]!r}") from None
        return str(content or ""), finish

    def _remember(self, key: str, reply: str) -> None:
        self.cache[key] = reply
        if self.cache_path is not None:
            with open(self.cache_path, "a") as f:
                f.write(json.dumps({"key": key, "reply": reply}) + "\n")

    def _neutral(self, n: int, reason: str) -> Verdict:
        self.stats["failures"] += 1
        log.warning("%s: %s; its group of %d answers scores %g each", self.name, reason, n, NEUTRAL)
        return Verdict([NEUTRAL] * n, False, reason)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " [...]"


def _read_cache(path: Path) -> dict[str, str]:
    """Replies a previous run cached; a line a kill cut short is skipped."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            out[str(entry["key"])] = str(entry["reply"])
        except (ValueError, KeyError, TypeError):
            continue
    return out
