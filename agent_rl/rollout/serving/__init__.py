"""Serving: the seam between a run and the engine that serves its policy (vLLM today).

    base    the protocol a backend fills in (`ServingBackend`: a sampler over server URLs, the run's servers
            started or attached, and the calls to one server: health, pause / resume, weights reloaded from a
            folder, LoRA adapters), `Fleet`, `ServerProcess`, `ServerError`, `ServerCallError`
    choose  `serving_backend()`, the one factory: where a second backend would be added
    vllm    the vLLM backend, a package: its client, its server process, its routes. Nothing outside it names
            a vLLM route (tests/test_serving_seam.py checks)

Owns nothing itself, and imports nothing. docs/serving-backends.md says what a second backend (SGLang) would write.
Does not own: the order of a weight push's calls (`rollout.weight_sync`), supervising servers
(`rollout.supervisor`), the backend-neutral sampler protocols (`rollout.sampler`).
"""
