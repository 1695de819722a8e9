"""rlctl_torch_learner plugin package."""
