"""rlctl_local_engine plugin package."""
