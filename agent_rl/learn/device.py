"""Where and in what precision the trainer computes: chosen once, here.

Owns: `resolve_device` (`model.device`: auto = the first CUDA device when torch sees one, else the
CPU), `resolve_dtype` (`model.dtype`: auto = bfloat16 on CUDA, float32 on the CPU) and `model_device`.
A vLLM server started for the run serves in the same precision (`rollout.serving.vllm.server.server_dtype`).
Does not own: moving the model (`learn.policy.build_policy`) or batches (`learn.batching.Batch.to`);
the log-probs and the loss are computed in float32 from low-precision logits (`learn.logprobs`).
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}  # float64: exact comparisons in tests (e.g. one rank against two)


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N`; a CUDA device torch cannot see is a one-line ValueError."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"model.device: not a device: {spec!r} (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device: {spec} requested, but torch sees no CUDA device (use auto or cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"model.device: {spec} requested, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """`auto` (bfloat16 on CUDA, float32 on the CPU) or a dtype name."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[spec]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's parameters are (the device its inputs must be on)."""
    return next(model.parameters()).device
