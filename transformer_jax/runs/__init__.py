"""A run's workdir: its checkpoints, its lock, and a trained run loaded for decoding."""
