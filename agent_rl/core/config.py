"""Run configuration sections that every floor reads: what to train, how to sample, where to write.

Owns: `ConfigError` (the one line naming the field that every config mistake becomes), `Section` (the frozen,
strict base of every section), and one frozen pydantic model per concern (`ModelConfig`, `SamplerConfig`,
`RolloutConfig` with its `EnvWeight`s, `OptimConfig`, `RunConfig`, `JudgeConfig`, `RayConfig`, and for the
cold start and evaluation `SFTConfig`, `EvalConfig`): their bounds and the combinations of their own fields that
cannot work together.
Does not own: the `algorithm` section (`learn.algorithm`: its choices are names from the tables of learn, which
this ground floor cannot import), the whole run's config that gathers every section, its cross-section rules
and its YAML files (`agent_rl.config`), acting on the values (the trainer, sampler, policy), or knowing which
environments or models exist (`core.registry`, `learn.models`): a bad name fails where it is resolved.

Every field is validated where it is declared, with `extra="forbid"` so a typo such as
`rollout.group_sise` is an error instead of a silently ignored key. Values that follow from
others are properties, never fields, so they cannot disagree.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ConfigError(ValueError):
    """A config mistake; `str(e)` is one line, `config error: <field>: <problem>`."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"config error: {where}: {problem}")
        self.where = where
        self.problem = problem


