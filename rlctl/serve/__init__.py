"""``rlctl serve``: rlctl engines behind HTTP APIs.

What this is: ``rlctl serve rollout`` puts a rollout backend (the local torch
engine by default) behind the subset of SGLang's native HTTP API that rlctl's
sglang plugin uses, so the disaggregated rollout path runs and is tested on
any machine; ``rlctl serve reward`` serves a sequence-classification reward
model (scalar head) for the ``reward_model`` reward. Modules: http_common
(the hardening both servers share: trust, body checks, bounded connections,
shutdown), client (one bounded JSON call, for their clients), sglang_api
(schema), worker (batching + weight updates on one engine thread), server
(rollout routes), reward (reward-model routes and batching).

What this is not: a production server (use SGLang itself on GPUs).
"""
