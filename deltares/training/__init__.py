"""Training: experiment configs, optimizer, train/eval steps, mesh shardings, checkpoints, metrics, memory, W&B."""
