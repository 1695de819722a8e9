"""What the tracker sinks share: the extra check, the run's provenance as params, the end status.

What this is: small helpers for the TensorBoard, MLflow and W&B sinks. What
this is not: a sink (those live next to this module).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from rlctl.contracts.types import RunRecord


def require_extra(module: str, extra: str, sink: str) -> None:
    """Raise ValueError (reported as a config error) when a tracker's package is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"the {sink!r} metric sink needs the {module} package, which is not installed; "
                         f"install it with: pip install 'rlctl[{extra}]' (or remove {sink!r} from train.metric_sinks)")


def run_params(run: RunRecord | None, run_id: str) -> dict[str, Any]:
    """The provenance a tracker records once per run: the same fields the registry keeps."""
    params: dict[str, Any] = {"rlctl_run_id": run_id}
    if run is not None:
        params.update(run_name=run.name, config_hash=run.config_hash, code_version=run.code_version,
                      dataset_version=run.dataset_version or "", tokenizer_hash=run.tokenizer_hash or "",
                      seed=run.seed)
    return params


def ending() -> str:
    """How the run is ending, judged from the exception in flight when ``close()`` runs.

    Sinks are closed in the run's ``finally``: no exception means the loop
    finished; KeyboardInterrupt (also how SIGTERM arrives) means interrupted.
    """
    err = sys.exc_info()[1]
    if err is None:
        return "finished"
    return "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
