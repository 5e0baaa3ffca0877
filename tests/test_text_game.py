"""TextArena's games as episodes, on the real textarena package: tasks, the game's own prompt and hints as
user messages, the game's reward, a multi-turn episode token by token, the game's random state kept to
itself, failures inside a game as one-line episode errors, a missing package, and vLLM."""

from __future__ import annotations

import random
import sys

import pytest

from agent_rl.core.types import Message, StopReason
from agent_rl.rollout.engine import rollout_groups
from agent_rl.rollout.runner import EpisodeLimits, run_episode

ta = pytest.importorskip("textarena", reason="pip install 'agent-rl[games]'")
text_game = pytest.importorskip("agent_rl.envs.text_game")
pytestmark = pytest.mark.timeout(60)

LIMITS = EpisodeLimits(max_turns=10, max_tokens_per_turn=32, max_total_tokens=2048)
SEED_7 = {"id": "g7", "game": "GuessTheNumber-v0", "seed": 7}  # random.seed(7); randint(1, 20) == 11
PROMPT = ("You are Player 0. You are playing Guess The Number.\n"
          "You have to guess the number between 1 and 20 within 10 turns.\n"
          "As you enter your guess, the game will provide you with hints such as 'higher' or 'lower'.\n"
          "You may provide your response in any manner. Only the number that is wrapped in square brackets "
          "will be considered as your guess. For example, [5].\n"
          "As you play, the history of your guesses will be appended below. Use the information to complete "
          "the game before you run out of guesses.\nEnter your guess.")


def replies(*texts):
    it = iter(texts)
    return lambda prompt: next(it)


def test_tasks_are_deterministic_cycle_the_games_and_the_splits_never_share_a_seed():
    games = ["GuessTheNumber-v0", "TowerOfHanoi-v0"]
    rows = text_game.load_tasks(4, seed=3, games=games)
    assert rows == text_game.load_tasks(4, seed=3, games=games)
    assert [r["game"] for r in rows] == games * 2 and len({r["id"] for r in rows}) == 4
    assert rows[0]["id"] == "guessthenumber-v0-train-3-0"
    train = {r["seed"] for r in text_game.load_tasks(200, seed=0)}
    held_out = {r["seed"] for r in text_game.load_tasks(200, seed=0, split="eval")}
    assert all(s % 2 == 0 for s in train) and all(s % 2 == 1 for s in held_out)


@pytest.mark.parametrize("games, message", [
    (["GuessTheNumbr-v0"], "text_game: 'GuessTheNumbr-v0' is not a TextArena game id (single-player ones that "
                           "play offline: GuessTheNumber-v0, Mastermind-v0, "),
    ("GuessTheNumber-v0", "text_game: games must be a non-empty list of TextArena game ids, got 'GuessTheNumber-v0'"),
])
def test_a_bad_game_list_is_one_line_naming_it(games, message):
    with pytest.raises(ValueError) as e:
        text_game.load_tasks(2, games=games)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_malformed_row_names_the_row_and_the_column():
    with pytest.raises(ValueError, match=r"^text_game task 'x': column 'seed' must be an integer, got '7'$"):
        text_game.TextGameEnv({"id": "x", "game": "GuessTheNumber-v0", "seed": "7"})
    with pytest.raises(ValueError, match=r"^text_game task 'x' has no 'game' column$"):
        text_game.TextGameEnv({"id": "x", "seed": 7})


async def test_the_game_speaks_in_user_messages_and_its_reward_is_the_episodes(scripted, renderer):
    async with text_game.make_env(SEED_7) as env:
        traj = await run_episode(env, scripted(replies("[15]", "I think [10]", "[11]")), renderer, LIMITS, "g7")
    assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert traj.messages[0].content == PROMPT  # TextArena's own prompt, untouched
    # the game's hints, without the echo of the player's own move
    assert [traj.messages[2].content, traj.messages[4].content] == ["The target number is lower.",
                                                                    "The target number is higher."]
    assert traj.stop_reason is StopReason.ENV_DONE and traj.tool_calls == ()
    assert traj.reward == 1.0
    assert traj.reward_parts == {"game_reward": 1.0, "finished": 1.0, "invalid_move": 0.0, "game_turns": 3.0}


