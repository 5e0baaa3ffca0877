"""What a run leaves behind: checkpoints, the metrics log, plots, readable trajectories."""
