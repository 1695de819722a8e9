"""rlctl_sglang plugin package: the rollout backend that drives SGLang servers over HTTP."""
