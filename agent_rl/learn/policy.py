"""The trained policy: a Hugging Face causal LM with a LoRA adapter or fully trainable, and its optimizer.

Owns: loading the model from a folder (`load_causal_lm`), making it trainable (`apply_lora`,
`enable_full_finetune`), `Policy` (the model with its optimizer, schedule, KL reference and device) and
`build_policy` (all of it from a config, starting from a fresh adapter, a saved one, or every weight,
on the configured device and in the configured precision, with gradient checkpointing where asked,
and under several ranks sharded over them, a full fine-tune's frozen KL reference too).
Does not own: log-probs (`learn.logprobs`), the loss and the optimizer step (`learn.update`), saving
or syncing weights (`rollout.weight_sync`, `runs.checkpoint`), resolving model specs (`learn.models`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from agent_rl.core.config import ModelConfig, OptimConfig
from agent_rl.learn.allocator import cap_heap_buffers
from agent_rl.learn.device import resolve_device, resolve_dtype
from agent_rl.learn.distributed import Dist, rank_device, shard_model
from agent_rl.learn.packing import supports_packing
from agent_rl.learn.reference import FrozenCopy, Reference, make_reference


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal LM from a local Hugging Face folder (`learn.models` resolves specs to one), frozen."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.requires_grad_(False)
    return model


def apply_lora(
    model: PreTrainedModel,
    rank: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
) -> PeftModel:
    """Wrap `model` with a fresh LoRA adapter; only the adapter's parameters are trainable.

    "all-linear" targets every linear projection of the transformer blocks (attention and MLP)
    and leaves the output layer alone, as peft defines it. Dropout > 0 makes two forward passes
    disagree; keep it 0 or compute no-grad log-probs in eval mode.
    """
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def enable_full_finetune(model: PreTrainedModel) -> PreTrainedModel:
    """Make every parameter trainable (a KL penalty then keeps a frozen copy: `learn.reference`)."""
    model.requires_grad_(True)
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class Policy:
    """The trained model and what updates it: optimizer, learning-rate schedule, KL reference."""

    model: PeftModel | PreTrainedModel  # a LoRA adapter on the model, or the model with every weight trainable
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # stepped once per optimizer step
    reference: Reference | None = None  # the starting policy, when the loss has a KL term
    device: torch.device = torch.device("cpu")
    dist: Dist = Dist()  # one process, or this rank of several (`learn.distributed`)
    # weights whose gradients ranks sum themselves: the LoRA adapter, or a full fine-tune's unsharded ones
    replicated: list[nn.Parameter] = field(default_factory=list)
    share_prefixes: bool = False  # micro-batches run packed (`learn.packing`): asked for, and the model can


def build_policy(model_cfg: ModelConfig, optim_cfg: OptimConfig, model_dir: str | Path, lr: float | None = None,
                 with_reference: bool = False, dist: Dist = Dist()) -> Policy:
    """The policy as `model.*` and `optim.*` of a config say: every weight trainable, a saved adapter
    (`init_adapter`) to continue, or a fresh LoRA; AdamW with a linear warm-up. `lr` overrides
    `optim.lr` (the SFT uses its own); `with_reference` keeps the starting policy for a KL term."""
    device = resolve_device(rank_device(dist, model_cfg.device))
    if device.type == "cpu":
        cap_heap_buffers()  # activations live in the C heap: keep its peak near what they use (`learn.allocator`)
    # transformers types the `to` it wraps with `self` as its first argument
    base = load_causal_lm(str(model_dir), resolve_dtype(model_cfg.dtype, device)).to(device)  # type: ignore[arg-type]
    model: PeftModel | PreTrainedModel
    if model_cfg.full_finetune:
        model = enable_full_finetune(base)
    elif model_cfg.init_adapter:
        model = PeftModel.from_pretrained(base, model_cfg.init_adapter, is_trainable=True)
    else:
        model = apply_lora(base, rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
                           dropout=model_cfg.lora_dropout, target_modules=model_cfg.target_modules)
    checkpointing = model_cfg.gradient_checkpointing
    if checkpointing or (checkpointing is None and not model_cfg.full_finetune):
        # each decoder layer keeps only its input and recomputes the rest in the backward pass;
        # non-reentrant, so frozen embeddings need no requires_grad trick for a LoRA's gradients
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = make_reference(model, model_cfg) if with_reference else None  # before sharding
    # several ranks: FSDP2 shards the decoder layers; a LoRA adapter stays whole on every rank
    adapter = set() if model_cfg.full_finetune else set(trainable_parameters(model))
    replicated = shard_model(model, dist, adapter)
    if isinstance(reference, FrozenCopy):  # full fine-tuning's frozen copy: its layers sharded as the policy's
        shard_model(reference.model, dist, set())
    optim = optim_cfg
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=lr if lr is not None else optim.lr,
                                  betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay)
    warmup = optim.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
    share = optim.share_prefixes and supports_packing(model.config)
    return Policy(model, optimizer, scheduler, reference, device, dist, replicated, share)
