"""Data-parallel training under torchrun: who does what, and the few collectives that make N ranks one trainer.

Owns: `Dist` (rank, world, the process group: gloo on the CPU, NCCL on CUDA, from torchrun's
environment; a single process is world 1 and every helper here is then a no-op), `shard_model`
(FSDP2 `fully_shard` over each decoder layer, then the whole model), `reshard` (after a no-grad pass), and
the collectives, on tensors and plain data: `broadcast` (rank 0's object to every rank), `gather_objects`
(every rank's object on every rank), `max_over_ranks`, `sum_over_ranks`, `all_reduce_adapter_grads`,
`clip_grad_norm` (over sharded and whole gradients), and for full fine-tuning `full_state_dict`,
`full_optimizer_state` (a sharded model's weights and AdamW moments gathered whole on rank 0) and
`GatheredModel` (those weights, saved as the model would save itself).
Does not own: which rows a rank trains on and the batch operations around it (`learn.batching`), the loss
(`learn.loss`), the update loop (`learn.update`), sampling (`rollout`).

The design, in one place:
- Rank 0 samples. It owns the event loop, the vLLM servers and the sampler, scores the rollouts,
  computes advantages and collates the batch, then broadcasts the batch; every rank (rank 0 too)
  trains on its share of each optimizer step's rows. Rank 0 alone logs, writes checkpoints and pushes
  weights to the servers; the other ranks follow the same sequence of collectives (`trainer.follow`).
- One global normaliser. Rows are dealt to ranks after the batch is split into optimizer steps, and
  every row keeps its step's token and sequence counts, so each rank's loss is its share of the global
  token-mean (or sequence-mean) and the gradients are summed, never averaged, across ranks.
- What FSDP2 shards: the decoder layers (the bulk of the weights). Embeddings, the final norm and the
  output layer stay whole on every rank: `learn.logprobs` calls the decoder body and the output layer
  on their own (to chunk the log-softmax), outside any FSDP root, and a tied output layer is the
  embedding itself.
- LoRA: the adapter's weights are left out of FSDP2 (`ignored_params`) and replicated: their gradients
  are all-reduced (summed) after each step's backward passes, so every rank holds the same adapter and
  the same AdamW state. Rank 0 pushes and checkpoints the adapter without any collective; a resumed
  rank reads the same checkpoint.
- Full fine-tuning: the decoder layers are sharded and trained sharded (the gradient norm sums each
  rank's shards: `clip_grad_norm`); the weights outside them are replicated like an adapter. Every weight
  push and every checkpoint gathers the whole state on rank 0 (`full_state_dict`, `full_optimizer_state`:
  collectives every rank joins at the same points, `trainer.follow`), and rank 0 writes it in the format
  one process writes; a resumed rank takes its own shard of each saved tensor (`runs.checkpoint`), so a
  checkpoint reads back under any number of ranks. A KL reference's frozen copy is sharded too.
- Every rank runs the same number of forward passes per optimizer step (FSDP2 all-gathers layers in
  each one): a rank with fewer rows runs masked copies, which add nothing to the loss
  (`batching.rank_micro_batches`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig, PretrainedConfig

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """This process's place among the ranks torchrun started (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1  # ranks in all
    local_rank: int = 0  # rank on this machine: the CUDA device it trains on

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed(device_spec: str = "auto") -> Dist:
    """The process group torchrun asks for (RANK, WORLD_SIZE, LOCAL_RANK in the environment), or a
    single process. gloo on the CPU, NCCL when this rank trains on CUDA (device cuda:LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_spec != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank, world, local)


def close_distributed(dist: Dist) -> None:
    """Shut the process group down at the normal end of a run, on every rank, while the interpreter is still
    whole. Left to interpreter exit, gloo's worker threads can abort the process (SIGABRT, "terminate called
    without an active exception": pytorch/pytorch#190489; seen here once, a rank of a resumed 2-rank run, after
    its last step). Not after a failure: another rank may still be inside a collective."""
    if dist.active and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def rank_device(dist: Dist, device_spec: str) -> str:
    """A rank's own device: with several ranks on a CUDA machine, cuda:LOCAL_RANK."""
    if dist.active and device_spec in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{dist.local_rank}"
    return device_spec


def shard_model(model: nn.Module, dist: Dist, keep_whole: set[nn.Parameter]) -> list[nn.Parameter]:
    """FSDP2 over every decoder layer, `keep_whole` (the adapter's weights) left out. Returns the trainable
    weights that stay whole on every rank, whose gradients the ranks sum themselves: the adapter, or under
    full fine-tuning what lives outside the layers (embeddings, final norm, output layer; these are called
    directly by `learn.logprobs`, outside any FSDP root, and a tied output layer is the embedding)."""
    if not dist.active:
        return []
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard over ranks")
    for layer in layers:
        sharded = fully_shard(layer, ignored_params=keep_whole or None)  # the layer itself, now an FSDPModule
        sharded.set_gradient_divide_factor(1.0)  # the losses carry the global normaliser: sum, not mean
        sharded.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM (float32 asks it)
    inside = {id(p) for layer in layers for p in layer.parameters()} - {id(p) for p in keep_whole}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in inside]


