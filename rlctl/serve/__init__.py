"""``rlctl serve``: rlctl engines behind HTTP APIs.

What this is: ``rlctl serve rollout`` puts a rollout backend (the local torch
engine by default) behind the subset of SGLang's native HTTP API that rlctl's
sglang plugin uses, so the disaggregated rollout path runs and is tested on
any machine; ``rlctl serve reward`` serves a sequence-classification reward
model (scalar head) for the ``reward_model`` reward. Both run on uvicorn
(HTTP/1.1 by h11) and Starlette. Modules: http_common (trust rules, options,
strict JSON, job helpers), asgi (the app: admission, bodies, dispatch,
error shapes), listener (uvicorn with request deadlines, shutdown), metrics
(Prometheus), client (one bounded JSON call, for their clients), sglang_api
(schema), worker (batching + weight updates on one engine thread), server
(rollout routes), score_worker (reward-model batching), reward (reward-model
routes), train_metrics (the trainer's ``train.metrics_port`` endpoint).

What this is not: a production server (use SGLang itself on GPUs).
"""
