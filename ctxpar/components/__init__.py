"""What the entrypoints (train.py, generate.py) use around the model, each component owning
its "when": evaluation (Evaluator), saving (Checkpointer), metrics and wandb (StepMetrics,
MetricsLogger), the command-line helpers, and the known third-party warnings they silence."""
