"""A cold start from the policy's own episodes: play it with help, keep the episodes that used a tool and earned
their reward, and turn each into a demonstration without the help (`agent-rl bootstrap`; SFT then reads the file,
`sft.demos`, as it reads the scripted solver's).

Owns: `Help` (a hint the user writes, added to the system prompt; a worked example, messages placed before the
task; the opening of a call forced at the episode's first turn), `Helped` (an environment whose prompt carries the
hint and the example), `bootstrap` (play, keep, replay without the help; the yield), `in_parts` (a bootstrap a few
tasks at a time, each part kept as it ends, so a killed one goes on where it stopped), `without_help` (one kept
episode as the demonstration a policy without help would be trained on) and `help_from_file`.
Does not own: playing groups (`rollout.engine`), where they play (`session`), forcing the opening
(`rollout.branching.BranchSampler`), the demonstrations' file and SFT (`demos`, `sft`).

A demonstration without the help: the environment's own prompt, rendered as training renders it, then every
assistant turn's ids exactly as the helped episode sampled them (a forced opening included: in SFT it is a target,
the text the policy should learn to open its turn with), the tool outputs and the environment's other messages as
the environment gives them again. It is made by replaying the episode's turns in a fresh, unhelped environment
through the same runner that plays rollouts (`ReplaySampler`), so its ids and mask are those training would make of
the same messages; an episode whose replay does not end as it did (an environment that answers otherwise the second
time) is left out and counted (`diverged`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_rl.core.env import Env, StepResult
from agent_rl.core.files import write_lines
from agent_rl.core.registry import EnvSpec
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.types import EPISODE_REWARD, Branch, Message, Reward, Trajectory
from agent_rl.rollout.engine import Episodes, play_groups
from agent_rl.rollout.players import LocalPlayers, Players
from agent_rl.rollout.runner import EpisodeLimits
from agent_rl.rollout.sampler import Completion, SamplingParams


@dataclass(frozen=True)
class Help:
    """What the policy is helped with while it plays; none of it is in the demonstrations."""

    hint: str = ""  # added to the system prompt
    example: tuple[Message, ...] = ()  # a worked example, placed after the system prompt and before the task
    opening: tuple[int, ...] = ()  # ids forced at the start of the first turn (`Renderer.call_opening`): () none


def help_from_file(path: str | Path) -> Help:
    """A hint (plain text) or a worked example (a JSON list of {"role", "content"} messages) from a file the user
    wrote; a file that is neither is one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--hint: no file {str(path)!r}")
    text = path.read_text()
    if path.suffix != ".json":
        return Help(hint=text.strip())
    try:
        rows = json.loads(text)
        example = tuple(Message(str(r["role"]), str(r["content"])) for r in rows)  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--hint: {str(path)!r} is not a JSON list of {{\"role\", \"content\"}} messages "
                         f"({type(e).__name__}: {e})") from None
    bad = [m.role for m in example if m.role not in ("user", "assistant", "tool")]
    if bad or not example:
        raise ValueError(f"--hint: {str(path)!r}: a worked example holds user, assistant and tool messages "
                         f"(got {bad or 'none'})")
    return Help(example=example)


class Helped(Env):
    """`inner` with the hint added to its system prompt and the worked example before its task."""

    def __init__(self, inner: Env, help_: Help):
        self.inner, self.help = inner, help_
        self.tools = inner.tools

    async def __aenter__(self) -> Helped:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.inner.__aexit__(*exc)

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.inner.tool_schemas

    async def initial_messages(self) -> list[Message]:
        messages = list(await self.inner.initial_messages())
        system = [m for m in messages[:1] if m.role == "system"]
        rest = messages[len(system):]
        if self.help.hint:
            text = f"{system[0].content}\n\n{self.help.hint}" if system else self.help.hint
            system = [Message("system", text)]
        return [*system, *self.help.example, *rest]

    async def step(self, reply: Message, turn: int) -> StepResult:
        return await self.inner.step(reply, turn)

    async def reward(self, messages: Sequence[Message]) -> float | Reward:
        return await self.inner.reward(messages)

    async def state_key(self) -> str | None:
        return await self.inner.state_key()


class ReplaySampler:
    """Returns the given turns' ids, one a call, as sampled (every id a target): a kept episode replayed."""

    def __init__(self, turns: Sequence[tuple[int, ...]], stop_token_ids: Sequence[int]):
        self.turns, self.stops, self.next, self.policy_version = list(turns), set(stop_token_ids), 0, 0

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        if self.next >= len(self.turns):
            raise ValueError("the replay asked for more turns than the episode played")
        ids, self.next = self.turns[self.next], self.next + 1
        finish = "stop" if ids and ids[-1] in self.stops else "length"
        return Completion(ids, (0.0,) * len(ids), finish, 0)


def turn_ids(traj: Trajectory) -> list[tuple[int, ...]]:
    """Each assistant turn's ids as the episode holds them (given ones included)."""
    segments = traj.all_segments
    return [segments[t.segment].token_ids[t.start:t.end] for t in traj.turns]


async def without_help(traj: Trajectory, task: dict[str, Any], make_env: Callable[[dict[str, Any]], Env],
                       renderer: Renderer, limits: EpisodeLimits) -> Trajectory | None:
    """`traj` replayed in a fresh environment without the help (module doc); None if it does not end as it did."""
    turns = turn_ids(traj)
    sampler = ReplaySampler(turns, renderer.stop_token_ids)
    at_most = EpisodeLimits(max_turns=len(turns), max_tokens_per_turn=max(len(t) for t in turns),
                            max_total_tokens=limits.max_total_tokens + 1_000_000, env_timeout_s=limits.env_timeout_s)
    [group] = await play_groups([task], Episodes(LocalPlayers(make_env, sampler, renderer), at_most, 1))
    [demo] = group.trajectories
    if demo.infra_error or turn_ids(demo) != turns or demo.reward != traj.reward:
        return None
    return demo


def keep(traj: Trajectory, success_threshold: float) -> bool:
    """An episode worth learning from: it called a tool, every call of it ran, and it solved its task."""
    return (not traj.infra_error and traj.used_tools and all(c.ok for c in traj.tool_calls)
            and traj.reward_parts.get(EPISODE_REWARD, traj.reward) >= success_threshold)


async def bootstrap(spec: EnvSpec, renderer: Renderer, players: Callable[[Callable[[dict[str, Any]], Env]], Players],
                    tasks: Sequence[dict[str, Any]], samples: int, limits: EpisodeLimits, help_: Help,
                    success_threshold: float = 1.0, max_concurrent: int = 64
                    ) -> tuple[list[Trajectory], dict[str, float]]:
    """`samples` helped episodes of each task on `players(make_env)`, at most `max_concurrent` at once
    (`rollout.max_concurrent`: more than the servers take makes requests wait past their deadline), the kept ones
    (`keep`) replayed without the help (`without_help`); returns the demonstrations and the counts: played,
    failed (infrastructure errors), attempted, solved, kept, diverged, and the yield (demonstrations per episode
    played)."""
    def make_env(task: dict[str, Any]) -> Env:
        return Helped(spec.make_env(task), help_)

    played = Episodes(players(make_env), limits, samples)
    if help_.opening:  # the call's opening at the first turn: a branch of nothing, forced at its start
        played = Episodes(_Forced(played.players, Branch(-1, (), (), help_.opening)), limits, samples)
    groups = await play_groups(tasks, played, max_concurrent)
    demos, diverged = [], 0
    for task, group in zip(tasks, groups):
        for traj in group.trajectories:
            if keep(traj, success_threshold):
                demo = await without_help(traj, task, spec.make_env, renderer, limits)
                diverged += demo is None
                demos += [demo] if demo is not None else []
    trajs = [t for g in groups for t in g.trajectories]
    n = max(len(trajs), 1)
    failed = [t.error for t in trajs if t.infra_error]
    if failed:  # say what went wrong: a failure of every episode is not a policy that never tries
        print(f"bootstrap: {len(failed)} of {len(trajs)} episodes failed, the first: {failed[0]}", file=sys.stderr)
    return demos, {"played": float(len(trajs)), "failed": len(failed) / n,
                   "attempted": sum(t.used_tools for t in trajs) / n,
                   "solved": sum(t.reward >= success_threshold for t in trajs) / n, "kept": float(len(demos)),
                   "diverged": float(diverged), "yield": len(demos) / n}


SHARES = ("failed", "attempted", "solved")  # `bootstrap`'s figures that are shares of the episodes played
COUNTS = ("played", "kept", "diverged")


async def in_parts(run_part: Callable[[Sequence[dict[str, Any]]], Awaitable[tuple[list[str], dict[str, float]]]],
                   tasks: Sequence[dict[str, Any]], size: int, parts: Path) -> tuple[list[str], dict[str, float]]:
    """`run_part` (a bootstrap of some tasks: its demonstrations' lines and `bootstrap`'s figures) on `size` tasks at
    a time; as each part ends, `parts` is rewritten with every part so far (its tasks, lines and counts; atomically),
    so a bootstrap that was killed goes on from the first part not written. The result does not depend on the parts:
    an episode's sampling seeds are its task's and its sample's (`core.seeds.request_seed`). A `parts` file of other
    tasks is a one-line error. Returns every part's lines and the figures over all of them."""
    ids = [str(task.get("id", i)) for i, task in enumerate(tasks)]
    done: list[dict[str, Any]] = []
    if parts.is_file():
        done = [json.loads(line) for line in parts.read_text().splitlines() if line.strip()]
        ran = [i for part in done for i in part["tasks"]]
        if ran != ids[:len(ran)]:
            raise ValueError(f"{parts} holds the parts of another bootstrap (other tasks, seed or order): delete it "
                             "to start afresh")
    for first in range(sum(len(part["tasks"]) for part in done), len(tasks), size):
        lines, stats = await run_part(tasks[first:first + size])
        counts = {k: stats[k] * stats["played"] for k in SHARES} | {k: stats[k] for k in COUNTS}
        done.append({"tasks": ids[first:first + size], "lines": lines, "counts": counts})
        write_lines(parts, [json.dumps(part) for part in done])
    total = {k: sum(part["counts"][k] for part in done) for k in (*SHARES, *COUNTS)}
    n = max(total["played"], 1.0)
    return ([line for part in done for line in part["lines"]],
            {**{k: total[k] for k in COUNTS}, **{k: total[k] / n for k in SHARES}, "yield": total["kept"] / n})


class _Forced:
    """Players that play every episode with the same forced head (`rollout.branching.BranchSampler`)."""

    def __init__(self, inner: Players, head: Branch):
        self.inner, self.head = inner, head

    async def play(self, task: dict[str, Any], index: int, limits: EpisodeLimits,
                   branch: Branch | None = None) -> Trajectory:
        return await self.inner.play(task, index, limits, self.head)

    def idle_share(self) -> float:
        return self.inner.idle_share()
