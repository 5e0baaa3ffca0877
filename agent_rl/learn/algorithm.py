"""The `algorithm` section: advantages, the loss, the off-policy correction, staleness and credit per turn,
each choice a name from the one table of its functions.

Owns: `AlgorithmConfig`, its bounds and the combinations of its own fields that cannot work together; the
names each choice allows (`CHOICES`: a field and its table, whose keys are the names) and what a loss implies
for the fields a config leaves out (its row of `learn.loss.LOSSES`); `credit_of`, the credit rule a config
names; and the one-line refusals of forms only a config written before 0.1.0 holds.
Does not own: the tables and their functions (`learn.advantages.ESTIMATORS`, `learn.loss.LOSSES`,
`AGGREGATIONS`, `MISMATCH_MASKS`, `learn.credit.CREDITS`), the other sections and `ConfigError`
(`core.config`), the whole run's config and its files (`agent_rl.config`), acting on the values
(`learn.update`, `learn.credit`, the trainer).

Why this section sits in learn, above its tables, and not in core with the others: the names a config may
write are the keys of the tables that hold the functions, so the config reads them there; a list of the
names kept in core would be a second list that drifts from the first. The tables' modules import no config
(they are pure functions and their rows); this module reads them; what acts on a config (`learn.update`,
the trainer) imports this module. So adding a loss is one function and one row of `LOSSES`: this section
then allows its name and fills in its defaults (docs/algorithms.md shows the diff).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from agent_rl.core.config import Section
from agent_rl.learn.advantages import ESTIMATORS
from agent_rl.learn.credit import CREDITS, TurnCredit
from agent_rl.learn.loss import AGGREGATIONS, LOSSES, MISMATCH_MASKS

# each choice of the section and its one table: the names a config may write are the table's keys
CHOICES: dict[str, Mapping[str, object]] = {"advantage": ESTIMATORS, "loss": LOSSES, "aggregation": AGGREGATIONS,
                                            "mismatch_mask": MISMATCH_MASKS, "credit": CREDITS}
DEFAULT_LOSS = "ppo"
# the fields a credit rule reads besides the estimator (gamma, step_weight), in table order
CREDIT_SETTINGS = tuple(dict.fromkeys(name for credit in CREDITS.values() for name in credit.reads))


def _names(table: Mapping[str, object]) -> str:
    return ", ".join(table)


def _per_loss(field: str) -> str:
    """What each loss implies for `field`, for its description: `ppo 0.2, gspo 0.0003`."""
    return ", ".join(f"{name} {getattr(loss, field)}" for name, loss in LOSSES.items())


def _readers(field: str) -> list[str]:
    """The credit rules that read `field`."""
    return [name for name, credit in CREDITS.items() if field in credit.reads]


class AlgorithmConfig(Section):
    advantage: str = Field("grpo", description=f"advantage estimator: {_names(ESTIMATORS)} "
                                               "(learn.advantages.ESTIMATORS)")
    loss: str = Field(DEFAULT_LOSS, description=f"policy-gradient loss: {_names(LOSSES)} (learn.loss.LOSSES); "
                                                "each implies eps_low, eps_high and aggregation unless set")
    aggregation: str = Field(
        LOSSES[DEFAULT_LOSS].aggregation, description=f"loss reduction: {_names(AGGREGATIONS)} "
                                                      f"(learn.loss.AGGREGATIONS; default: {_per_loss('aggregation')})")
    eps_low: float = Field(LOSSES[DEFAULT_LOSS].eps_low, ge=0.0, lt=1.0,
                           description=f"clip the ratio below at 1 - eps_low (default: {_per_loss('eps_low')})")
    eps_high: float = Field(LOSSES[DEFAULT_LOSS].eps_high, ge=0.0, description=(
        f"clip the ratio above at 1 + eps_high (DAPO clip-higher; default: {_per_loss('eps_high')})"))
    epochs: int = Field(1, ge=1, description="passes over each batch of rollouts")
    mini_batches: int = Field(
        1, ge=1, description="optimizer steps per pass: the batch is shuffled and split into this many; "
                             "epochs x mini_batches > 1 makes the PPO ratio move (and clip)")
    kl_beta: float = Field(0.0, ge=0.0,
                           description="weight of the k3 KL penalty to the starting policy; 0: no reference")
    tis_cap: float | None = Field(
        2.0, gt=0.0, description="TIS: weight each token by min(pi_proximal / pi_behaviour, tis_cap) (decoupled "
                                 "PPO's off-policy weight: staleness and sampler/trainer mismatch); None: weight 1")
    mismatch_mask: str | None = Field(
        None, description=f"MIS: drop from the loss the tokens whose pi_proximal / pi_behaviour leaves "
                          f"mismatch_bounds, one by one or by sequence: {_names(MISMATCH_MASKS)} "
                          "(learn.loss.MISMATCH_MASKS); None: drop nothing")
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
    credit: str = Field("trajectory", description=f"which advantage a turn's tokens get: {_names(CREDITS)} "
                                                  "(learn.credit.CREDITS)")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of later turns' rewards and the outcome in a "
                                                          f"turn's return (credit: {' or '.join(_readers('gamma'))})")
    step_weight: float = Field(1.0, ge=0.0, description="weight of GiGPO's step-level advantage "
                                                        f"(credit: {' or '.join(_readers('step_weight'))})")
    tool_branches: float = Field(
        0.0, ge=0.0, le=1.0, description="branching at the tool decision: a group whose rollouts never tried a tool, "
                                         "or whose tool-using rollouts all failed, gets this share of group_size (at "
                                         "least one) as branches of its own episodes (rollout.branching); 0: off")
    force_call: bool = Field(True, description="with tool_branches: a group without a tool attempt branches at a "
                                               "turn's start with the opening of a call forced (off: it does not "
                                               "branch)")

    @model_validator(mode="before")
    @classmethod
    def _written_before_0_1_0(cls, data: Any) -> Any:
        # forms that only a config written before 0.1.0 holds: each refused with what changed, none read
        if not isinstance(data, dict):
            return data
        if "overlap_rollouts" in data:
            raise ValueError("overlap_rollouts: retired; write algorithm.max_staleness: 1 for rollouts that run one "
                             "version ahead of the trainer (0: the synchronous loop)")
        if "mismatch_bounds" in data and data["mismatch_bounds"] is None:
            raise ValueError("mismatch_bounds: null meant no mask before 0.1.0; now mismatch_mask: null is no mask "
                             "and the bounds are its range: leave mismatch_bounds out (got null)")
        if "mismatch_bounds" in data and "mismatch_mask" not in data:
            raise ValueError("mismatch_mask: mismatch_bounds alone drops nothing since 0.1.0; add mismatch_mask: "
                             "sequence (what bounds alone did before) or token (IcePop's token mask)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _loss_defaults(cls, data: Any) -> Any:
        name = data.get("loss", DEFAULT_LOSS) if isinstance(data, dict) else None
        if isinstance(name, str) and name in LOSSES:
            loss = LOSSES[name]
            return {"eps_low": loss.eps_low, "eps_high": loss.eps_high, "aggregation": loss.aggregation, **data}
        return data

    @field_validator(*CHOICES)
    @classmethod
    def _named_in_its_table(cls, v: str | None, info: ValidationInfo) -> str | None:
        table = CHOICES[info.field_name or ""]
        if v is not None and v not in table:
            raise ValueError(f"must be one of {_names(table)} (got {v})")
        return v

    @field_validator("mismatch_bounds")
    @classmethod
    def _bounds_around_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 < v[0] <= 1.0 <= v[1]:
            raise ValueError(f"must satisfy 0 < low <= 1 <= high (got [{v[0]}, {v[1]}])")
        return v

    @model_validator(mode="after")
    def _credit_fits(self) -> AlgorithmConfig:
        if CREDITS[self.credit].assign is not None and not LOSSES[self.loss].per_token_advantages:
            losses = [name for name, loss in LOSSES.items() if loss.per_token_advantages]
            whole = [name for name, credit in CREDITS.items() if credit.assign is None]
            raise ValueError(f"credit: {self.credit} gives each turn its own advantage, but loss: {self.loss} has one "
                             f"ratio and one advantage per sequence; use loss: {' or '.join(losses)}, or credit: "
                             f"{' or '.join(whole)}")
        for name in CREDIT_SETTINGS:
            if getattr(self, name) != type(self).model_fields[name].default and name not in CREDITS[self.credit].reads:
                raise ValueError(f"{name}: read only with credit: {' or '.join(_readers(name))}, so it would change "
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


def credit_of(algo: AlgorithmConfig) -> TurnCredit | None:
    """The credit rule `algorithm.credit` names; None where its row has no rule (`trajectory`: every token gets
    its episode's advantage, as always)."""
    if CREDITS[algo.credit].assign is None:
        return None
    return TurnCredit(algo.credit, algo.advantage, algo.gamma, algo.step_weight)
