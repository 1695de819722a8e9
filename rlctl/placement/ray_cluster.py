"""Driver-side Ray plumbing the placement and a sharded learner's rank group share.

What this is: joining or starting the cluster (``connect``), reserving a
placement group (``reserve``), and waiting for actors to start or come back
after a restart (``wait_started``, ``wait_alive``), each failing with one
RoleError that names the actor and the fix instead of hanging.

What this is not: the actors (rlctl.placement.ray_actors) or the placement
itself (rlctl.placement.ray_placement).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group

from rlctl.contracts.errors import RoleError

LOST = (RayActorError, ActorUnavailableError)
READY_TIMEOUT_S = 600.0  # a restarting actor imports torch and loads its model; shared CPUs are slow


def connect(cluster: Any) -> bool:
    """Join ``cluster.address``, or start a local cluster sized by ``cluster.num_cpus``, unless Ray is up already;
    whether this call started it (then the caller shuts it down)."""
    if ray.is_initialized():
        return False
    if cluster.address:
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep a local cluster on loopback
        ray.init(num_cpus=cluster.num_cpus, include_dashboard=False, log_to_driver=False)
    return True


def reserve(bundles: list[dict[str, float]], strategy: str, started: bool) -> Any:
    """A ready placement group of ``bundles``; RoleError (and Ray shut down if ``started``) when it cannot be placed."""
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(pg)
        if started:
            ray.shutdown()
        raise RoleError(f"the Ray cluster cannot place {len(bundles)} bundles {bundles} "
                        f"(it has {ray.cluster_resources()})",
                        "lower cluster.num_rollout_workers, train.learner_options.world_size or the per-actor "
                        "num_cpus/num_gpus, or add nodes") from None
    return pg


def wait_alive(actor: Any, what: str) -> None:
    """Block until a restarting actor answers; RoleError once Ray gives up on it.

    A ping sent while the actor restarts is queued and answered by the new
    process. ActorDiedError on a fresh ping means the actor is dead for good,
    except when the ping raced the death itself: three in a row are final.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    died = 0
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=5)
            return
        except (GetTimeoutError, ActorUnavailableError):
            time.sleep(0.2)
        except ActorDiedError:
            died += 1
            if died >= 3:
                raise RoleError(f"{what} died and Ray will not restart it",
                                "raise cluster.max_restarts, or look at the actor's log under the Ray session "
                                "directory") from None
            time.sleep(0.5)
    raise RoleError(f"{what} did not come back within {READY_TIMEOUT_S:.0f}s",
                    "check the cluster's free resources with `ray status`")


def wait_started(actors: Sequence[tuple[str, Any]]) -> None:
    """Wait until every actor's constructor has run (it loads a model), so start-up is the placement's phase and
    an actor that cannot start is one RoleError naming it, not a restart loop inside the first step."""
    refs = {actor.pid.remote(): name for name, actor in actors}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=READY_TIMEOUT_S)
    if pending:
        names = ", ".join(refs[r] for r in pending)
        raise RoleError(f"{names} did not start within {READY_TIMEOUT_S:.0f}s",
                        "check the cluster's free resources with `ray status` and the actors' logs under the Ray "
                        "session directory")
    for ref in ready:
        try:
            ray.get(ref)
        except LOST as err:  # its constructor raised: Ray's message ends with that error's own line
            lines = [line.strip() for line in (getattr(err, "error_msg", None) or str(err)).splitlines()]
            raise RoleError(f"{refs[ref]} failed to start: {next((x for x in reversed(lines) if x), '?')}",
                            "see the actor's log under the Ray session directory") from None
