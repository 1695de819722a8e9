"""``rlctl serve``: rlctl engines behind serving-engine HTTP APIs.

What this is: ``rlctl serve rollout`` puts a rollout backend (the local torch
engine by default) behind the subset of SGLang's native HTTP API that rlctl's
sglang plugin uses, so the disaggregated rollout path runs and is tested on
any machine. Modules: sglang_api (schema), worker (batching + weight
updates on one engine thread), server (HTTP routes).

What this is not: a production server (use SGLang itself on GPUs).
"""
