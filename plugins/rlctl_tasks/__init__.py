"""Built-in task sources: the synthetic ``arith`` task and user ``jsonl`` / ``parquet`` files."""