async def test_an_episode_token_by_token(scripted, renderer):
    """Ids and loss mask of a 3-move game written out: the game's hint is a user turn appended after each move."""
    sampler = scripted(replies("[15]", "[10]", "[11]"))
    async with text_game.make_env(SEED_7) as env:
        traj = await run_episode(env, sampler, renderer, LIMITS, "g7")
    prompt = renderer.render([Message("user", PROMPT)])
    move_15, move_10, move_11 = [75, 33, 37, 77, 2], [75, 33, 32, 77, 2], [75, 33, 33, 77, 2]  # "[15]<|im_end|>"...
    # "\n<|im_start|>user\nThe target number is lower.<|im_end|>\n<|im_start|>assistant\n"
    lower = [198, 1, 4093, 198, 504, 2370, 1230, 314, 2208, 30, 2, 198, 1, 520, 9531, 198]
    higher = [198, 1, 4093, 198, 504, 2370, 1230, 314, 2061, 30, 2, 198, 1, 520, 9531, 198]  # 2208 -> 2061
    assert list(traj.token_ids) == prompt + move_15 + lower + move_10 + higher + move_11
    assert list(traj.loss_mask) == [0] * len(prompt) + [1] * 5 + [0] * 16 + [1] * 5 + [0] * 16 + [1] * 5
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(traj.logprobs, traj.loss_mask))
    n = len(prompt)
    assert [(t.start, t.end) for t in traj.turns] == [(n, n + 5), (n + 21, n + 26), (n + 42, n + 47)]
    # every prompt the sampler saw extends the one before with the sampled ids
    for before, after in zip(sampler.calls, sampler.calls[1:]):
        assert after[:len(before)] == before


async def test_invalid_moves_are_the_games_to_judge(scripted, renderer):
    """TextArena answers a move without `[n]` itself and ends the game at its second in a row (its allowance)."""
    async with text_game.make_env(SEED_7) as env:
        traj = await run_episode(env, scripted(replies("[15]", "eleven?", "twelve?")), renderer, LIMITS, "g7")
    assert traj.messages[4].content.startswith("You attempted an invalid move. Reason: Invalid move format.")
    assert traj.stop_reason is StopReason.ENV_DONE and len(traj.turns) == 3
    assert traj.reward_parts["invalid_move"] == 1.0 and traj.reward_parts["finished"] == 1.0
    assert traj.reward == pytest.approx(1 - 4 / 19)  # the game's partial credit: last guess 15, target 11


async def test_a_game_left_unfinished_earns_nothing(scripted, renderer):
    async with text_game.make_env(SEED_7) as env:
        traj = await run_episode(env, scripted(replies("[1]", "[2]")), renderer,
                                 EpisodeLimits(max_turns=2, max_tokens_per_turn=32, max_total_tokens=2048), "g7")
    assert traj.stop_reason is StopReason.MAX_TURNS
    assert traj.reward == 0.0 and traj.reward_parts["finished"] == 0.0 and traj.reward_parts["game_turns"] == 2.0


async def test_the_solver_wins_and_a_group_faces_one_game(scripted, renderer):
    tasks = text_game.load_tasks(6, seed=1)
    solver = scripted(lambda m: text_game.solve({"game": "GuessTheNumber-v0"}, m), on_messages=True)
    groups = await rollout_groups(tasks, text_game.make_env, solver, renderer, LIMITS, group_size=3)
    for g in groups:
        assert [t.reward for t in g.trajectories] == [1.0, 1.0, 1.0], [t.error for t in g.trajectories]
        assert len({t.messages for t in g.trajectories}) == 1  # same secret number for the whole group


