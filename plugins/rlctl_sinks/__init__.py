"""Built-in metric sinks: ``jsonl`` (metrics.jsonl in the run dir) and, each with its extra, ``tensorboard``, ``mlflow``, ``wandb`` (offline)."""
