"""Search QA: questions about countries, answered by searching an encyclopedia of country articles.

Owns: the country question dataset (`qa_dataset`: one- and two-hop questions from the knowledge-graph
generator as a `datasets.Dataset`, split by the country a question is about), the question episode
both country environments share (`CountryQAEnv`: task checks, prompt, reward), `SearchQAEnv` with its
`search` and `read_article` tools, the scripted solver `solve`, the audit target (with `country_choices`,
which `envs.kg_qa` shares) and the spec `ENV`.
Does not own: the facts and questions (`tools.countries`), the search index (`tools.search`),
answer matching (`rewards.qa`) or the knowledge-graph variant (`envs.kg_qa`).

Why `read_article` next to `search`: a search hit shows a 24-token snippet around the matched
words, which for about one question in ten leaves out the fact asked for (a long list of alternative
names pushes "Currency: LAK." out of the window). A good agent then opens the article; so can ours.

A task row: id, question, answer, answer_type (the graph type of the answer: city, region, subregion,
currency, ...), aliases (other accepted names), hops, facts ([subject, relation, object] per hop, in
reasoning order; the solver walks them, the reward does not read them).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import random
import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_rl.core.audit_target import ANSWERED, AuditTarget, Target
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, ToolCall
from agent_rl.envs.base import ToolEnv
from agent_rl.rewards.qa import final_answer, judge_answer, mentions, normalize
from agent_rl.tools.base import Tool, ToolError
from agent_rl.tools.countries import (
    INVERSE_SUFFIX,
    LITERAL_TYPES,
    RELATIONS,
    country_articles,
    country_triples,
    entity_key,
    qa_pairs,
)
from agent_rl.tools.search import DEFAULT_INDEX, LocalSearch, SearchIndex

if TYPE_CHECKING:
    import datasets

SYSTEM = ("Answer the question about countries with the encyclopedia tools: search shows snippets of the "
          "best matching articles, read_article shows a whole article. Some questions take two steps: first "
          "find the country the question describes, then look up the fact. When you know the answer, reply "
          "with only the answer inside <answer></answer>, written as the encyclopedia writes it, for example "
          "<answer>Paris</answer> or <answer>EUR</answer>.")
SPLITS = ("train", "eval")
EVAL_SHARE = 0.2  # of the countries; all questions about one country fall in one split
ARTICLE_CHARS = 800  # every fact precedes the province list, which is what gets cut
ENTITY_TYPES = frozenset(RELATIONS.values()) - LITERAL_TYPES  # "country" comes in through borders


# --- the dataset ---


def split_of(country: str) -> str:
    """"eval" for a fixed fifth of the countries (by a stable hash of the name), else "train"."""
    digest = hashlib.blake2b(entity_key(country).encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % 1000 < EVAL_SHARE * 1000 else "train"


def hop_path(facts: Sequence[Sequence[str]]) -> tuple[str, list[str]]:
    """The entity the question names and the relation to follow from it at each hop.

    "Which region is the country whose capital is Paris in?" has facts (France capital Paris),
    (France region Europe): the second fact starts at the first one's subject, so the question names
    the object and the first hop walks backwards: Paris -capital_of-> France -region-> Europe.
    """
    first = facts[0]
    if len(facts) > 1 and facts[1][0] == first[0]:
        return first[2], [first[1] + INVERSE_SUFFIX] + [f[1] for f in facts[1:]]
    return first[0], [f[1] for f in facts]


@functools.cache  # datasets are immutable: shuffle and select return new ones
def qa_dataset(split: str = "train", hops: int | None = None, prefix: str = "countries") -> datasets.Dataset:
    """Every generated question of one split, sorted by id; the same rows on every call.

    Args:
        split: "train" or "eval"; no country has questions in both.
        hops: 1 or 2 for only one- or two-hop questions; None for both.
        prefix: the start of every row id.
    """
    import datasets

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    triples = country_triples()
    intermediate: dict[str, list[str]] = {}
    for t in triples:
        if t.relation == "intermediate_region":
            intermediate.setdefault(t.subject, []).append(t.object)
    rows: list[Task] = []
    for qa in qa_pairs(triples, _question_count(triples, hops), seed=0, hops=hops):
        last = qa.triples[-1]
        about = qa.triples[0].subject  # the country whose facts the question starts from
        if split_of(about) != split:
            continue
        # a country's "subregion" and "intermediate_region" both answer "which subregion": the search
        # articles list them unlabelled ("in Caribbean, Latin America and the Caribbean, Americas")
        aliases = intermediate.get(last.subject, []) if last.relation == "subregion" else []
        rows.append({
            "id": f"{prefix}-{hashlib.blake2b(qa.question.encode(), digest_size=6).hexdigest()}",
            "question": qa.question, "answer": qa.answer, "answer_type": last.object_type,
            "aliases": [a for a in aliases if a != qa.answer], "hops": qa.hops,
            "facts": [[t.subject, t.relation, t.object] for t in qa.triples],
        })
    rows.sort(key=lambda r: r["id"])
    return datasets.Dataset.from_list(rows)


def _question_count(triples: list, hops: int | None) -> int:
    """How many questions `qa_pairs` can make; its error message is the only place that says so."""
    try:
        qa_pairs(triples, 10**9, hops=hops)
    except ValueError as e:
        if found := re.search(r"only (\d+) can be made", str(e)):
            return int(found.group(1))
        raise
    raise AssertionError("qa_pairs accepted an impossible count")


def load_tasks(n: int, seed: int = 0, split: str = "train", hops: int | None = None,
               prefix: str = "search-qa") -> list[Task]:
    """`n` questions of `split`, shuffled by `seed`."""
    ds = qa_dataset(split, hops=hops, prefix=prefix)
    if not 0 <= n <= len(ds):
        raise ValueError(f"asked for {n} tasks but the {split} split has {len(ds)} questions (hops={hops})")
    return ds.shuffle(seed=seed).select(range(n)).to_list()


@functools.cache
def candidate_names(entity_type: str) -> frozenset[str]:
    """Every entity of `entity_type` in the graph: what an answer of that type could have been."""
    triples = country_triples()
    return frozenset({t.object for t in triples if t.object_type == entity_type}
                     | {t.subject for t in triples if t.subject_type == entity_type})


@functools.cache
def articles() -> dict[str, tuple[str, str]]:
    """The articles the index is built from: entity key of the title -> (title, text)."""
    return {entity_key(a.title): (a.title, a.text) for a in country_articles()}


# --- the episode ---


def check_task(task: Task, env: str) -> None:
    """Raise a one-line ValueError naming the row and the column for anything the episode cannot use."""
    row = f"{env} task {task.get('id', '?')!r}"
    for key in ("question", "answer", "answer_type"):
        if key not in task:
            raise ValueError(f"{row} has no {key!r} column")
        if not isinstance(task[key], str) or not task[key].strip():
            raise ValueError(f"{row}: column {key!r} must be a non-empty string, got {task[key]!r}"[:300])
    if task["answer_type"] not in ENTITY_TYPES:
        raise ValueError(f"{row}: column 'answer_type' must be one of {', '.join(sorted(ENTITY_TYPES))}, "
                         f"got {task['answer_type']!r}"[:300])
    aliases = task.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{row}: column 'aliases' must be a list of strings, got {aliases!r}"[:300])
    if not isinstance(task.get("hops", 1), int) or task.get("hops", 1) < 1:
        raise ValueError(f"{row}: column 'hops' must be a positive integer, got {task['hops']!r}"[:300])


def grounded(final: str, accepted: Sequence[str], candidates: Collection[str],
             tool_messages: Sequence[Message]) -> bool:
    """Tool-grounded answer: the final answer names at least one known name (an accepted one or a
    candidate of the answer's type) and every name it gives appears, as whole words, in a successful
    tool result of the episode. Right or wrong alike: a grounded wrong answer read the wrong fact; an
    ungrounded right one was a guess (or memory) the tools did not back."""
    said = mentions(final_answer(final), [*accepted, *candidates])
    results = [m.content for m in tool_messages if not m.content.startswith("Error:")]
    return bool(said) and all(any(mentions(r, [name]) for r in results) for name in said)


class CountryQAEnv(ToolEnv):
    """One question; the episode ends when the model answers without a tool call. Reward 1 for the answer."""

    name = "country_qa"
    system = SYSTEM

    def __init__(self, task: Task, tools: Sequence[Callable[..., Any] | Tool]):
        check_task(task, self.name)
        super().__init__(tools)
        self.task = task
        self.accepted = [task["answer"], *task.get("aliases", [])]
        self.candidates = candidate_names(task["answer_type"])

    async def initial_messages(self) -> list[Message]:
        return [Message("system", self.system), Message("user", self.task["question"])]

    async def reward(self, messages: Sequence[Message]) -> Reward:
        final = messages[-1].content if messages and messages[-1].role == "assistant" else ""
        verdict = judge_answer(final, self.accepted, self.candidates)
        tool_messages = [m for m in messages if m.role == "tool"]
        return Reward(float(verdict.correct), {
            "correct": float(verdict.correct),
            "exact": float(verdict.exact),  # the bare answer, no sentence around it
            "hedged": float(verdict.hedged),  # the right name among other candidates: no credit
            "hops": float(self.task.get("hops", 1)),
            "tool_calls": float(len(tool_messages)),
            "tool_errors": float(sum(m.content.startswith("Error:") for m in tool_messages)),
            "grounded": float(grounded(final, self.accepted, self.candidates, tool_messages)),
        })


class SearchQAEnv(CountryQAEnv):
    """A country question with `search` and `read_article` over the article index at `index_path`."""

    name = "search_qa"

    def __init__(self, task: Task, index_path: str | Path = DEFAULT_INDEX):
        self.index = SearchIndex.open_or_build(index_path)
        try:
            super().__init__(task, [LocalSearch(self.index).search, self.read_article])
        except BaseException:  # a bad task row: close what was opened before saying so
            self.index.close()
            raise

    async def close(self) -> None:
        self.index.close()

    def read_article(self, title: str) -> str:
        """Read the whole encyclopedia article with this title, e.g. a title from the search results.

        Args:
            title: the article's title, e.g. "France".
        """
        by_key = articles()
        if entity_key(title) not in by_key:
            close = difflib.get_close_matches(entity_key(title), list(by_key), n=3, cutoff=0.6)
            hint = f" Closest titles: {', '.join(by_key[k][0] for k in close)}." if close else ""
            raise ToolError(f"no article titled {title!r}.{hint} Search first to find the exact title.")
        name, body = by_key[entity_key(title)]
        cut = f" … ({len(body) - ARTICLE_CHARS} more characters)" if len(body) > ARTICLE_CHARS else ""
        return f"{name}\n{body[:ARTICLE_CHARS]}{cut}"


def make_env(task: Task) -> SearchQAEnv:
    return SearchQAEnv(task)


# --- the scripted solver ---

_HIT = re.compile(r"^\[\d+\] (.+)\n(.+)$", re.MULTILINE)
# search queries per relation: region and subregion stand unlabelled in an article's first sentence
_QUERY = {"capital_of": "capital {}", "borders": "borders {}", "capital": "capital {}", "currency": "currency {}",
          "region": "{} is a country in", "subregion": "{} is a country in"}


def tool_responses(messages: Sequence[Message]) -> list[str]:
    """The tool outputs of the conversation, in order, error messages left out."""
    return [m.content for m in messages if m.role == "tool" and not m.content.startswith("Error:")]


def answer_text(task: Task) -> str:
    return f"<answer>{task['answer']}</answer>"


def say(text: str) -> Message:
    """A reply without tool calls."""
    return Message("assistant", text)


def call(name: str, **arguments: Any) -> Message:
    """A reply that is one tool call."""
    return Message("assistant", "", (ToolCall(name, arguments),))


def _pages(response: str) -> list[tuple[str, str]]:
    """(title, normalised text) of every search hit in a tool response, or of the one article read."""
    hits = _HIT.findall(response) or [response.partition("\n")[::2]]
    return [(title, f" {normalize(text.replace('**', ''))} ") for title, text in hits]


def _links(relation: str, entity: str, title: str, text: str) -> bool:
    """Whether the page `title` states that it is where `relation` leads from `entity`."""
    entity = normalize(entity)
    if relation == "capital_of":
        return f" capital is {entity} " in text
    return normalize(title) != entity and " borders " in text and f" {entity} " in text


def solve(task: Task, messages: Sequence[Message], direct: bool = False) -> Message:
    """The next reply of a careful searcher. Per hop one search; the country found is read off the
    results; an article is opened when no snippet shows what is needed."""
    if direct:
        return say(answer_text(task))
    entity, relations = hop_path(task["facts"])
    seen = iter(tool_responses(messages))
    for relation in relations[:-1]:  # find the country the question describes
        if (response := next(seen, None)) is None:
            return call("search", query=_QUERY[relation].format(entity), k=5)
        pages = _pages(response)
        found = next((title for title, text in pages if _links(relation, entity, title, text)), None)
        if found is None:  # open the first hit that names the entity, and check it there
            found = next((title for title, text in pages if f" {normalize(entity)} " in text), None)
            if found is not None and (response := next(seen, None)) is None:
                return call("read_article", title=found)
            if found is None or not _links(relation, entity, *_pages(response)[0]):
                return say("<answer>I could not find it.</answer>")
        entity = found
    if (response := next(seen, None)) is None:
        return call("search", query=_QUERY[relations[-1]].format(entity), k=3)
    text = dict(_pages(response)).get(entity, "")
    if not mentions(text, [task["answer"], *task.get("aliases", [])]) and next(seen, None) is None:
        return call("read_article", title=entity)
    return say(answer_text(task))


# --- the reward audit ---

def country_choices(task: Task) -> dict[str, Any]:
    """`gold`, `wrong`, `every` and `fmt` of a country question's audit `Target`: the answer, three other
    names of its type (drawn by the task id), every name of that type, in <answer> tags."""
    accepted = {task["answer"], *task.get("aliases", [])}
    others = sorted(candidate_names(task["answer_type"]) - accepted)
    wrong = random.Random(str(task["id"])).sample(others, min(3, len(others)))
    return {"gold": task["answer"], "wrong": tuple(wrong), "every": tuple(sorted({task["answer"], *others})),
            "fmt": "<answer>{}</answer>"}


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: a search for the question and the article holding
    the fact asked for, the answer as a search query."""
    article = task["facts"][-1][0]
    probes = (ToolCall("search", {"query": task["question"], "k": 5}), ToolCall("read_article", {"title": article}))
    return Target(task, task["question"], probes=probes, carrier=ToolCall("search", {"query": task["answer"], "k": 5}),
                  **country_choices(task))


ENV = EnvSpec("search_qa", make_env, load_tasks, solve=solve, audit=AuditTarget(ANSWERED, audit_target))
