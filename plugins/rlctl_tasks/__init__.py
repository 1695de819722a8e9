"""rlctl_tasks plugin package."""
