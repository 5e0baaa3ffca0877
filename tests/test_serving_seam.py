"""The serving seam holds: no vLLM route is named outside the backend package (`agent_rl/rollout/serving/vllm/`),
what the backend reads of vLLM's counters, and what a failed call to a server means for a weight sync.

The grep covers the code a run, a bench or an example runs (agent_rl, envs, tools, rewards, bench, examples),
comments and docstrings included: a route named in prose is where the next call to it gets written. Tests may
name routes (stand-in servers answer them).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent_rl.rollout.serving.base import ServerCallError
from agent_rl.rollout.serving.vllm.backend import read_counters
from agent_rl.rollout.weight_sync.base import Gone, Servers, WeightSyncError

ROOT = Path(__file__).resolve().parents[1]
BACKEND = "agent_rl/rollout/serving/vllm/"
FOLDERS = ("agent_rl", "envs", "tools", "rewards", "bench", "examples")
ROUTES = re.compile(r"/pause\b|/resume\b|/is_paused\b|/collective_rpc\b|\breload_weights\b|/reset_prefix_cache\b|"
                    r"/abort_requests\b|\bload_lora_adapter\b|\bunload_lora_adapter\b|/v1/models\b|/v1/completions\b|"
                    r"/health\b|/metrics\b(?!\.)|/init_weight_transfer_engine\b|/update_weights\b")
# routes of other servers that happen to share a name with one of vLLM's, and one place this seam may not edit
ELSEWHERE = {
    "envs/agent_proxy.py": {"/v1/models"},  # our own OpenAI-compatible endpoint for a user's agent
    "envs/openenv_env.py": {"/health"},  # an OpenEnv environment server's
}


def routes_named(text: str) -> set[str]:
    return {m.group(0) for m in ROUTES.finditer(text)}


def linked(path: Path) -> bool:
    """Reached through a link (agent_rl/envs, tools, rewards link to the top-level folders, walked on their own)."""
    parts = path.relative_to(ROOT).parts
    return any((ROOT.joinpath(*parts[:i])).is_symlink() for i in range(1, len(parts) + 1))


def named_outside() -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(BACKEND) or path.suffix not in {".py", ".yaml", ".yml", ".sh", ".md"} or linked(path) \
                    or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                stray = routes_named(line) - ELSEWHERE.get(rel, set())
                if stray:
                    found.append(f"{rel}:{n}: {', '.join(sorted(stray))}")
    return found


def test_no_vllm_route_is_named_outside_the_backend():
    assert named_outside() == [], "vLLM routes outside agent_rl/rollout/serving/vllm/ (call the backend's methods)"


def test_the_check_finds_a_route_and_only_routes():
    assert routes_named('await http.post(url + "/pause?mode=abort")') == {"/pause"}
    assert routes_named('{"method": "reload_weights"} /v1/load_lora_adapter') == {"reload_weights", "load_lora_adapter"}
    assert routes_named("url + '/metrics'") == {"/metrics"}
    assert routes_named("<run_dir>/metrics.jsonl, backend.load_weights(http, url, folder)") == set()


def test_vllm_counters_are_summed_over_engines():
    page = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="base"} 120.0
vllm:generation_tokens_total{engine="1",model_name="base"} 30.0
vllm:generation_tokens_created{engine="0",model_name="base"} 1.7e+09
vllm:num_requests_running{engine="0",model_name="base"} 3.0
vllm:prefix_cache_hits_total 4.5e+02
"""
    assert read_counters(page) == {"generation_tokens": 150.0, "prefix_cache_queries": 0.0,
                                   "prefix_cache_hits": 450.0, "requests_running": 3.0}


class Gate:
    """A gate whose verdict on a server that gave no answer the test sets."""

    def __init__(self, down: bool):
        self.down, self.asked = down, []

    def is_up(self, url: str) -> bool:
        return True

    async def wait_up(self, timeout_s: float) -> None: ...

    async def lost(self, url: str) -> bool:
        self.asked.append(url)
        return self.down


async def failing(answered: bool) -> None:
    raise ServerCallError("vLLM server http://h:1 refused it", answered=answered)


@pytest.mark.parametrize(("answered", "down", "error"), [
    (False, True, Gone),  # no answer, and the gate says the server is down: left out of the push
    (False, False, WeightSyncError),  # no answer from a server that is up: the call's own failure
    (True, True, WeightSyncError),  # a refusal comes from a server alive enough to answer: the gate is not asked
])
async def test_a_failed_call_is_gone_only_when_unanswered_and_the_server_is_down(answered, down, error):
    gate = Gate(down)
    servers = Servers(["http://h:1"], 5.0, 1.0, gate)
    with pytest.raises(WeightSyncError, match="^vLLM server http://h:1 refused it$") as e:
        await servers.call("http://h:1", failing(answered))
    assert type(e.value) is error and gate.asked == ([] if answered else ["http://h:1"])
