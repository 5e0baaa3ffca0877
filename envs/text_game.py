"""TextArena's single-player text games as multi-turn episodes.

Owns: `TextGameEnv` (one game of one task: what the game shows the player becomes a user message, the
model's whole reply is the player's move, the game's own reward is the episode's), the task rows
(`load_tasks`: a TextArena game id and a game seed, disjoint seeds per split), the guard around every
call into a game (`_call`: a deadline, the game's own random state, its failures as one line), and a
scripted solver for GuessTheNumber (`solve`: binary search on the game's hints), and the spec `ENV`.
Does not own: the games, their rules, move parsing and rewards (the `textarena` package), tokens.

Why messages, not a tool. A TextArena game reads a free-text move and parses it itself (GuessTheNumber
takes the first `[12]`, TowerOfHanoi `[A C]`), answers a malformed one with its own "invalid move"
message and ends the game after its error allowance; a JSON tool call around that string would be a
second parser with its own failures, and the game itself knows when it is over. So the policy plays
as TextArena's own LLM agents do: the game's text in, a reply out, and any model can play without
having learnt a tool format. The game is built without TextArena's LLM wrappers (their observation
wrapper re-sends the whole history each turn, for agents that keep none); the conversation is ours,
and each turn adds only what the game said since the last move (the echo of the player's own move
left out).

Process-wide state. TextArena seeds Python's global `random` in `reset` and its games draw from it,
also during moves (2048 places tiles), so concurrent episodes would steal each other's draws and a
group of G rollouts would not face the same game. Each game keeps its own random state: every call
into it swaps that state in and the host's back out, one call at a time in the process (a lock).
Calls run in a stoppable thread under `env_timeout_s` (tools.runners): a game that hangs ends its
episode with an error, not the run. What a reset and a move take: docs/performance.md#smaller-measurements
(Sokoban's reset is the slowest: it searches for a solvable room).
"""

from __future__ import annotations

import functools
import random
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from agent_rl.core.audit_target import NotAudited
from agent_rl.core.env import Env, StepResult
from agent_rl.core.registry import EnvSpec
from agent_rl.core.types import Message, Reward, StopReason
from agent_rl.tools.runners import run_in_thread

INSTALL = "pip install 'agent-rl[games]'"
DEFAULT_GAMES = ("GuessTheNumber-v0",)
CALL_TIMEOUT_S = 30.0  # one reset, move or close of a game, far above Sokoban's reset, the slowest seen
# (docs/performance.md#smaller-measurements)
_GAME_LOCK = threading.Lock()  # one game call at a time: each swaps Python's global random state
# games named when an id is unknown: single-player, playable offline (the word games fetch NLTK data)
SINGLE_PLAYER = ("GuessTheNumber-v0", "Mastermind-v0", "TowerOfHanoi-v0", "FrozenLake-v0", "Minesweeper-v0-small",
                 "LightsOut-v0", "Sudoku-v0-very-easy", "2048-v0-ultra-easy", "Countdown-v0", "FifteenPuzzle-v0",
                 "Blackjack-v0", "Sokoban-v0")


class GameError(RuntimeError):
    """A game failed (raised, hung, or is not a single-player game): one line naming the game."""


@functools.cache
def textarena() -> Any:
    """The textarena module, or a ValueError naming what to install."""
    try:
        import textarena as ta
    except ImportError as e:
        raise ValueError(f"the text_game environment needs TextArena ({e}): {INSTALL}") from None
    return ta


def check_game(game: Any) -> str:
    """A TextArena game id, or a ValueError naming the id and the single-player games known."""
    registry = textarena().envs.registration.ENV_REGISTRY
    if not isinstance(game, str) or game not in registry:
        raise ValueError(f"text_game: {game!r} is not a TextArena game id (single-player ones that play "
                         f"offline: {', '.join(SINGLE_PLAYER)})")
    return game



def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).replace("*", " ").split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


