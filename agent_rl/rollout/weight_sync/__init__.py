"""Weight sync: after each optimizer step, make every vLLM server sample from the new policy.

Every sync is a `WeightSync`: `push(model, version)` writes the version, gets it onto every server URL of
the sampler and points the sampler at it (so every later rollout carries the version it was sampled
with); `finish()` leaves the servers as a later user expects them. The modules:

    base     the protocol, `WeightSyncError`, the calls to every server (`Servers`, with the one
             pause -> reload -> reset-prefix-cache -> resume sequence: `reload_in_place`), version folders
    adapter  `AdapterSync` (LoRA): each version a new adapter name, loaded beside the previous ones
    full     `FullWeightSync` (full fine-tuning): the served weights replaced in place, servers paused
    merged   `MergedSync`: a LoRA policy served as plain weights (base + scale * B @ A), reloaded in place
    choose   `start_weight_sync`, the factory a run calls (`model.sync`: adapter, merged or auto, measured)

Does not own: starting servers (`rollout.server`), sampling (`rollout.sampler`), training checkpoints
(`runs.checkpoint`).
"""

from agent_rl.rollout.weight_sync.adapter import AdapterSync
from agent_rl.rollout.weight_sync.base import WeightSync, WeightSyncError
from agent_rl.rollout.weight_sync.choose import start_weight_sync
from agent_rl.rollout.weight_sync.full import FullWeightSync
from agent_rl.rollout.weight_sync.merged import MergedSync

__all__ = ["AdapterSync", "FullWeightSync", "MergedSync", "WeightSync", "WeightSyncError", "start_weight_sync"]
