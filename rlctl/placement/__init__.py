"""Placement of the roles: decide where each role lives, build it there, hand the loops frozen Roles.

What this is: ``place``, which builds every role of a run where it lives --
in this process (``cluster.backend: local``, rlctl.placement.local) or as Ray
actors (``ray``, rlctl.placement.ray_placement) -- and returns a ``Placement``:
its ``roles`` (rlctl.engine.roles.Roles, frozen) and ``close``, which ends
every process, thread and actor it started. Nothing is built on the driver to
be copied elsewhere, and no field of the roles changes afterwards. A sharded
learner gets its rank launcher from here (local processes, or Ray actors
through rlctl.placement.ray_ranks). rlctl.placement.build turns config names
into role objects; rlctl.placement.ranks is the process-group plumbing local
and Ray ranks share. The ``ray_*`` modules are the only ones in rlctl that
import ray, and only a Ray placement imports them.

What this is not: the loops (rlctl.engine) or run bookkeeping (rlctl.lifecycle).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.config.models import RunConfig
    from rlctl.contracts.types import TaskData
    from rlctl.engine.roles import Roles
    from rlctl.hooks.manager import Plugins


class Placement(Protocol):
    """Built roles and their owner: ``close`` ends every role it started (idempotent)."""

    roles: "Roles"

    def close(self) -> None: ...


def place(config: "RunConfig", plugins: "Plugins", *, cache_root: Path,
          progress: Callable[[int, int, float], None] | None = None, task: "TaskData | None" = None,
          fleet: bool = False) -> Placement:
    """Build every role of ``config`` where its placement puts it; ``task`` skips loading the task again.

    ``fleet`` gives a local ``mode: sync`` run rollout workers too, so it goes
    through the overlapped driver (with nothing ahead: the same batches, the
    queue's ledger and audit), as every Ray run does.
    Fails before any training starts (and stops whatever it started) when a
    name, an option, the data, the model or the cluster is not usable.
    """
    if config.cluster.backend == "ray":
        import importlib.util

        from rlctl.contracts.errors import ConfigError

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("cluster.backend=ray needs Ray, which is not installed in this environment",
                              "pip install -e '.[ray]', or set cluster.backend=local")
        from rlctl.placement.ray_placement import RayPlacement

        return RayPlacement(config, plugins, cache_root, progress, task)
    from rlctl.placement.local import LocalPlacement

    return LocalPlacement(config, plugins, cache_root, progress, task, fleet=fleet)
