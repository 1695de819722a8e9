"""rlctl_sinks plugin package."""
