"""Built-in metric sinks: ``jsonl`` (metrics.jsonl in the run dir)."""
