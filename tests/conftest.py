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