class Section(BaseModel):
    """What every section is: frozen, strict (`extra="forbid"`), its defaults validated too."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ModelConfig(Section):
    name: str = Field("smollm2-135m", min_length=1,
                      description="policy model: a local folder, a hub id, a .gguf file or a built-in name")
    lora_rank: int = Field(16, ge=1, description="LoRA rank r (ignored when full_finetune)")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha; the update is scaled by alpha / rank")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input")
    target_modules: str | list[str] = Field(
        "all-linear", description="modules that get adapters: 'all-linear' or a list of module names")
    full_finetune: bool = Field(False, description="train every weight instead of a LoRA adapter")
    device: str = Field("auto", min_length=1, description="trainer device: auto (CUDA when present, else cpu), cpu, "
                                                          "cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto", description="trainer (and started servers') precision: auto = bfloat16 on CUDA, float32 on the CPU; "
                            "float64 for exact checks")
    gradient_checkpointing: bool | None = Field(
        None, description="recompute each layer's activations in the backward pass; None: on for LoRA, "
                          "off for full fine-tuning")
    init_adapter: str | None = Field(
        None, description="peft adapter folder to start from (e.g. a cold-start SFT result); None: fresh")
    sync: Literal["adapter", "merged", "auto"] = Field(
        "auto", description="what servers sample a LoRA policy with: the adapter, merged weights reloaded "
                            "in place, or auto (a burst of each at start decides)")
    renderer: str = Field("auto", description="chat format: 'auto' (picked from the tokenizer) or a family name "
                                              "from agent_rl.core.renderers.choose "
                                              "(chatml, qwen3, llama3, gemma3, generic...)")
    bare_tool_calls: bool | None = Field(
        None, description="read a reply of bare JSON calls ({\"name\": ..., \"arguments\": {...}} without "
                          "<tool_call> tags) as those calls; null: the renderer's default (on for qwen2_5, off for "
                          "chatml; other families have no such switch)")

    @field_validator("renderer")
    @classmethod
    def _known_renderer(cls, v: str) -> str:
        from agent_rl.core.renderers.choose import (
            RENDERER_NAMES,  # same floor; imported late: it loads every family
        )

        if v not in RENDERER_NAMES:
            raise ValueError(f"unknown renderer {v!r} (known: {', '.join(RENDERER_NAMES)})")
        return v

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, v: str | list[str]) -> str | list[str]:
        if not v:
            raise ValueError("must name at least one module (got [])")
        return v


class SamplerConfig(Section):
    server_urls: list[str] = Field(
        default_factory=list, description="running vLLM servers to attach to; empty: start one here")
    temperature: float = Field(1.0, gt=0.0,
                               description="sampling temperature (>0: the policy's own distribution at 1.0)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1.0 keeps the log-probs on-policy")
    request_timeout_s: float = Field(300.0, gt=0.0,
                                     description="seconds before one completion request is an infra error")
    kv_cache_gib: int = Field(2, ge=1, description="KV-cache size in whole GiB of a server started here (CPU build)")
    num_servers: int = Field(1, ge=1, description="vLLM servers a run starts itself (one per GPU on a GPU machine: "
                                                 "server i sees GPU i mod count); ignored with server_urls")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, lt=1.0, description="share of the GPU a server started here may take (GPU build): leave the "
                                         "trainer's weights, gradients and optimizer room on the same GPU")
    max_model_len: int = Field(4096, ge=1, description="context length of a server started here")
    max_restarts: int = Field(3, ge=0, description="restarts of each server `train` started (on exit or no answer "
                                                   "to its health probe) before the run checkpoints and stops")
    health_timeout_s: float = Field(60.0, gt=0.0, description="seconds without an answer to its health probe "
                                                              "after which a server counts as dead (restarted, or "
                                                              "waited for)")
    attach_wait_s: float = Field(300.0, ge=0.0, description="seconds `train` waits for a server of server_urls that "
                                                            "stopped answering before the run checkpoints and stops")


class EnvWeight(Section):
    name: str = Field(..., min_length=1, description="built-in name, module name or .py file (core.registry)")
    weight: float = Field(1.0, gt=0.0, description="share of the task slots it gets: weight / sum of weights")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of its load_tasks")


class RolloutConfig(Section):
    env: str | None = Field("calculator", min_length=1,
                            description="built-in name, module name or .py file (core.registry); null with envs")
    envs: list[EnvWeight] = Field(
        default_factory=list, description="several environments in one run, as [{name, weight}, ...] or "
                                          "{name: weight}; tasks are drawn in proportion to the weights")
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment's load_tasks, e.g. {levels: [1, 2]} "
                                          "for gui, {empty_results: bare} for kg_qa (with envs: each entry's args)")
    tasks_per_step: int = Field(8, ge=1, description="distinct tasks per optimizer step")
    group_size: int = Field(8, ge=2, description="rollouts per task; advantages compare within a group")
    max_turns: int = Field(4, ge=1, description="assistant turns per episode before it is truncated")
    max_tokens_per_turn: int = Field(128, ge=1, description="sampled tokens per assistant turn")
    max_total_tokens: int = Field(1024, ge=1, description="tokens per episode, prompt and tool output included")
    max_concurrent: int = Field(64, ge=1, description="episodes in flight at once across all servers")
    on_error: Literal["retry", "drop_group", "keep"] = Field("retry", description="an episode whose env or sampler "
        "failed: retry it (fresh env, same seed), then drop its group; drop its group; keep the group's other episodes")
    max_retries: int = Field(2, ge=0, description="retries of a failed episode under on_error: retry")
    workers: int = Field(0, ge=0, description="rollout workers, each a Ray actor with its own event loop playing "
                                              "episodes (pip install 'agent-rl[ray]'; ray section); 0: in this process")

    @model_validator(mode="before")
    @classmethod
    def _envs_replace_env(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("envs"), dict):  # {name: weight}
            data = {**data, "envs": [{"name": k, "weight": v} for k, v in data["envs"].items()]}
        if isinstance(data, dict) and data.get("envs") and "env" not in data:
            data = {**data, "env": None}  # a list of environments, and no default one beside it
        return data

    @model_validator(mode="after")
    def _env_or_envs(self) -> RolloutConfig:
        if self.envs and self.env is not None:
            raise ValueError(f"envs: give one environment (env) or a weighted list (envs), not both; set "
                             f"rollout.env=null to use rollout.envs (got env: {self.env})")
        if not self.envs and self.env is None:
            raise ValueError("env: name an environment, or list several in rollout.envs (got null)")
        if self.envs and self.env_args:
            raise ValueError("env_args: for rollout.env alone; give each of rollout.envs its own args "
                             "([{name, weight, args}, ...])")
        names = [e.name for e in self.envs]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"envs: each environment once; give it a larger weight instead "
                             f"(got {', '.join(dup)} twice)")
        return self

    @model_validator(mode="after")
    def _turn_fits_episode(self) -> RolloutConfig:
        if self.max_tokens_per_turn > self.max_total_tokens:
            raise ValueError(f"max_tokens_per_turn: must be <= max_total_tokens ({self.max_total_tokens}) "
                             f"(got {self.max_tokens_per_turn})")
        return self

    @property
    def rollouts_per_step(self) -> int:
        return self.tasks_per_step * self.group_size

    @property
    def mixture(self) -> tuple[tuple[str, float], ...]:
        """(name, weight) of every environment of the run: `envs`, or `env` alone with weight 1."""
        return tuple((e.name, e.weight) for e in self.envs) if self.envs else ((str(self.env), 1.0),)


class OptimConfig(Section):
    lr: float = Field(5e-5, gt=0.0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW first-moment decay")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW second-moment decay")
    grad_clip: float = Field(1.0, gt=0.0, description="clip the global gradient norm to this")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps from 0 to lr")
    micro_batch_tokens: int = Field(4096, ge=1, description="padded tokens per forward/backward micro-batch "
                                                            "(packed tokens with share_prefixes)")
    share_prefixes: bool = Field(
        True, description="run each micro-batch packed, a prefix its rows share (the prompt, the tool schemas) "
                          "computed once (learn.packing); off by itself for models whose attention cannot take it")
    logprob_chunk: int = Field(
        512, ge=1, description="tokens (rows x positions) per chunk of the output layer and log-softmax: bounds "
                               "the vocabulary-wide logits held at once")


class RayConfig(Section):
    address: str | None = Field(
        None, description="Ray cluster the rollout workers join: host:port of its head, ray://host:port, or auto "
                          "(the one running on this machine); null: RAY_ADDRESS, else a cluster of this machine "
                          "started for the run (also: local)")
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs each rollout worker reserves on its node")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources each rollout worker needs, e.g. {docker: 1}: it starts "
                                          "only on a node that declares them (ray start --resources)")
    max_restarts: int = Field(3, ge=-1, description="times Ray restarts a rollout worker that died (-1: always); its "
                                                   "episodes meanwhile are infrastructure errors (rollout.on_error)")
    start_timeout_s: float = Field(120.0, gt=0.0, description="seconds for the workers to start, or a dead one to "
                                                              "come back, before the run fails")


class RunConfig(Section):
    steps: int = Field(20, ge=1, description="optimizer steps")
    seed: int = Field(0, description="seed for task order, sampling and initialisation")
    run_dir: str = Field("runs/default", min_length=1, description="folder for config, metrics, plots and checkpoints")
    save_every: int = Field(1, ge=1, description="save a checkpoint every this many steps")
    keep_checkpoints: int = Field(2, ge=1, description="most recent checkpoints kept on disk")
    tensorboard: bool = Field(True, description="write TensorBoard scalars to run_dir")
    wandb_project: str | None = Field(None, description="also log to this Weights & Biases project; None: off")
    collapse_drop: float = Field(
        0.5, ge=0.0, le=1.0, description="warn when the tool-use rate falls below this fraction of its running peak")
    entropy_floor: float = Field(0.05, ge=0.0, description="warn when the mean policy entropy falls below this")
    trace_groups: int = Field(
        2, ge=0, description="groups of each step written whole to run_dir/traces for `agent-rl view` (half of "
                             "them, at least one, with a failure or truncation where any; the rest spread over "
                             "the step); 0: off")


class JudgeConfig(Section):
    url: str | None = Field(
        None, description="an OpenAI-compatible server ranking each group's answers: 'run' (the run's own vLLM "
                          "server) or a base URL (http://host:8000); null: no judge")
    model: str = Field("base", min_length=1, description="the model name the judge server serves "
                                                         "('base' on the run's own server)")
    weight: float = Field(1.0, ge=0.0, description="reward += weight x judge score (best 1 .. worst 0); 0: a metric")
    prompt: str | None = Field(None, description="file with the judge's prompt template ({question}, {answers}, "
                                                 "{n}, {reference}); null: the built-in one")
    reference: str | None = Field("answer", description="task column shown to the judge as the reference answer "
                                                        "when a task has it; null: never")
    max_tokens: int = Field(128, ge=1, description="tokens the judge may write")
    temperature: float = Field(0.0, ge=0.0, description="the judge's sampling temperature")
    timeout_s: float = Field(60.0, gt=0.0, le=100.0, description="seconds per judge request (below the 120 s "
                                                                 "deadline of every environment call)")
    api_key_env: str | None = Field(None, description="environment variable holding the server's API key "
                                                      "(never the key itself: config.yaml is saved in the run)")


class SFTConfig(Section):
    demos: str = Field("runs/demos.jsonl", min_length=1, description="demonstrations file (`agent-rl demos` writes it)")
    num_demos: int = Field(256, ge=1, description="tasks the scripted solver plays for `agent-rl demos`")
    direct_share: float = Field(0.3, ge=0.0, le=1.0,
                                description="share of demonstrations that answer without a tool")
    imperfect_share: float = Field(
        0.0, ge=0.0, le=1.0, description="share of demonstrations with one recoverable mistake (the environment's "
                                         "`mistake`, then the solver's fix); disjoint from direct_share")
    epochs: int = Field(2, ge=1, description="passes over the demonstrations")
    batch_size: int = Field(16, ge=1, description="demonstrations per optimizer step")
    lr: float = Field(2.0e-4, gt=0.0, description="AdamW learning rate of the SFT (warm-up from optim.warmup_steps)")
    run_dir: str = Field("runs/sft", min_length=1,
                         description="SFT outputs: metrics, checkpoints, and adapter/ (the GRPO run's init_adapter)")

    @model_validator(mode="after")
    def _shares_fit(self) -> SFTConfig:
        if self.direct_share + self.imperfect_share > 1.0:
            raise ValueError(f"imperfect_share: direct_share + imperfect_share must be <= 1 (got {self.direct_share} "
                             f"+ {self.imperfect_share})")
        return self


class EvalConfig(Section):
    tasks: int = Field(64, ge=1, description="held-out tasks evaluated")
    samples: int = Field(4, ge=1, description="rollouts per task (K of pass@K)")
    split: str = Field("eval", min_length=1, description="the environment's split to draw tasks from")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature of the evaluation rollouts")
    success_threshold: float = Field(1.0, description="a rollout counts as solved when its reward reaches this")
    seed: int = Field(12345, description="seed of the held-out tasks and of sampling (fixed: reports compare)")
