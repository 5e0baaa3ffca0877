"""The guessing game's action and observation, as openenv-core's template writes them (`models.py`)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """Guess the hidden number."""

    guess: int = Field(..., description="Your guess, a whole number from 1 to 9")


class GuessObservation(Observation):
    """What the game says: the task, or whether the hidden number is higher or lower than the guess."""

    message: str = Field(default="", description="The game's answer")
    guesses_left: int = Field(default=0, description="Guesses left")