async def test_a_game_keeps_its_random_state_and_leaves_the_hosts_alone(scripted, renderer):
    """2048 places a random tile after every move: interleaved with another game, it plays as it does alone."""
    task = {"id": "t", "game": "2048-v0-ultra-easy", "seed": 5}
    moves = ["[up]", "[left]", "[down]", "[right]", "[up]"]

    async def boards(env):
        seen = [(await env.initial_messages())[0].content]
        for turn, move in enumerate(moves):
            seen += [m.content for m in (await env.step(Message("assistant", move), turn)).messages]
        return seen

    host = random.getstate()
    async with text_game.make_env(task) as alone:
        expected = await boards(alone)
    assert random.getstate() == host
    async with text_game.make_env(task) as a, text_game.make_env({**task, "seed": 6}) as b:
        seen = [(await a.initial_messages())[0].content]
        await b.initial_messages()
        for turn, move in enumerate(moves):
            await b.step(Message("assistant", move), turn)
            random.random()  # the host draws too
            seen += [m.content for m in (await a.step(Message("assistant", move), turn)).messages]
    assert seen == expected


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["step", "reset"])
async def test_a_game_that_raises_is_a_one_line_episode_error(scripted, renderer, monkeypatch, where):
    cls = type(ta.envs.registration.make("GuessTheNumber-v0-raw"))

    def broken(self, *args, **kwargs):
        raise Boom("the game broke\nin two lines")

    monkeypatch.setattr(cls, where, broken)
    groups = await rollout_groups([SEED_7], text_game.make_env, scripted(replies("[15]")), renderer, LIMITS, 1)
    traj = groups[0].trajectories[0]
    assert traj.stop_reason is StopReason.ERROR
    expected = {"step": "GameError: game 'GuessTheNumber-v0' failed in step: Boom: the game broke in two lines",
                "reset": "environment could not start: GameError: game 'GuessTheNumber-v0' failed in reset: Boom: "
                         "the game broke in two lines"}[where]
    assert traj.error == expected


async def test_a_game_that_hangs_is_stopped_at_its_deadline(scripted, renderer, monkeypatch):
    cls = type(ta.envs.registration.make("GuessTheNumber-v0-raw"))

    def spin(self, action):
        while True:
            pass

    monkeypatch.setattr(cls, "step", spin)
    env = text_game.TextGameEnv(SEED_7, timeout_s=0.5)
    async with env:
        traj = await run_episode(env, scripted(replies("[15]")), renderer, LIMITS, "g7")
    assert traj.error == "GameError: game 'GuessTheNumber-v0' step took longer than 0.5 s"
    async with text_game.make_env(SEED_7) as again:  # the lock was released: the next game plays
        monkeypatch.undo()
        traj = await run_episode(again, scripted(replies("[11]")), renderer, LIMITS, "g7")
    assert traj.reward == 1.0


async def test_a_two_player_game_is_refused_in_one_line(scripted, renderer):
    groups = await rollout_groups([{"id": "ttt", "game": "TicTacToe-v0", "seed": 0}], text_game.make_env,
                                  scripted(replies("[4]")), renderer, LIMITS, 1)
    assert groups[0].trajectories[0].error == ("environment could not start: GameError: game 'TicTacToe-v0' is not "
                                               "a single-player game")


def test_without_textarena_one_line_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` now raises ImportError
    text_game.textarena.cache_clear()
    try:
        with pytest.raises(ValueError) as e:
            text_game.load_tasks(1)
    finally:
        text_game.textarena.cache_clear()
    assert str(e.value).startswith("the text_game environment needs TextArena (")
    assert str(e.value).endswith("): pip install 'agent-rl[games]'") and "\n" not in str(e.value)


@pytest.mark.integration
@pytest.mark.timeout(300)  # the session's vLLM server may start within this test (1-3 min under load)
async def test_games_against_vllm_keep_token_truth(play_on_server):
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=24, max_total_tokens=1024)
    groups = await play_on_server(text_game.load_tasks(2, seed=0), text_game.make_env, limits)
    for t in (t for g in groups for t in g.trajectories):
        assert [m.role for m in t.messages][:2] == ["user", "assistant"]
        assert set(t.reward_parts) == {"game_reward", "finished", "invalid_move", "game_turns"}
