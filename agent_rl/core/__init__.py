"""The ground floor: RL nouns, the environment protocol, renderers, the environment registry, config.
Imports nothing of the project above it."""
