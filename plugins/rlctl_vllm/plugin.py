"""Registers the vLLM HTTP rollout backend as rollout backend ``vllm``."""

from __future__ import annotations

from rlctl import hookimpl


def _make(options, ctx):
    from rlctl_vllm.backend import VLLMRollout

    return VLLMRollout(ctx, options)


@hookimpl
def register_rollout_backends(register) -> None:
    from rlctl_vllm.options import VLLMOptions

    register("vllm", _make, options=VLLMOptions)
