"""Learning from trajectories: advantages, batching, the loss, log-probs, the optimizer step, the policy."""
