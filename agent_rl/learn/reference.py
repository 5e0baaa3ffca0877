"""The KL reference: the policy a run started from, kept frozen, and its log-probs.

Owns: `make_reference(model, model_cfg)` and the three kinds of reference it picks from:
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
from typing import Any, Protocol

import torch
from peft import PeftModel

from agent_rl.learn.distributed import reshard
from agent_rl.learn.logprobs import token_logprobs


class Reference(Protocol):
    def logprobs(self, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor, temperature: float,
                 chunk_size: int, positions_B_T: torch.Tensor | None = None,
                 share_prefixes: bool = False) -> torch.Tensor:
        """logp_B_T of the reference policy (shift convention of `learn.batching`), without gradient;
        `positions_B_T` and `share_prefixes` as `learn.logprobs.token_logprobs`."""


class BaseWeights:
    def __init__(self, model: PeftModel):
        self.model = model

    @torch.no_grad()
    def logprobs(self, input_ids_B_T, attention_mask_B_T, temperature, chunk_size, positions_B_T=None,
                 share_prefixes=False):
        with self.model.disable_adapter():
            return token_logprobs(self.model, input_ids_B_T, attention_mask_B_T, temperature, chunk_size,
                                  positions_B_T, share_prefixes).logp_B_T


class SavedAdapter:
    NAME = "reference"

    def __init__(self, model: PeftModel, path: str):
        self.model = model
        self.trained = model.active_adapter
        model.load_adapter(path, adapter_name=self.NAME, is_trainable=False)
        model.set_adapter(self.trained)  # loading may not switch, but make sure the trained one is active

    @torch.no_grad()
    def logprobs(self, input_ids_B_T, attention_mask_B_T, temperature, chunk_size, positions_B_T=None,
                 share_prefixes=False):
        # set_adapter also sets requires_grad: the trained adapter must be trainable again afterwards
        self.model.set_adapter(self.NAME)
        try:
            return token_logprobs(self.model, input_ids_B_T, attention_mask_B_T, temperature, chunk_size,
                                  positions_B_T, share_prefixes).logp_B_T
        finally:
            self.model.set_adapter(self.trained)


class FrozenCopy:
    def __init__(self, model: torch.nn.Module):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, input_ids_B_T, attention_mask_B_T, temperature, chunk_size, positions_B_T=None,
                 share_prefixes=False):
        try:
            return token_logprobs(self.model, input_ids_B_T, attention_mask_B_T, temperature, chunk_size,
                                  positions_B_T, share_prefixes).logp_B_T
        finally:
            reshard(self.model)  # several ranks: the copy's layers are sharded, and stay so between passes


def make_reference(model: Any, model_cfg: Any) -> Reference:
    """The starting policy of `model` as `model.*` of a config built it (`learn.policy.build_policy`)."""
    if model_cfg.full_finetune:
        return FrozenCopy(model)
    if model_cfg.init_adapter:
        return SavedAdapter(model, model_cfg.init_adapter)
    return BaseWeights(model)
