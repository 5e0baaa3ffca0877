"""The `algorithm` section: advantages, the loss, the off-policy correction, staleness and credit per turn.

Owns: `AlgorithmConfig`, its bounds and the combinations of its own fields that cannot work together, and
`LOSS_DEFAULTS` (what `loss` implies for the fields a config leaves out).
Does not own: the other sections and `TrainConfig` (`core.config`, which re-exports this one), acting on the
values (`learn.advantages`, `learn.loss`, `learn.update`, `rollout.admission`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agent_rl.core.config_base import _Section

# what `loss` implies for the fields a config leaves out: DAPO's clip-higher for PPO; the GSPO paper's
# sequence-level ranges (a sequence ratio moves far less than a token ratio) and per-sequence mean
LOSS_DEFAULTS = {"ppo": {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token_mean"},
                 "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "sequence_mean"}}


class AlgorithmConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo"] = Field(
        "grpo", description="advantage estimator: (r - mean) / std, r - mean, or leave-one-out")
    loss: Literal["ppo", "gspo"] = Field("ppo", description="token-ratio PPO clip, or GSPO's sequence ratio")
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = Field(
        "token_mean", description="loss reduction: per token of the step, per sequence, or / constant_norm_tokens "
                                  "(default: token_mean for ppo, sequence_mean for gspo)")
    eps_low: float = Field(0.2, ge=0.0, lt=1.0,
                           description="clip the ratio below at 1 - eps_low (default 0.2 for ppo, 3e-4 for gspo)")
    eps_high: float = Field(0.28, ge=0.0, description="clip the ratio above at 1 + eps_high (DAPO clip-higher; "
                                                      "default 0.28 for ppo, 4e-4 for gspo)")
    epochs: int = Field(1, ge=1, description="passes over each batch of rollouts")
    mini_batches: int = Field(
        1, ge=1, description="optimizer steps per pass: the batch is shuffled and split into this many; "
                             "epochs x mini_batches > 1 makes the PPO ratio move (and clip)")
    kl_beta: float = Field(0.0, ge=0.0,
                           description="weight of the k3 KL penalty to the starting policy; 0: no reference")
    tis_cap: float | None = Field(
        2.0, gt=0.0, description="TIS: weight each token by min(pi_proximal / pi_behaviour, tis_cap) (decoupled "
                                 "PPO's off-policy weight: staleness and sampler/trainer mismatch); None: weight 1")
    mismatch_mask: Literal["token", "sequence"] | None = Field(
        None, description="MIS: drop from the loss each token (IcePop) or whole sequence (geometric mean) whose "
                          "pi_proximal / pi_behaviour leaves mismatch_bounds; None: drop nothing")
    mismatch_bounds: tuple[float, float] = Field(
        (0.5, 2.0), description="[low, high]: the ratio pi_proximal / pi_behaviour that mismatch_mask keeps")
    truncated_reward: float | None = Field(
        None, description="reward given to truncated episodes; None: they are masked out of the loss")
    dynamic_sampling: bool = Field(False, description="resample groups without reward variance (DAPO)")
    max_resample_batches: int = Field(
        2, ge=0, description="times a group slot is refilled with a new task: its group had no reward variance "
                             "(dynamic sampling) or every episode of it failed on infrastructure")
    max_staleness: int = Field(
        0, ge=0, description="policy versions a trained token may lag behind the trainer: 0 the synchronous loop; "
                             "k > 0 rollouts stream on while the trainer trains, a group starting only if it can be "
                             "trained within k versions (docs/async.md)")
    sample_ahead: float | None = Field(
        None, ge=0.0, description="steps' worth of groups the stream may play ahead of the step being trained, 0 .. "
                                  "max_staleness (smaller: lower lag, fewer episodes playing); None: max_staleness "
                                  "(docs/async.md)")
    constant_norm_tokens: int = Field(1024, ge=1, description="normaliser of the 'constant' aggregation (Dr. GRPO)")
    credit: Literal["trajectory", "turn", "gigpo"] = Field(
        "trajectory", description="which advantage a turn's tokens get: the episode's, the turn's own return against "
                                  "the group, or the episode's + step_weight x the turn's among same-state turns "
                                  "(learn.credit)")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of later turns' rewards and the outcome in a "
                                                          "turn's return (credit: turn or gigpo)")
    step_weight: float = Field(1.0, ge=0.0, description="weight of GiGPO's step-level advantage (credit: gigpo)")

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        if isinstance(data, dict) and "overlap_rollouts" in data:
            raise ValueError("overlap_rollouts: retired; write algorithm.max_staleness: 1 for rollouts that run one "
                             "version ahead of the trainer (0: the synchronous loop)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _loss_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("loss", "ppo") in LOSS_DEFAULTS:
            return {**LOSS_DEFAULTS[data.get("loss", "ppo")], **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _bounds_name_a_mask(cls, data: Any) -> Any:
        # before the decoupled correction, bounds alone dropped sequences (null: none); now they only set the range
        # of mismatch_mask, so a config of that time means the same or is told what to write
        if not isinstance(data, dict) or "mismatch_bounds" not in data:
            return data
        if data["mismatch_bounds"] is None:
            if data.get("mismatch_mask") is not None:
                raise ValueError("mismatch_bounds: give [low, high] for mismatch_mask (got null)")
            return {k: v for k, v in data.items() if k != "mismatch_bounds"}
        if "mismatch_mask" not in data:
            raise ValueError("mismatch_mask: mismatch_bounds alone drops nothing; add mismatch_mask: sequence (what "
                             "bounds alone did before) or token (IcePop's token mask)")
        return data

    @field_validator("mismatch_bounds")
    @classmethod
    def _bounds_around_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 < v[0] <= 1.0 <= v[1]:
            raise ValueError(f"must satisfy 0 < low <= 1 <= high (got [{v[0]}, {v[1]}])")
        return v

    @model_validator(mode="after")
    def _credit_fits(self) -> AlgorithmConfig:
        if self.credit != "trajectory" and self.loss == "gspo":
            raise ValueError(f"credit: {self.credit} gives each turn its own advantage, but loss: gspo has one ratio "
                             "and one advantage per sequence; use loss: ppo, or credit: trajectory")
        for name, readers in (("gamma", ("turn", "gigpo")), ("step_weight", ("gigpo",))):
            if getattr(self, name) != type(self).model_fields[name].default and self.credit not in readers:
                raise ValueError(f"{name}: read only with credit: {' or '.join(readers)}, so it would change "
                                 f"nothing (got credit: {self.credit})")
        return self

    @model_validator(mode="after")
    def _ahead_within_staleness(self) -> AlgorithmConfig:
        if self.sample_ahead is not None and self.sample_ahead > self.max_staleness:
            raise ValueError(f"sample_ahead: at most max_staleness ({self.max_staleness}), got {self.sample_ahead}: a "
                             "group sampled further ahead could not be trained within max_staleness versions")
        return self

    def slots_ahead(self, tasks_per_step: int) -> int:
        """Group slots the stream may open beyond those of the step being trained (`rollout.admission`)."""
        return round((self.max_staleness if self.sample_ahead is None else self.sample_ahead) * tasks_per_step)

    @model_validator(mode="after")
    def _resampling_needs_rounds(self) -> AlgorithmConfig:
        if self.dynamic_sampling and self.max_resample_batches == 0:
            raise ValueError("max_resample_batches: must be >= 1 with dynamic_sampling (got 0): "
                             "there would be nothing to resample with")
        return self
