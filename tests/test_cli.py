"""The command line: bad input ends in one `error: ...` line and a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest

from agent_rl.cli import main
from agent_rl.learn.models import ModelError, resolve_model
from envs.base import Env


class RaisingEnv(Env):
    """An environment with a bug: it raises on its first step."""

    def __init__(self, task):
        self.task = task

    async def initial_messages(self):
        from agent_rl.core.types import Message

        return [Message("user", "hi")]

    async def step(self, reply, turn):
        raise RuntimeError("env bug: step exploded")

    async def reward(self, messages):
        return 0.0


make_env = RaisingEnv  # this module doubles as an environment module for `--env test_cli`


def load_tasks(n, seed=0, split="train"):
    return [{"id": f"r{i}"} for i in range(n)]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_missing_model_path(capsys):
    assert main(["rollout", "--model", "/no/such/model"]) == 2
    assert one_error_line(capsys) == ("error: model path '/no/such/model' does not exist "
                                      "(nor is it a hub id or a built-in: smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b)")


def test_model_errors_name_the_problem(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="is not a Hugging Face model folder .no config.json."):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="model path .*missing.gguf' does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ModelError, match="could not read GGUF file"):
        resolve_model(str(tmp_path / "bad.gguf"))


def test_hub_id_without_a_hub_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="could not load model 'someone/some-model' from the hub"):
        resolve_model("someone/some-model")


def test_unreachable_server(capsys):
    assert main(["rollout", "--server-url", "http://127.0.0.1:9", "--tasks", "1"]) == 1
    assert one_error_line(capsys) == "error: no vLLM server answers at http://127.0.0.1:9 (waited 10 s for /health)"


def test_unknown_environment(capsys):
    assert main(["rollout", "--env", "no_such_env_module"]) == 2
    assert one_error_line(capsys).startswith("error: unknown environment 'no_such_env_module'")


def test_invalid_config_exits_2_naming_the_field(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  group_sise: 4\n")
    assert main(["train", str(cfg)]) == 2
    assert one_error_line(capsys) == "error: config error: rollout.group_sise: unknown field"


@pytest.mark.integration
def test_environment_that_raises(capsys, vllm_server):
    code = main(["rollout", "--env", "test_cli", "--model", str(vllm_server.model_dir), "--server-url",
                 vllm_server.url, "--tasks", "1", "--group-size", "2", "--max-tokens", "120"])
    assert code == 1
    assert one_error_line(capsys) == "error: 2 of 2 rollouts failed; first: RuntimeError: env bug: step exploded"
