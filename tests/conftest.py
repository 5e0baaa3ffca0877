"""Shared fixtures: the real SmolLM2 tokenizer, the tiny random model, one vLLM server per session."""

from __future__ import annotations

import os

import pytest

from agent_rl.chat import ChatRenderer
from agent_rl.models import build_tiny_model, cache_dir, resolve_model
from agent_rl.sampler import ScriptedSampler


@pytest.fixture(scope="session")
def smol_dir():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def renderer(smol_dir) -> ChatRenderer:
    return ChatRenderer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def tiny_dir(smol_dir):
    return build_tiny_model(smol_dir, cache_dir() / "models" / "tiny-smollm2")


@pytest.fixture()
def scripted(renderer):
    """A scripted sampler factory: script(prompt_text) -> reply text."""

    def make(script, logprob: float = -0.5) -> ScriptedSampler:
        return ScriptedSampler(renderer.encode, renderer.render_text, renderer.im_end, script, logprob)

    return make


@pytest.fixture
def scripted_calls(scripted):
    """A scripted sampler that sends `replies[k]` after k tool responses, then `finish(prompt)`:
    a run of (often malformed) tool calls, each answered by the env, before the episode ends."""

    def make(replies: list[str], finish) -> ScriptedSampler:
        def script(prompt: str) -> str:
            done = prompt.count("<tool_response>")
            return replies[done] if done < len(replies) else finish(prompt)

        return scripted(script)

    return make


@pytest.fixture(scope="session")
def vllm_server(tiny_dir):
    """One real vLLM server on the tiny model for the whole session (start-up costs ~45 s)."""
    from agent_rl.server import VLLMServer

    url = os.environ.get("AGENT_RL_TEST_VLLM_URL")
    if url:  # reuse a running server while developing
        yield type("Attached", (), {"url": url, "model_dir": tiny_dir})()
        return
    with VLLMServer(tiny_dir, kv_cache_gib=1, max_model_len=2048) as server:
        yield server


@pytest.fixture()
def play_on_server(vllm_server, renderer):
    """Play `tasks` x `group_size` on the real server and check token truth against what it returned.

    Every sampled turn of every trajectory must be exactly the ids the server sent back for that
    prompt and request seed, and the loss mask must select precisely those ids; no infra errors.
    Returns the groups for the caller's environment-specific checks.
    """
    from dataclasses import replace

    from agent_rl.rollout import request_seed, rollout_groups
    from agent_rl.sampler import VLLMSampler

    async def play(tasks, make_env, limits, group_size: int = 2):
        limits = replace(limits, seed=0 if limits.seed is None else limits.seed)
        returned = {}  # (prompt ids, request seed) -> the ids the server sampled

        class Recording(VLLMSampler):
            async def sample(self, prompt_ids, params):
                out = await super().sample(prompt_ids, params)
                returned[tuple(prompt_ids), params.seed] = out.token_ids
                return out

        async with Recording([vllm_server.url]) as sampler:
            groups = await rollout_groups(tasks, make_env, sampler, renderer, limits, group_size)
        assert [g.task_id for g in groups] == [str(t["id"]) for t in tasks]
        for g in groups:
            for index, t in enumerate(g.trajectories):
                assert not t.infra_error, t.error
                masked = [i for i, m in zip(t.token_ids, t.loss_mask) if m == 1]
                server = [i for k, turn in enumerate(t.turns)
                          for i in returned[t.token_ids[:turn.start], request_seed(limits.seed, g.task_id, index, k)]]
                assert masked == server
        return groups

    return play


# .ci/run sets this once it has started a Docker daemon of its own: from then on a Docker sandbox
# case that cannot reach a daemon fails instead of skipping, so CI never passes with Docker untested.
REQUIRE_DOCKER = "AGENT_RL_REQUIRE_DOCKER"


def docker_or_skip() -> None:
    """Nothing where a Docker daemon with the sandbox image answers; else skip the calling case, or
    fail it when REQUIRE_DOCKER is set."""
    from tools.sandbox_docker import unavailable_reason

    if reason := unavailable_reason():
        if os.environ.get(REQUIRE_DOCKER):
            pytest.fail(f"docker unavailable although {REQUIRE_DOCKER} is set: {reason}", pytrace=False)
        pytest.skip(f"docker unavailable: {reason}")


def deadline_slack_s(backend) -> float:
    """How long past its deadline a killed sandbox call may end: the kill and clean-up, and for
    Docker also the container's start and removal, which take seconds on a loaded 2-core machine."""
    return 5.0 if backend.name == "docker" else 1.5
