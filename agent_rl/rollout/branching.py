"""Branching at the tool decision: a group whose rollouts never try a tool, or whose tool-using rollouts all fail,
gets continuations branched from its own episodes, so that it holds rollouts that act.

Owns: `BranchRule` (the budget, whether a call's opening is forced, what counts as solved), `branches` (which
groups branch and where: the cut points of the group's own episodes, chosen by the policy's uncertainty there),
and `BranchSampler` (plays a branch: the source's earlier turns replayed as they were, the kept ids and the
forced opening given, the rest sampled).
Does not own: playing the branches and ending the group (`rollout.engine`), the opening's ids (each family's
renderer: `Renderer.call_opening`), the advantages over a tree (`learn.advantages`), the maths
(docs/algorithms.md#branching-at-the-tool-decision).

When a group branches (its episodes have ended, before its group reward and returns), with G its episodes:
- No episode attempted a tool, and `force` is on: each branch starts a turn of one of its episodes with the
  opening of a call (`Renderer.call_opening`: `<tool_call>\\n{"name": "` for ChatML): at the start of a turn,
  where every model family opens a call, whatever text the turn held. The candidates are every turn of every
  episode; the earlier turns are replayed as they were.
- Episodes attempted a tool and none of them solved its task: each branch keeps a tool-using episode's turn up to
  a line before its first call and samples the call and what follows again, nothing forced (the episode's own
  reasoning kept: AXPO's "freeze the question and the reasoning before the call").
Which cut: the policy's uncertainty there, the surprisal (-log-prob) of the token the episode sampled at the cut
(AXPO chooses the prefixes to resample by the policy's uncertainty; the sampler gives the sampled token's log-prob,
not the distribution's entropy, and a token the policy was unsure of is where another sample is likeliest to go
elsewhere). The K = max(1, round(budget x G)) most uncertain distinct cuts are taken (cycled when there are fewer,
each branch with seeds of its own), so a step spends at most a share `budget` of its episodes on branches (one at
least a branching group). Every given id (replayed, kept, forced) is context: the policy did not sample it in the
branch, so it is out of the branch's loss; the kept prefix is trained once, as part of its own episode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from agent_rl.core.types import EPISODE_REWARD, Branch, Message, Segment, Trajectory
from agent_rl.rollout.sampler import Completion, Sampler, SamplingParams


@dataclass(frozen=True)
class BranchRule:
    """When and how a group branches (module doc)."""

    budget: float  # branches a group gets, as a share of its episodes (at least one): `algorithm.tool_branches`
    opening: tuple[int, ...]  # the ids that open a call (`Renderer.call_opening`): forced in groups without attempt
    force: bool = True  # force the opening in a group where no episode attempted a tool (off: such a group does not
    #                     branch)
    success_threshold: float = 1.0  # an episode's own reward at or above it solved its task (`eval.success_threshold`)
    token_text: Callable[[int], str] = str  # one id's text (`Renderer.decode_raw`): where the lines before a call end

    def solved(self, traj: Trajectory) -> bool:
        return traj.reward_parts.get(EPISODE_REWARD, traj.reward) >= self.success_threshold


@dataclass(frozen=True)
class _Cut:
    surprisal: float
    branch: Branch


def branches(rule: BranchRule, trajs: Sequence[Trajectory]) -> list[Branch]:
    """Where the group of episodes `trajs` branches (module doc); [] when it does not."""
    played = [(i, t) for i, t in enumerate(trajs) if not t.infra_error]
    attempted = [(i, t) for i, t in played if t.used_tools]
    if not played:
        return []
    if not attempted:
        cuts = [c for i, t in played for c in _turn_starts(i, t, rule.opening)] if rule.force and rule.opening else []
    elif not any(rule.solved(t) for _, t in attempted):
        opening = "".join(rule.token_text(i) for i in rule.opening).split("\n")[0]
        cuts = [c for i, t in attempted for c in _before_the_call(i, t, rule.token_text, opening)]
    else:
        return []
    distinct: dict[tuple[tuple[tuple[int, ...], ...], tuple[int, ...]], _Cut] = {}
    for cut in sorted(cuts, key=lambda c: -c.surprisal):  # stable: equal surprisals keep episode order
        distinct.setdefault((cut.branch.replies, cut.branch.kept), cut)
    chosen = list(distinct.values())
    if not chosen:
        return []
    k = max(1, round(rule.budget * len(trajs)))
    return [chosen[n % len(chosen)].branch for n in range(k)]


def _turn_ids(traj: Trajectory, turn: int) -> tuple[Segment, int, int]:
    """The segment of turn `turn` and the turn's [start, end) in it."""
    t = traj.turns[turn]
    return traj.all_segments[t.segment], t.start, t.end


