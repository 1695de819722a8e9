"""Built-in advantage estimators (grpo, dr_grpo, rloo, reinforce_pp, gspo, dapo, ppo).

Registered through the `rlctl` entry-point group exactly as a third-party package would be.
"""
