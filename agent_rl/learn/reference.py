"""The KL reference: the policy a run started from, kept frozen, and its log-probs.

Owns: `Reference` (the starting policy's log-probs of a micro-batch, scored as the policy's own:
`learn.logprobs.score`), `make_reference(model, model_cfg)` and the three kinds of reference it picks from,
each only a way to switch the model to the starting policy while it scores:
- `BaseWeights`: a fresh LoRA starts as the base model (peft initialises B = 0), so the reference is
  the model with its adapter switched off;
- `SavedAdapter`: a run that starts from a saved adapter (`model.init_adapter`, e.g. the cold-start
  SFT) keeps a second, never-trained copy of that adapter under the name "reference": the KL term
  pulls toward the starting policy, not toward a base model that never called a tool;
- `FrozenCopy`: full fine-tuning keeps a frozen copy of the starting weights (twice the weights'
  memory; on a GPU plan for it, or run with `kl_beta: 0`). Under several ranks the copy's decoder layers
  are sharded like the policy's (`learn.policy.build_policy`), so each rank holds 1/N of them.
The reference is built before a resumed run loads its checkpoint, so it stays the starting policy.
Does not own: the KL term itself (`learn.loss.k3_kl`), when it is used (`learn.update`).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from peft import PeftModel
from torch import nn

from agent_rl.core.config import ModelConfig
from agent_rl.learn.batching import Batch
from agent_rl.learn.distributed import reshard
from agent_rl.learn.logprobs import Scoring, score


class Reference(ABC):
    """The policy a run started from."""

    def __init__(self, model: nn.Module):
        self.model = model  # the model that scores as the starting policy while `starting_policy()` is on

    @torch.no_grad()
    def logprobs(self, mb: Batch, scoring: Scoring) -> torch.Tensor:
        """logp_B_T of the starting policy at `mb`'s sampled tokens (shift convention of `learn.batching`),
        without gradient."""
        with self.starting_policy():
            return score(self.model, mb, scoring).logp_B_T

    @abstractmethod
    def starting_policy(self) -> AbstractContextManager[object]:
        """While on, `self.model` scores as the starting policy."""


class BaseWeights(Reference):
    model: PeftModel

    def __init__(self, model: PeftModel):
        super().__init__(model)

    def starting_policy(self) -> AbstractContextManager[object]:
        return self.model.disable_adapter()


class SavedAdapter(Reference):
    NAME = "reference"
    model: PeftModel

    def __init__(self, model: PeftModel, path: str):
        super().__init__(model)
        self.trained = model.active_adapter
        model.load_adapter(path, adapter_name=self.NAME, is_trainable=False)
        model.set_adapter(self.trained)  # loading may not switch, but make sure the trained one is active

    @contextmanager
    def starting_policy(self) -> Iterator[None]:
        # set_adapter also sets requires_grad: the trained adapter must be trainable again afterwards
        self.model.set_adapter(self.NAME)
        try:
            yield
        finally:
            self.model.set_adapter(self.trained)


class FrozenCopy(Reference):
    def __init__(self, model: nn.Module):
        super().__init__(copy.deepcopy(model).eval().requires_grad_(False))

    @contextmanager
    def starting_policy(self) -> Iterator[None]:
        try:
            yield
        finally:
            reshard(self.model)  # several ranks: the copy's layers are sharded, and stay so between passes


def make_reference(model: nn.Module, model_cfg: ModelConfig) -> Reference:
    """The starting policy of `model` as `model.*` of a config built it (`learn.policy.build_policy`)."""
    if model_cfg.full_finetune:
        return FrozenCopy(model)
    if not isinstance(model, PeftModel):
        raise TypeError(f"{type(model).__name__}: a LoRA run's reference needs the peft model")
    if model_cfg.init_adapter:
        return SavedAdapter(model, model_cfg.init_adapter)
    return BaseWeights(model)
