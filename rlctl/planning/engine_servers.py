"""What a dry run says about a rollout backend's engine servers (vLLM, SGLang): they run in their own
processes, so their memory is theirs, and what they would refuse at launch is refused before anything starts."""

from __future__ import annotations

from rlctl.config.load import validate_options
from rlctl.config.models import RunConfig
from rlctl.contracts.errors import ConfigError
from rlctl.contracts.roles import EngineLaunchCheck
from rlctl.contracts.types import RolloutMemory
from rlctl.hooks.manager import Plugins

def engine_launch_check(config: RunConfig, plugins: Plugins, head_dim: int) -> str | None:
    """What the rollout plugin's engine servers would refuse at launch (e.g. a head_dim), raised now; else what
    was checked (None: the backend launches no servers)."""
    options = validate_options(plugins.get("rollout_backend", config.rollout.backend).options,
                               config.rollout.options, "rollout.options")
    if not isinstance(options, EngineLaunchCheck):
        return None
    problem = options.launch_problem(head_dim)
    if problem:
        raise ConfigError(f"rollout.backend {config.rollout.backend!r} would not start: {problem}",
                          "use a model whose head_dim the engine supports (for the built-in model: "
                          "model.hidden_size / model.num_heads), or another rollout.backend")
    return f"head_dim {head_dim} accepted by the {config.rollout.backend} servers"


def engine_server_notes(rollout: RolloutMemory) -> list[str]:
    """The ledger's note on engine servers: launched ones are counted on the device as their own term, attached
    ones on their own hosts."""
    if not rollout.out_of_process:
        return []
    notes: list[str] = []
    if rollout.servers:
        budget = f"KV budget per server from {rollout.server_budget_source}" if rollout.server_budget_source \
            else "KV budget per server from the workload"
        notes.append(f"engine servers: {rollout.servers} launched, each in its own process ({budget}); "
                     "counted on the device as 'engine servers', never in rlctl's own process (the smoke "
                     "step's measurement leaves them out)")
    else:
        notes.append("engine servers: attached (rollout.options.servers), so their weights and KV cache are on "
                     "their own hosts and not in this ledger")
    return notes
