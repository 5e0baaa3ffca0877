"""Which serving backend a run uses: the one factory.

Owns: `serving_backend()`, the one place a backend is chosen. vLLM is the only one: a second (SGLang,
docs/serving-backends.md) is added here, with the config field that picks it, and every caller already asks here.
Does not own: the protocol (`serving.base`), the backends (`serving.vllm`).
"""

from __future__ import annotations

from agent_rl.rollout.serving.base import ServingBackend
from agent_rl.rollout.serving.vllm.backend import VLLMBackend


def serving_backend() -> ServingBackend:
    """The backend a run's servers, samplers, weight syncs and supervisor go through: vLLM's."""
    return VLLMBackend()
