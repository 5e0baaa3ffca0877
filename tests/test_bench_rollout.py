"""bench/rollout.py's replay side makes the server do the rollouts' work and nothing else: each episode's turns as
(tokens sampled, context added after), and each replayed request's prompt the last prompt, the ids the server just
generated for it and that context, as many tokens asked as the rollout sampled (a stand-in server reads them)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import StandInVLLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: the checkout's

from bench.rollout import replay_side, turn_plan


def episode(ids, turns, segments=()):
    return SimpleNamespace(token_ids=tuple(ids), turns=tuple(SimpleNamespace(start=a, end=b) for a, b in turns),
                           segments=segments)


def test_a_plan_is_each_turns_sampled_count_and_the_context_after_it():
    # prompt 1 2 3 | sampled 10 11 | context 20 21 22 | sampled 12 13 14 | context 23 | sampled 15
    ids = [1, 2, 3, 10, 11, 20, 21, 22, 12, 13, 14, 23, 15]
    assert turn_plan(episode(ids, [(3, 5), (8, 11), (12, 13)])) == [(2, [20, 21, 22]), (3, [23]), (1, [])]
    assert turn_plan(episode([1, 2], [])) == []
    with pytest.raises(SystemExit, match="one segment"):
        turn_plan(episode(ids, [(3, 5)], segments=("closed",)))


async def test_the_replay_sends_each_turn_grown_by_what_the_server_made_and_the_rollouts_context():
    async with StandInVLLM() as server:  # replies ids 100 + len(prompt) + i
        plans = [[(2, [20, 21]), (3, [])], [(1, [])]]
        tok_s, sent = await replay_side(server.url, "policy", [[1, 2, 3], [7]], plans)
    assert sent == 3 and tok_s > 0
    first_turn = [1, 2, 3]
    made = [100 + 3, 100 + 4]
    second_turn = [*first_turn, *made, 20, 21]
    assert sorted(server.served) == sorted([(tuple(first_turn), "policy", 2), (tuple(second_turn), "policy", 3),
                                            ((7,), "policy", 1)])
