"""rlctl_envs plugin package: the ``tools`` environment and the ``calculator`` tool."""
