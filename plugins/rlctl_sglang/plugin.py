"""Registers the SGLang HTTP rollout backend as rollout backend ``sglang``."""

from __future__ import annotations

from rlctl import hookimpl


def _make(options, ctx):
    from rlctl_sglang.backend import SGLangRollout

    return SGLangRollout(ctx, options)


@hookimpl
def register_rollout_backends(register) -> None:
    from rlctl_sglang.options import SGLangOptions

    register("sglang", _make, options=SGLangOptions)
