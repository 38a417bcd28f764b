"""What the entrypoints (train.py, generate.py) use around the model: metrics and wandb,
the command-line helpers, and the known third-party warnings they silence."""
