"""The whole run's config: every section gathered in `TrainConfig`, and the rules that span sections.

Owns: `TrainConfig` (model, sampler, rollout, algorithm, optim, run, judge, ray, sft, eval) and the
combinations of fields of different sections that cannot work together.
Does not own: the sections and their own rules (`core.config`; the algorithm section `learn.algorithm`),
reading YAML and `--set` overrides or writing a config back (`config.file`).

Why on the commands' floor: it gathers the algorithm section, which reads its names from the tables of
`learn`, and the ground-floor sections; only a command (trainer, sft, evaluate, cli) holds a whole run's
config, while each lower module takes the sections it reads.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from agent_rl.core.config import (
    EvalConfig,
    JudgeConfig,
    ModelConfig,
    OptimConfig,
    RayConfig,
    RolloutConfig,
    RunConfig,
    SamplerConfig,
    Section,
    SFTConfig,
)
from agent_rl.learn.algorithm import AlgorithmConfig


class TrainConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy and its adapter")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="the vLLM servers and sampling")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="environment and episode limits")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="advantages and the loss")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and micro-batching")
    run: RunConfig = Field(default_factory=RunConfig, description="length, seed, outputs and alarms")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="an LLM judge as a group reward (off)")
    ray: RayConfig = Field(default_factory=RayConfig, description="the Ray cluster of rollout.workers")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="cold-start demonstrations and SFT")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")

    @model_validator(mode="after")
    def _episode_fits_context(self) -> TrainConfig:
        if self.rollout.max_total_tokens > self.sampler.max_model_len:
            raise ValueError(f"rollout.max_total_tokens: must be <= sampler.max_model_len "
                             f"({self.sampler.max_model_len}) (got {self.rollout.max_total_tokens})")
        return self

    @model_validator(mode="after")
    def _settings_work_together(self) -> TrainConfig:
        model, algo, rollouts = self.model, self.algorithm, self.rollout.rollouts_per_step
        if model.full_finetune and model.sync == "adapter":
            raise ValueError("model.sync: a full fine-tune has no adapter to push; its weights are reloaded in "
                             "place (use merged or auto) (got adapter)")
        if model.full_finetune and model.init_adapter:
            raise ValueError(f"model.init_adapter: a LoRA adapter cannot start a full fine-tune "
                             f"(model.full_finetune is true) (got {model.init_adapter})")
        if algo.mini_batches > rollouts:
            raise ValueError(f"algorithm.mini_batches: must be <= the rollouts of a step, rollout.tasks_per_step "
                             f"x rollout.group_size ({rollouts}) (got {algo.mini_batches})")
        if model.lora_dropout > 0 and algo.epochs * algo.mini_batches > 1:
            raise ValueError(f"model.lora_dropout: must be 0 with several optimizer steps per batch "
                             f"(algorithm.epochs x mini_batches): the ratio to the old policy needs a "
                             f"deterministic forward pass (got {model.lora_dropout})")
        return self
