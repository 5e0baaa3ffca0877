"""Config: defaults, YAML + `--set` overrides, the one-line errors that name the field, frozenness."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from agent_rl.config.file import dump_config, load_config
from agent_rl.config.train import TrainConfig
from agent_rl.core.config import ConfigError, ModelConfig, RolloutConfig
from agent_rl.learn.algorithm import AlgorithmConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "calculator_grpo.yaml"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def error_of(path: str | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


# -- defaults and derived values -----------------------------------------------------------------
def test_defaults_are_valid_and_as_documented():
    cfg = load_config(None, [])
    assert cfg == TrainConfig()
    assert cfg.model.name == "smollm2-135m" and cfg.model.target_modules == "all-linear"
    assert cfg.sampler.server_urls == []
    assert (cfg.rollout.tasks_per_step, cfg.rollout.group_size) == (8, 8)
    assert cfg.algorithm.tis_cap == 2.0 and cfg.algorithm.mismatch_mask is None
    assert cfg.algorithm.mismatch_bounds == (0.5, 2.0)  # IcePop's, where a mismatch_mask is chosen
    assert cfg.optim.lr == 5e-5 and cfg.run.steps == 20 and cfg.run.tensorboard is True


def test_derived_values_are_properties():
    cfg = load_config(None, ["rollout.tasks_per_step=3", "rollout.group_size=5", "model.lora_rank=8",
                             "algorithm.truncated_reward=0", "algorithm.kl_beta=0.01"])
    assert cfg.rollout.rollouts_per_step == 15


def test_every_field_has_a_description():
    for section in TrainConfig.model_fields.values():
        model = section.annotation
        for name, field in [("section", section), *model.model_fields.items()]:
            assert field.description, f"{model.__name__}.{name} has no description"


# -- files and overrides ---------------------------------------------------------------------------
def test_yaml_file_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "rollout:\n  group_size: 4\n  env: calculator\nalgorithm:\n  kl_beta: 0.5\n"
                           "  mismatch_mask: token\n")
    cfg = load_config(path, ["algorithm.kl_beta=0.01", "sampler.server_urls=[http://a:8000,http://b:8000]",
                             "algorithm.mismatch_bounds=[0.5, 3]", "model.init_adapter=runs/sft/adapter",
                             "rollout.group_size=6", "rollout.group_size=2"])
    assert cfg.rollout.group_size == 2  # the last override wins
    assert cfg.algorithm.kl_beta == 0.01  # the override beats the file
    assert cfg.sampler.server_urls == ["http://a:8000", "http://b:8000"]
    assert cfg.algorithm.mismatch_bounds == (0.5, 3.0)
    assert cfg.model.init_adapter == "runs/sft/adapter"
    assert cfg.rollout.max_turns == 4  # missing keys default
    assert cfg.optim == TrainConfig().optim


def test_override_to_null_and_empty_section(tmp_path):
    path = write(tmp_path, "run:\n  # nothing changed here yet\nalgorithm:\n  tis_cap: 3\n")
    cfg = load_config(path, ["algorithm.tis_cap=null"])
    assert cfg.algorithm.tis_cap is None
    assert cfg.run == TrainConfig().run


def test_empty_file_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path, "# only a comment\n"), []) == TrainConfig()


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["sampler.server_urls=[http://a]", "algorithm.mismatch_mask=sequence",
                             "algorithm.mismatch_bounds=[0.8, 1.5]",
                             "model.target_modules=[q_proj, v_proj]", "run.wandb_project=demo"])
    text = dump_config(cfg)
    assert text.splitlines()[0] == "model:"
    assert load_config(write(tmp_path, text), []) == cfg


def test_example_config_loads():
    cfg = load_config(str(EXAMPLE), [])
    assert cfg.rollout.rollouts_per_step == 16
    assert cfg.run.steps == 10
    assert cfg.rollout.max_total_tokens <= cfg.sampler.max_model_len


# -- errors: exactly one line, naming the field ----------------------------------------------------
def test_bad_value_names_field_and_value():
    assert error_of(None, ["algorithm.eps_low=-1"]) == (
        "config error: algorithm.eps_low: Input should be greater than or equal to 0 (got -1)")


def test_bad_value_in_file(tmp_path):
    path = write(tmp_path, "sampler:\n  temperature: hot\n")
    assert error_of(path) == ("config error: sampler.temperature: Input should be a valid number, "
                              "unable to parse string as a number (got hot)")


def test_unknown_field():
    assert error_of(None, ["rollout.group_sise=4"]) == "config error: rollout.group_sise: unknown field"
    assert error_of(None, ["rollouts.group_size=4"]) == "config error: rollouts: unknown field"


def test_bad_literal():
    assert error_of(None, ["model.dtype=half"]) == (
        "config error: model.dtype: Input should be 'auto', 'float32', 'bfloat16', 'float16' or 'float64' (got half)")


def test_bounds():
    assert error_of(None, ["rollout.group_size=1"]) == (
        "config error: rollout.group_size: Input should be greater than or equal to 2 (got 1)")
    assert error_of(None, ["sampler.top_p=0"]) == (
        "config error: sampler.top_p: Input should be greater than 0 (got 0)")
    assert error_of(None, ["sampler.temperature=0"]) == (
        "config error: sampler.temperature: Input should be greater than 0 (got 0)")


def test_cross_field_errors_name_the_field():
    assert error_of(None, ["rollout.max_total_tokens=8192"]) == (
        "config error: rollout.max_total_tokens: must be <= sampler.max_model_len (4096) (got 8192)")
    assert error_of(None, ["rollout.max_tokens_per_turn=2048"]) == (
        "config error: rollout.max_tokens_per_turn: must be <= max_total_tokens (1024) (got 2048)")
    assert error_of(None, ["algorithm.mismatch_mask=token", "algorithm.mismatch_bounds=[2, 3]"]) == (
        "config error: algorithm.mismatch_bounds: must satisfy 0 < low <= 1 <= high (got [2.0, 3.0])")


def test_mismatch_bounds_of_before_0_1_0_are_one_line_saying_what_changed():
    """Before 0.1.0 bounds alone dropped sequences and bounds null meant no mask; now `mismatch_mask` chooses
    tokens, sequences or nothing and the bounds are only its range. Neither old form is read: each is refused
    with what changed (a config written since always holds the mismatch_mask key: dump_config writes it)."""
    assert error_of(None, ["algorithm.mismatch_bounds=[0.5, 2]"]) == (
        "config error: algorithm.mismatch_mask: mismatch_bounds alone drops nothing since 0.1.0; add mismatch_mask: "
        "sequence (what bounds alone did before) or token (IcePop's token mask)")
    null = ("config error: algorithm.mismatch_bounds: null meant no mask before 0.1.0; now mismatch_mask: null is no "
            "mask and the bounds are its range: leave mismatch_bounds out (got null)")
    assert error_of(None, ["algorithm.mismatch_bounds=null"]) == null
    assert error_of(None, ["algorithm.mismatch_mask=token", "algorithm.mismatch_bounds=null"]) == null
    assert load_config(None, ["algorithm.mismatch_mask=null", "algorithm.mismatch_bounds=[0.5, 3]"]).algorithm \
        .mismatch_mask is None  # written since 0.1.0: the key is there


def test_several_errors_still_one_line():
    msg = error_of(None, ["algorithm.eps_low=-1", "optim.lr=0"])
    assert msg == ("config error: algorithm.eps_low: Input should be greater than or equal to 0 (got -1) "
                   "(and 1 more)")


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert error_of(path) == f"config error: {path}: file not found"


def test_invalid_yaml_gives_line(tmp_path):
    path = write(tmp_path, "rollout:\n  group_size: 4\n  env: [calculator\nrun:\n  steps: 3\n")
    msg = error_of(path)
    assert msg.startswith(f"config error: {path}: invalid YAML at line 4, column 4: ")
    assert "\n" not in msg


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "- model\n- run\n")
    assert error_of(path) == (
        f"config error: {path}: expected a mapping of sections (model, sampler, ...) (got [model, run])")


def test_malformed_override():
    assert error_of(None, ["rollout.group_size"]) == (
        "config error: --set rollout.group_size: expected key=value, e.g. algorithm.kl_beta=0.01")
    msg = error_of(None, ["sampler.server_urls=[http://a"])
    assert msg.startswith("config error: sampler.server_urls: invalid YAML value '[http://a': ")


def test_override_below_a_value(tmp_path):
    path = write(tmp_path, "rollout:\n  group_size: 4\n")
    assert error_of(path, ["rollout.group_size.x=1"]) == (
        "config error: rollout.group_size: not a section, cannot set rollout.group_size.x")


def test_config_error_is_a_value_error_with_parts():
    with pytest.raises(ValueError) as info:
        load_config(None, ["optim.lr=-1"])
    assert info.value.where == "optim.lr"
    assert info.value.problem == "Input should be greater than 0 (got -1)"


# -- frozen and strict in code too -----------------------------------------------------------------
def test_frozen():
    cfg = TrainConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.rollout.group_size = 3
    with pytest.raises(pydantic.ValidationError):
        cfg.model = ModelConfig()
    new = cfg.model_copy(update={"rollout": RolloutConfig(group_size=3)})
    assert (new.rollout.group_size, cfg.rollout.group_size) == (3, 8)


def test_extra_forbidden_in_code():
    with pytest.raises(pydantic.ValidationError):
        AlgorithmConfig(kl_betta=0.1)


def test_gspo_gets_its_paper_defaults_unless_set():
    gspo = load_config(None, ["algorithm.loss=gspo"]).algorithm
    assert (gspo.eps_low, gspo.eps_high, gspo.aggregation) == (3e-4, 4e-4, "sequence_mean")
    mixed = load_config(None, ["algorithm.loss=gspo", "algorithm.eps_high=0.001", "algorithm.aggregation=token_mean"])
    assert (mixed.algorithm.eps_low, mixed.algorithm.eps_high, mixed.algorithm.aggregation) == \
        (3e-4, 1e-3, "token_mean")
    ppo = load_config(None, []).algorithm
    assert (ppo.eps_low, ppo.eps_high, ppo.aggregation, ppo.epochs, ppo.mini_batches) == (0.2, 0.28, "token_mean", 1, 1)
    # written out and read back, the resolved values stay
    assert load_config_text(dump_config(load_config(None, ["algorithm.loss=gspo"]))).algorithm == gspo


def load_config_text(text: str):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    return load_config(f.name)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.mini_batches=65"], "config error: algorithm.mini_batches: must be <= the rollouts of a step"),
    (["algorithm.dynamic_sampling=true", "algorithm.max_resample_batches=0"],
     "config error: algorithm.max_resample_batches: must be >= 1 with dynamic_sampling"),
    (["model.full_finetune=true", "model.init_adapter=runs/sft/adapter"],
     "config error: model.init_adapter: a LoRA adapter cannot start a full fine-tune"),
    (["model.lora_dropout=0.1", "algorithm.mini_batches=2"],
     "config error: model.lora_dropout: must be 0 with several optimizer steps per batch"),
    (["sft.direct_share=0.6", "sft.imperfect_share=0.5"],
     "config error: sft.imperfect_share: direct_share + imperfect_share must be <= 1 (got 0.6 + 0.5)"),
    (["algorithm.overlap_rollouts=true"],  # retired: a field that now says what to write instead
     "config error: algorithm.overlap_rollouts: retired; write algorithm.max_staleness: 1 for rollouts that run"),
    (["algorithm.overlap_rollouts=false"], "config error: algorithm.overlap_rollouts: retired; write"),
    (["algorithm.max_staleness=-1"], "config error: algorithm.max_staleness: Input should be greater than or equal"),
    (["algorithm.max_staleness=1", "algorithm.sample_ahead=2"],
     "config error: algorithm.sample_ahead: at most max_staleness (1), got 2.0: a group sampled further ahead"),
])
def test_settings_that_cannot_work_together_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_env_args_reach_load_tasks_and_a_wrong_name_is_one_line():
    """rollout.env_args is bound into the environment's load_tasks by the session (every command)."""
    from agent_rl.core.registry import load_env

    cfg = load_config(None, ["rollout.env=gui", "rollout.env_args={levels: [2]}"])
    spec = load_env(cfg.rollout.env).with_task_args(cfg.rollout.env_args)
    assert [t["level"] for t in spec.load_tasks(3, seed=0)] == [2, 2, 2]
    assert spec.load_tasks(3, seed=0, split="eval") == load_env("gui").load_tasks(3, seed=0, split="eval", levels=[2])
    assert load_env("gui").with_task_args({}) == load_env("gui")  # nothing bound: the same spec
    with pytest.raises(ValueError, match=r"^rollout.env_args: 'gui' load_tasks takes no argument 'level' "
                                         r"\(it takes: levels, turn_rewards\)$"):
        load_env("gui").with_task_args({"level": [2]})
    with pytest.raises(ValueError, match=r"'seed' is set by each command \(n, seed and split are\), not by env_args"):
        load_env("calculator").with_task_args({"seed": 3})
    with pytest.raises(ValueError, match=r"takes no argument 'levels' \(it takes: none besides n, seed and split\)"):
        load_env("toy").with_task_args({"levels": [1]})
