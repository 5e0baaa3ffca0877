"""Playing episodes: the async runner, samplers, vLLM servers, weight sync."""
