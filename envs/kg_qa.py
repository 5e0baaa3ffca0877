"""Knowledge-graph QA: two-hop questions about countries, answered through the knowledge-graph HTTP API.

Owns: `KGQAEnv` (the country question episode of `envs.search_qa` with the `KGClient` tools
search_entities, get_relations and follow), the process's own knowledge-graph service
(`local_kg_url`), the scripted solver `solve`, the audit target and the spec `ENV`.
Does not own: the questions and the reward (`envs.search_qa`, `rewards.qa`), the service and the
client (`tools.kg_service`, `tools.kg`).

Where the service comes from: a task row may carry `kg_url` (a service you run yourself, e.g.
`agent-rl kg serve`); without it the env uses `local_kg_url()`, which starts one service per
process on first use, on a daemon thread with its own event loop, and returns the same URL after.
A thread rather than the caller's loop because one process plays many loops (each `asyncio.run`
of the CLI, the trainer, a test session) and the service must outlive all of them; it also keeps
request handling off the rollout loop. The first env of a process waits for the start (the graph
file is built once, then reopened far faster). Each env owns one `KGClient` and closes it.

What an empty lookup returns: a row's `kg_empty_results` column, "explain" (the default: the
service's explanation, e.g. the closest names) or "bare" (a plain `[]`; see `tools.kg`).
`load_tasks(..., empty_results="bare")` writes that column into every row, so a config sets it with
`rollout.env_args: {empty_results: bare}` (the collapse study's second arm).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent_rl.core.audit_target import ANSWERED, AuditTarget, Target
from agent_rl.core.env import Task
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, ToolCall, ToolCallRecord
from agent_rl.envs.base import TURN_PENALTY, turn_rewards_on, with_turn_rewards
from agent_rl.envs.search_qa import (
    CountryQAEnv,
    answer_text,
    call,
    country_choices,
    hop_path,
    qa_dataset,
    say,
    tool_responses,
)
from agent_rl.tools.http_service import ProcessService
from agent_rl.tools.kg import EMPTY_RESULTS, KGClient
from agent_rl.tools.kg_service import DEFAULT_DB, start_kg_service

SYSTEM = ("Answer the question about countries with the knowledge-graph tools. follow(entity, relation) reads "
          "facts, e.g. follow(\"France\", \"capital\") gives Paris; a relation ending in _of goes backwards, e.g. "
          "follow(\"Paris\", \"capital_of\") gives France. The questions take two steps: first find the country "
          "the question describes, then read the fact. When you know the answer, reply with only the answer "
          "inside <answer></answer>, written as the graph writes it, for example <answer>Paris</answer>.")
START_DEADLINE_S = 120.0

_SERVICE = ProcessService("the knowledge-graph service", lambda: start_kg_service(DEFAULT_DB))  # deadlines inside


def local_kg_url(timeout_s: float = START_DEADLINE_S) -> str:
    """The URL of this process's knowledge-graph service over `DEFAULT_DB`, started on the first call."""
    return _SERVICE.get(timeout_s).url


