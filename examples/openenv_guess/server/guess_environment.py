"""A number-guessing OpenEnv environment, built on openenv-core's `Environment` as its template builds one.

reset(seed) hides a number from 1 to 9 (the seed picks it: (seed % 9) + 1); each step is a guess, answered
"higher", "lower" or "correct". A correct guess ends the episode with reward 1.0, the third wrong one with 0.0.
"""

from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import GuessAction, GuessObservation
except ImportError:
    from models import GuessAction, GuessObservation

GUESSES = 3


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._hidden, self._left = 5, GUESSES

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._hidden, self._left = (seed or 0) % 9 + 1, GUESSES
        return GuessObservation(message=f"Guess the hidden number from 1 to 9. You have {GUESSES} guesses.",
                                guesses_left=GUESSES, done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        self._left -= 1
        if action.guess == self._hidden:
            return GuessObservation(message="correct", guesses_left=self._left, done=True, reward=1.0)
        hint = "higher" if action.guess < self._hidden else "lower"
        return GuessObservation(message=hint, guesses_left=self._left, done=self._left == 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
