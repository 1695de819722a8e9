"""What the supported transformers versions (pyproject's range, 5.17 to 5.24) spell differently.

What this is: the name of the KV cache as a model's forward argument and output field, for code that drives
a Hugging Face causal LM's cache itself (the learner's shared-prompt forward, bench/learner_overhead.py).
What this is not: a shim for any other API, or for versions outside that range.
"""

from __future__ import annotations

import dataclasses
import functools


@functools.cache
def kv_cache_name() -> str:
    """``cache`` where transformers has renamed it (5.24 keeps ``past_key_values`` as a deprecated alias, with a
    warning), ``past_key_values`` where it has not (5.17, the GPU image's version, and 5.18)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    names = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in names else "past_key_values"