class KGQAEnv(CountryQAEnv):
    """A country question with the knowledge-graph tools; the service at task["kg_url"] or this process's."""

    name = "kg_qa"
    system = SYSTEM

    def __init__(self, task: Task, timeout_s: float = 10.0):
        url = task.get("kg_url")
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"kg_qa task {task.get('id', '?')!r}: column 'kg_url' must be an http(s) URL, "
                             f"got {url!r}"[:300])
        empty = task.get("kg_empty_results", "explain")
        if empty not in EMPTY_RESULTS:
            raise ValueError(f"kg_qa task {task.get('id', '?')!r}: column 'kg_empty_results' must be one of "
                             f"{', '.join(EMPTY_RESULTS)}, got {empty!r}"[:300])
        # every request has this deadline
        self.client = KGClient(url or local_kg_url(), timeout_s=timeout_s, empty_results=empty)
        super().__init__(task, self.client.tools())
        self.turn_rewards = turn_rewards_on(task)
        self._empty_answers = 0  # the client's count when the last turn was rewarded

    def turn_reward(self, records: Sequence[ToolCallRecord]) -> Reward | None:
        """With turn rewards on (the task's `turn_rewards` column): -0.1 for each call of the turn that failed
        (`failed_call`: an unreadable call, an unknown tool or entity, an explained empty lookup...) and for
        each lookup that found nothing but was answered as a result (`empty_lookup`: a bare `[]`, a search
        with only close names); a call counts once."""
        if not self.turn_rewards:
            return None
        empty, self._empty_answers = self.client.empty_answers - self._empty_answers, self.client.empty_answers
        failed = sum(not r.ok for r in records)
        parts = {"failed_call": TURN_PENALTY * failed if failed else 0.0,
                 "empty_lookup": TURN_PENALTY * empty if empty else 0.0}
        return Reward(sum(parts.values()), parts)

    async def reward(self, messages: Sequence[Message]) -> Reward:
        """The country question's reward, plus `empty_lookups`: calls that found nothing (an unknown
        entity or relation, a search with only close names), told or not."""
        reward = await super().reward(messages)
        return Reward(reward.value, {**reward.parts, "empty_lookups": float(self.client.empty_lookups)})

    async def close(self) -> None:
        await self.client.close()


def make_env(task: Task) -> KGQAEnv:
    return KGQAEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train", empty_results: str = "explain",
               turn_rewards: bool = False) -> list[Task]:
    """`n` two-hop questions of `split` (train and eval ask about disjoint countries), shuffled by `seed`;
    `empty_results` ("explain" or "bare") goes into every row's `kg_empty_results` column; `turn_rewards`:
    a failed call or an empty lookup costs its turn 0.1 (`KGQAEnv.turn_reward`)."""
    if empty_results not in EMPTY_RESULTS:
        raise ValueError(f"kg_qa empty_results must be one of {', '.join(EMPTY_RESULTS)} (got {empty_results!r})")
    ds = qa_dataset(split, hops=2, prefix="kg-qa")
    if not 0 <= n <= len(ds):
        raise ValueError(f"asked for {n} tasks but the {split} split has {len(ds)} two-hop questions")
    rows = [{**row, "kg_empty_results": empty_results} for row in ds.shuffle(seed=seed).select(range(n)).to_list()]
    return with_turn_rewards(rows, turn_rewards)


# --- the scripted solver ---

_ENTITY = re.compile(r"(.+?) \[[^\]]+\](?:, |$)")  # "Palestine, State of [country], Israel [country]"


def _values(response: str) -> list[str]:
    """The entities a `follow` answer lists: "France capital: Paris [city]" -> ["Paris"]."""
    return _ENTITY.findall(response.partition(": ")[2].split(" … and ")[0])


def solve(task: Task, messages: Sequence[Message], direct: bool = False) -> Message:
    """The next reply of a careful agent: one `follow` per hop, each starting from the value the previous
    one returned; the answer is the value the last one returned."""
    if direct:
        return say(answer_text(task))
    entity, relations = hop_path(task["facts"])
    responses = tool_responses(messages)
    for response in responses[: len(relations)]:
        values = _values(response)
        if not values:
            return say("<answer>I could not find it.</answer>")
        entity = values[0]
    if len(responses) < len(relations):
        return call("follow", entity=entity, relation=relations[len(responses)])
    return say(f"<answer>{entity}</answer>")


def audit_target(task: Task, tasks: Sequence[Task]) -> Target:
    """The task as the reward audit's hacks see it: lookups of the question's entity and its first hop
    (not the answer), the answer as a search_entities name."""
    entity, relations = hop_path(task["facts"])
    probes = (ToolCall("search_entities", {"name": entity}), ToolCall("get_relations", {"entity": entity}),
              ToolCall("follow", {"entity": entity, "relation": relations[0]}))
    return Target(task, task["question"], probes=probes, carrier=ToolCall("search_entities", {"name": task["answer"]}),
                  **country_choices(task))


# the answer and tool hacks, and those on its turn rewards (`rollout.env_args: {turn_rewards: true}`)
ENV = EnvSpec("kg_qa", make_env, load_tasks, solve=solve, audit=AuditTarget((*ANSWERED, "turn"), audit_target))
