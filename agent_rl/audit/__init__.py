"""The reward audit (`agent-rl audit-reward`): known reward hacks played through environments, their verdicts.
Reads each environment's audit target from its spec (`core.registry.EnvSpec.audit`)."""
