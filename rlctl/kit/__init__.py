"""The plugin kit: the names a plugin may rely on besides ``rlctl`` and ``rlctl.contracts``.

What this is: the published surface for backend authors. A plugin (the
built-in ones under plugins/ included) imports from ``rlctl`` (hookimpl,
contract types, errors), ``rlctl.contracts`` (role Protocols, payloads)
and here -- the pure tensor maths included, as ``rlctl.kit.algo`` (every name
rlctl.algo lists in its ``__all__``) -- nothing else of rlctl and never
another plugin;
tests/unit/test_plugin_imports.py enforces it. Every name below keeps its
meaning across releases; a change to one is a breaking change with a
version note. The groups:

- fault sites and recovery reports: ``fault_site`` (call it where a failure
  really happens, so ``rlctl inject`` can arm it), ``report_recovery`` (a
  failure the role recovered from on its own becomes a registry event);
  ``arm`` and ``FaultContext`` for plugins that define fault kinds.
- checkpoints: ``state_codec`` (state trees to JSON plus named tensors, never
  pickle; ``clone`` for private copies) and ``shards`` (the sharded
  checkpoint layout: ``MODEL`` / ``OPTIM`` key prefixes, ``dcp_save``,
  ``dcp_read``, ``shapes``).
- models and devices: ``resolve_device``, ``placed``, ``load_policy``, ``eos_token_ids``,
  ``fingerprint`` (the weight hash both sides of a publish check),
  ``build_char_tokenizer``, ``tokenizer_hash``.
- weight publishing (rollout backends that serve weights elsewhere):
  ``apply_update`` (all-or-nothing swap into a served module),
  ``Broadcaster``, ``SyncOptions``, ``PublishReport``, ``DiskTransport``,
  ``InProcessTransport``, ``weight_transport`` (a registered transport by name),
  ``await_confirmation``.
- memory arithmetic (KV-cache budgets): ``ModelShape``, ``from_hf_config``,
  ``kv_cache_bytes``, ``kv_budget_rows``, ``fmt_bytes``, ``parse_bytes``.
- HTTP clients of servers: ``call_json``, ``CallError``, ``server_urls``.
- engine servers rlctl starts itself (vLLM, SGLang): ``EngineServers``
  (own process group, parent-death signal, CPU / GPU pinning, health wait,
  logs, stop at exit and on SIGTERM / SIGINT), ``EngineLaunch`` (the
  ``launch`` block the engine plugins share), ``free_ports``, ``parse_cpus``.
- run files: ``StepLines`` (a JSON-lines file with one line per step that a
  re-run step replaces: what a sink writing into the run directory uses).
- learners: ``TorchLearner`` and ``TorchLearnerOptions`` (the one-process
  torch learner, the base a sharded learner's rank extends), and the rank
  plumbing of sharded learners: ``RankGroup`` (the LearnerBackend over N
  ranks), ``LocalRanks`` (ranks as local processes), ``ShardedCheckpoints``,
  ``sharded_state``, ``check_same_model``, ``local_shard``; packed
  micro-batches (``train.micro_batch_tokens``) for a learner or critic of
  its own: ``micro_batch_rows``, ``sequence_lengths``,
  ``use_segment_attention``, ``packed_forward``, ``unpack_shifted``.

Names are imported on first use (``from rlctl.kit import TorchLearner``
imports torch; ``from rlctl.kit import server_urls`` does not), so a plugin's
options module stays light at startup.

What this is not: core's own import path. Nothing under rlctl/ outside this
package imports the kit (a test checks it); the kit re-exports core's modules
where they live and holds only the learner base and rank plumbing itself.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each group of names by the module that defines it. The kit's own modules hold the learner base and the rank
# plumbing; the rest are core's modules, re-exported as they are (scripts/kit_table.py renders this for docs/).
_GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "fault sites and recovery reports": {
        "rlctl.engine.faults": ("fault_site", "report_recovery", "arm", "FaultContext"),
    },
    "checkpoints": {
        "rlctl.engine": ("state_codec", "shards"),  # modules: the no-pickle codec and the sharded layout
    },
    "models and devices": {
        "rlctl.models.device": ("resolve_device", "placed"),
        "rlctl.models.load": ("load_policy", "eos_token_ids"),
        "rlctl.models.fingerprint": ("fingerprint",),
        "rlctl.models.tokenizer": ("build_char_tokenizer", "tokenizer_hash"),
    },
    "weight publishing": {
        "rlctl.engine.weight_apply": ("apply_update",),
        "rlctl.engine.weight_sync": ("Broadcaster", "SyncOptions", "PublishReport", "await_confirmation"),
        "rlctl.engine.transports.disk": ("DiskTransport",),
        "rlctl.engine.transports.inprocess": ("InProcessTransport",),
        "rlctl.kit.transports": ("weight_transport",),
    },
    "memory arithmetic": {
        "rlctl.planning.shapes": ("ModelShape", "from_hf_config"),
        "rlctl.planning.memory": ("kv_cache_bytes", "kv_budget_rows", "fmt_bytes", "parse_bytes"),
    },
    "HTTP clients of servers": {
        "rlctl.serve.client": ("call_json", "CallError", "server_urls"),
    },
    "engine servers": {
        "rlctl.serve.engines": ("EngineServers", "EngineLaunch", "free_ports", "parse_cpus"),
    },
    "run files": {
        "rlctl.storage.step_lines": ("StepLines",),
    },
    "learners": {
        "rlctl.kit.torch_options": ("TorchLearnerOptions",),
        "rlctl.kit.torch_learner": ("TorchLearner",),
        "rlctl.kit.packing": ("micro_batch_rows", "sequence_lengths", "use_segment_attention", "packed_forward",
                              "unpack_shifted"),
        "rlctl.kit.ranks": ("RankGroup", "LocalRanks", "ShardedCheckpoints", "sharded_state", "check_same_model",
                            "local_shard"),
    },
}

_HOME_OF = {name: home for homes in _GROUPS.values() for home, names in homes.items() for name in names}

__all__ = list(_HOME_OF)


def __getattr__(name: str) -> Any:
    """Import ``name`` from its home on first use (``from home import name``, submodules included) and keep it."""
    home = _HOME_OF.get(name)
    if home is None:
        raise AttributeError(f"module 'rlctl.kit' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = getattr(module, name, None)
    if value is None:  # a submodule not imported yet (state_codec, shards)
        value = importlib.import_module(f"{home}.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
