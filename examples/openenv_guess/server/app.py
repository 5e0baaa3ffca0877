"""The guessing game served by openenv-core's `create_app` (HTTP + WebSocket), as its template serves one."""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import GuessAction, GuessObservation
    from .guess_environment import GuessEnvironment
except ImportError:
    from models import GuessAction, GuessObservation

    from server.guess_environment import GuessEnvironment

app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
