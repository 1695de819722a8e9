"""rlctl_vllm plugin package: the rollout backend that drives vLLM servers (attached or launched) over HTTP."""
