"""An MCP OpenEnv environment built on openenv-core's `MCPEnvironment`: its tools are a FastMCP server's, each
call a `CallToolAction` step. The reset's observation states the task; `submit` ends the episode, reward 1.0
for 42."""

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

mcp = FastMCP("calc")


@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@mcp.tool()
def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


class TaskObservation(Observation):
    task: str = ""


class CalcEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__(mcp)
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        return TaskObservation(task="What is 2 + 40? Use the tools.", done=False, reward=0.0)

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=True, reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(CalcEnvironment, CallToolAction, CallToolObservation, env_name="calc", max_concurrent_envs=8)
