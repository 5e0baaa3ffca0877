"""The vLLM serving backend: the one package that speaks vLLM's HTTP routes and starts its server.

    sampler  `VLLMSampler` (the `/v1/completions` client) and the JSON it writes and reads
    server   `VLLMServer` (the server process and its command line), attaching by URL, `serve` (the run's servers)
    backend  `VLLMBackend`, the `serving.base.ServingBackend` the factory (`serving.choose`) returns: the two above,
             and each control route (health, pause / resume, weights reloaded in place, LoRA adapters, counters)

Owns nothing itself, and imports nothing.
Does not own: the protocol (`serving.base`), which backend a run uses (`serving.choose`), the push protocol
(`rollout.weight_sync`).
"""
