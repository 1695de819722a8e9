"""rlctl_rewards plugin package."""
