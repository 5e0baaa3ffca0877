"""Weight sync: after each optimizer step, make every vLLM server sample from the new policy.

Every sync is a `WeightSync`: `push(model, version)` writes the version, gets it onto every server URL
of the sampler and points the sampler at it (so every later rollout carries the version it was sampled
with); `finish()` leaves the servers as a later user expects them. The modules:

    base     the protocol, `WeightSyncError`, the calls to every server (`Servers`, through the serving backend,
             with the one pause -> reload -> resume sequence: `reload_in_place`), version folders
    adapter  `AdapterSync` (LoRA): each version a new adapter name, loaded beside the previous ones
    full     `FullWeightSync` (full fine-tuning): the served weights replaced in place, servers paused
    merged   `MergedSync`: a LoRA policy served as plain weights (base + scale * B @ A), reloaded in place
    choose   `start_weight_sync`, the factory a run calls (`model.sync`: adapter, merged or auto, measured)

Owns nothing itself, and imports nothing: each name is imported from its module, so that loading one
sync does not load them all (`merged` needs torch; a process that only evaluates adapters does not).
Does not own: starting servers and the routes each call takes (`rollout.serving`), sampling (`rollout.sampler`),
training checkpoints (`runs.checkpoint`).
"""
