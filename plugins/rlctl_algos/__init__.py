"""Built-in advantage estimators (grpo, dr_grpo, rloo, reinforce_pp, gspo, dapo, ppo), registered like a third party."""