def _replies(traj: Trajectory, turn: int) -> tuple[tuple[int, ...], ...]:
    """The sampled ids of the turns before `turn`, as they were."""
    out = []
    for k in range(turn):
        seg, start, end = _turn_ids(traj, k)
        out.append(seg.token_ids[start:end])
    return tuple(out)


def _surprisal(seg: Segment, position: int) -> float:
    """-log-prob of the token sampled at `position` (inf past the end: a cut there has nothing left to resample)."""
    return -seg.logprobs[position] if position < len(seg.token_ids) and seg.loss_mask[position] else math.inf


def _turn_starts(index: int, traj: Trajectory, opening: tuple[int, ...]) -> list[_Cut]:
    """Every turn of the episode, at its start, with the call's opening forced."""
    cuts = []
    for turn in range(len(traj.turns)):
        seg, start, _ = _turn_ids(traj, turn)
        cuts.append(_Cut(_surprisal(seg, start), Branch(index, _replies(traj, turn), (), opening)))
    return cuts


def _before_the_call(index: int, traj: Trajectory, token_text: Callable[[int], str], opening: str) -> list[_Cut]:
    """In the turn of the episode's first call: its start, and every line start before the call's own line (the
    first line of the turn's text that holds the call's opening markup, e.g. `<tool_call>`, or its name; a malformed
    call without either: the turn's last line). A cut falls after a token whose text ends a line, with no more line
    ends before it than the call's line has before it, so the kept ids never reach into the call."""
    first = min(c.turn for c in traj.tool_calls)
    seg, start, end = _turn_ids(traj, first)
    ids = seg.token_ids[start:end]
    reply = [m for m in traj.messages if m.role == "assistant"][first]
    name = reply.tool_calls[0].name if reply.tool_calls else ""
    lines = reply.content.split("\n")
    marks = [m for m in (opening, name) if m]
    before = next((n for n, line in enumerate(lines) if any(m in line for m in marks)), len(lines) - 1)
    positions, seen = [0], 0
    for k, token in enumerate(ids[:-1], start=1):
        text = token_text(token)
        seen += text.count("\n")
        if seen > before:
            break
        if text.endswith("\n"):
            positions.append(k)
    replies = _replies(traj, first)
    return [_Cut(_surprisal(seg, start + k), Branch(index, replies, tuple(ids[:k]))) for k in positions]


class BranchSampler:
    """Plays branch `branch` through `inner`: its replayed turns and its given head (kept + forced) are returned as
    given ids (`Completion.given`: context); the rest of the branch's turn, and every later turn, `inner` samples."""

    def __init__(self, inner: Sampler, branch: Branch):
        self.inner, self.branch, self.turn = inner, branch, 0

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.inner.policy_version = version

    async def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
                     messages: Sequence[Message] = ()) -> Completion:
        turn, self.turn = self.turn, self.turn + 1
        version = self.inner.policy_version
        if turn < self.branch.turn:  # replayed as the source sampled it (it ended with its stop token)
            ids = self.branch.replies[turn]
            return Completion(ids, (0.0,) * len(ids), "stop", version, (-1,) * len(ids), given=len(ids))
        if turn > self.branch.turn:
            return await self.inner.sample(prompt_ids, params, messages)
        head = self.branch.head
        room = params.max_tokens - len(head)
        if room <= 0:  # the head alone fills the turn's budget: cut, as a sampled turn would be
            cut = head[:params.max_tokens]
            return Completion(cut, (0.0,) * len(cut), "length", version, (-1,) * len(cut), given=len(cut))
        out = await self.inner.sample([*prompt_ids, *head], replace(params, max_tokens=room), messages)
        return Completion(head + out.token_ids, (0.0,) * len(head) + out.logprobs, out.finish_reason,
                          out.policy_version, (-1,) * len(head) + out.versions, given=len(head))