class TextGameEnv(Env):
    """One game of TextArena, seeded by its task row: `{"id", "game", "seed"}`."""

    def __init__(self, task: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S):
        for key in ("game", "seed"):
            if key not in task:
                raise ValueError(f"text_game task {task.get('id', '?')!r} has no {key!r} column")
        if not isinstance(task["seed"], int) or isinstance(task["seed"], bool):
            raise ValueError(f"text_game task {task.get('id', '?')!r}: column 'seed' must be an integer, "
                             f"got {task['seed']!r}")
        self.task, self.game_id, self.timeout_s = task, check_game(task["game"]), timeout_s
        self._game: Any = None
        # the game's own state of Python's global `random`, seeded from the task before the game exists
        self._random_state = random.Random(task["seed"]).getstate()

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()` with this game's random state swapped in, under the deadline; failures as GameError."""
        def guarded() -> Any:
            while not _GAME_LOCK.acquire(timeout=0.05):  # in steps: a stop at the deadline gets through
                pass
            try:
                host = random.getstate()
                random.setstate(self._random_state)
                try:
                    return fn()
                finally:
                    self._random_state = random.getstate()
                    random.setstate(host)
            finally:
                _GAME_LOCK.release()

        try:
            return await run_in_thread(guarded, {}, self.timeout_s, f"text_game {self.game_id}")
        except TimeoutError:
            raise GameError(f"game {self.game_id!r} {what} took longer than {self.timeout_s:g} s") from None
        except Exception as e:
            raise GameError(f"game {self.game_id!r} failed in {what}: {_one_line(e)}") from None

    async def __aenter__(self) -> TextGameEnv:
        ta = textarena()

        def start() -> Any:
            game = ta.make(self.game_id)
            while isinstance(game, ta.Wrapper):  # the bare game: the conversation is kept by the runner
                game = game.env
            game.reset(num_players=1, seed=self.task["seed"])
            return game

        try:
            self._game = await self._call("reset", start)
        except GameError as e:
            if "number of players has to be" in str(e):
                raise GameError(f"game {self.game_id!r} is not a single-player game") from None
            raise
        return self

    async def _observation(self) -> str:
        """What the game said to the player since the last call, the echo of the player's own move left out."""
        ta = textarena()
        player, messages = await self._call("get_observation", self._game.get_observation)
        lines = [text for sender, text, kind in messages
                 if not (kind == ta.ObservationType.PLAYER_ACTION and sender == player)]
        return "\n".join(lines)

    async def initial_messages(self) -> list[Message]:
        if self._game is None:
            raise GameError("the game was not started: play a TextGameEnv inside `async with`")
        return [Message("user", await self._observation())]

    async def step(self, reply: Message, turn: int) -> StepResult:
        done, _ = await self._call("step", lambda: self._game.step(action=reply.content))
        if done:
            return StepResult(done=True, stop_reason=StopReason.ENV_DONE)
        return StepResult(messages=(Message("user", await self._observation()),))

    async def reward(self, messages: Sequence[Message]) -> Reward:
        """The game's reward for the player; 0 for a game left unfinished (the turns ran out first)."""
        rewards, info = await self._call("close", self._game.close)
        player = (info or {}).get(0, {})
        parts = {"finished": float(rewards is not None), "invalid_move": float(bool(player.get("invalid_move"))),
                 "game_turns": float(player.get("turn_count", 0))}
        value = float(rewards[0]) if rewards is not None else 0.0
        return Reward(value, {"game_reward": value, **parts})


_RANGE = re.compile(r"between (\d+) and (\d+)")
_GUESS = re.compile(r"\[(\d+)\]")


def solve(task: dict[str, Any], messages: Sequence[Message], direct: bool = False) -> Message:
    """The demonstration for GuessTheNumber: a binary search over the game's hints ("The target number is
    lower."), each guess in the game's `[n]` format. Other games have no scripted solver (a ValueError)."""
    if not str(task.get("game", "")).startswith("GuessTheNumber-"):
        raise ValueError(f"text_game: no scripted solver for {task.get('game')!r} (only GuessTheNumber)")
    prompt = next(m.content for m in messages if m.role == "user")
    low, high = map(int, _RANGE.search(prompt).groups())  # type: ignore[union-attr]
    for guess, hint in zip(messages, messages[1:]):
        found = _GUESS.search(guess.content) if guess.role == "assistant" else None
        if found and "lower" in hint.content:
            high = min(high, int(found.group(1)) - 1)
        elif found and "higher" in hint.content:
            low = max(low, int(found.group(1)) + 1)
    return Message("assistant", f"My guess is [{(low + high) // 2}].")


def make_env(task: dict[str, Any]) -> TextGameEnv:
    return TextGameEnv(task)


def load_tasks(n: int, seed: int = 0, split: str = "train",
               games: Sequence[str] = DEFAULT_GAMES) -> list[dict[str, Any]]:
    """`n` games cycling through `games` (TextArena ids; `rollout.env_args: {games: [...]}`), each with its
    own game seed: even seeds for the train split, odd ones for any other, so the splits never share one."""
    if isinstance(games, str) or not games:
        raise ValueError(f"text_game: games must be a non-empty list of TextArena game ids, got {games!r}")
    for game in games:
        check_game(game)
    rng = random.Random(f"text_game|{seed}")
    rows = []
    for i in range(n):
        game_seed = 2 * rng.randrange(10**9) + (split != "train")
        game = games[i % len(games)]
        rows.append({"id": f"{_slug(game)}-{split}-{seed}-{i}", "game": game, "seed": game_seed})
    return rows


def _slug(game: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", game).strip("-").lower()


ENV = EnvSpec("text_game", make_env, load_tasks, solve=solve,
              audit=NotAudited("is scored by the TextArena game itself, which parses and judges every move "
                               "(no stated answer to fake)"))