def reshard(model: nn.Module) -> None:
    """Free the gathered layers after a no-grad pass. Each sharded layer is its own FSDP2 root (`shard_model`),
    and a root keeps its gathered weights after a forward pass, expecting the backward pass that reshards
    them; a pass without one (the KL reference's, pi_old's) would leave every layer whole."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def broadcast(obj: T, dist: Dist) -> T:
    """Rank 0's `obj` on every rank (pickled; a batch is a few MB)."""
    if not dist.active:
        return obj
    box: list[Any] = [obj if dist.main else None]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: T, dist: Dist) -> list[T]:
    """Every rank's `obj`, in rank order, on every rank (pickled); one process: [obj]."""
    if not dist.active:
        return [obj]
    parts: list[Any] = [None] * dist.world
    torch_dist.all_gather_object(parts, obj)
    return parts


def max_over_ranks(value: int, dist: Dist) -> int:
    """The largest of every rank's `value`, on every rank."""
    if not dist.active:
        return value
    t = torch.tensor([value], dtype=torch.long)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: dict[str, float], dist: Dist) -> dict[str, float]:
    """Each value summed over ranks (in float64), on every rank; every rank passes the same keys. One
    process: `values` itself."""
    if not dist.active:
        return values
    keys = sorted(values)  # the same order on every rank, whatever order each built its dict in
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    torch_dist.all_reduce(t)
    summed = dict(zip(keys, t.tolist()))
    return {k: summed[k] for k in values}


def all_reduce_adapter_grads(params: list[nn.Parameter], dist: Dist) -> None:
    """Sum the replicated adapter's gradients over ranks, in one flat buffer."""
    if not dist.active or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch_dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).clone()
        offset += n


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` over a mix of sharded (DTensor: FSDP2's layers under full
    fine-tuning) and whole gradients: the squares of each rank's shards are summed over ranks, those of
    the whole weights (the same on every rank, already summed) are not. Every rank calls it; returns the
    global norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if grads else 0.0
    sharded = [g.to_local() for g in grads if isinstance(g, DTensor)]
    square = torch.stack([g.double().pow(2).sum() for g in sharded]).sum().cpu()
    torch_dist.all_reduce(square)
    square += sum(float(g.double().pow(2).sum()) for g in grads if not isinstance(g, DTensor))
    norm = float(square.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))  # as torch's: no scaling below the bound
    if coef < 1.0:
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm


def full_state_dict(model: nn.Module, dist: Dist, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's whole weights on rank 0 (on the CPU), gathered from their shards; {} on other ranks.
    Tied weights once, under the name `named_parameters` gives them (as `save_pretrained` writes them).
    Every rank must call it at the same point. A weight no rank shards, on the CPU already, is the live
    tensor, not a copy: write the dict out before the next optimizer step."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state: dict[str, Any] = get_model_state_dict(model, options=options)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {n: t for n, t in state.items() if n not in aliases}


def full_optimizer_state(optimizer: torch.optim.Optimizer, dist: Dist) -> dict[str, Any]:
    """The optimizer's `state_dict()` with every sharded tensor gathered whole, on the CPU, on rank 0: the
    format one process writes, so a checkpoint reads back under any number of ranks; {} on other ranks.
    Every rank must call it at the same point (one all-gather per sharded tensor, in parameter order).
    Unsharded moments are the live tensors, as in `full_state_dict`."""
    state = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own: built anew below
    gathered = {}
    for pid in sorted(state["state"]):
        moments = {}
        for key, value in sorted(state["state"][pid].items()):
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            if dist.main:  # the other ranks drop each gathered tensor at once
                moments[key] = whole.cpu() if isinstance(whole, torch.Tensor) else whole
        gathered[pid] = moments
    return {**state, "state": gathered} if dist.main else {}


@dataclass(frozen=True)
class GatheredModel:
    """A sharded model's weights gathered whole on rank 0 (`full_state_dict`), with the model's config:
    `save_pretrained` writes the folder the model's own would (what `rollout.weight_sync.full.FullWeightSync`
    pushes to the servers)."""

    state: dict[str, torch.Tensor]
    config: PretrainedConfig
    generation_config: GenerationConfig | None = None

    def save_pretrained(self, folder: str | Path, safe_serialization: bool = True) -> None:
        folder = Path(folder)
        save_file({n: t.contiguous() for n, t in self.state.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        self.config.to_json_file(str(folder / "config.json"))
        if self.generation_config is not None:
            self.generation_config.to_json_file(str(folder / "generation_config.json"))
