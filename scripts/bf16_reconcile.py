"""Measure rollout (fp32 local engine) vs bf16 learner log-prob reconciliation on the tiny test model.

Prints, for 3 sampling settings x 2 seeds, max and mean |log pi_bf16 - log mu| over response tokens.
The tolerance in tests/unit/test_bf16.py is set from this. Run from the repository root:

    RLCTL_HOME=$PWD/.rlctl OMP_NUM_THREADS=1 .venv/bin/python scripts/bf16_reconcile.py
"""

import os, sys, pathlib
sys.path.insert(0, os.getcwd())
import torch; torch.set_num_threads(1)
from tests.conftest import TINY_OVERRIDES
from rlctl.config.load import load_config
from rlctl.hooks.manager import load_plugins
from rlctl.placement import place
from tests.helpers import rollout_batch
plugins = load_plugins()
for samp in ([], ["rollout.temperature=0.7", "rollout.top_k=8", "rollout.top_p=0.9"], ["rollout.temperature=1.3", "rollout.top_p=0.8"]):
  for seed in (0, 1):
    cfg = load_config(None, TINY_OVERRIDES + ["train.learner_options.dtype=bfloat16", f"run.seed={seed}"] + samp)
    s = place(cfg, plugins, cache_root=pathlib.Path(os.environ["RLCTL_HOME"]) / "cache").roles
    _, batch = rollout_batch(s)
    m = batch.action_mask > 0
    d = (s.learner.logprobs(batch) - batch.behavior_logprobs)[m].abs()
    print(samp, seed, float(d.max()), float(d.mean()), s.learner.logprobs(batch).dtype)
    s.rollout.close()
