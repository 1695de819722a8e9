"""What the tracker sinks share: the extra check, the run's provenance as params, the end status.

What this is: small helpers for the TensorBoard, MLflow and W&B sinks. What
this is not: a sink (those live next to this module).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any


def require_extra(module: str, extra: str, sink: str) -> None:
    """Raise ValueError (reported as a config error) when a tracker's package is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"the {sink!r} metric sink needs the {module} package, which is not installed; "
                         f"install it with: pip install 'rlctl[{extra}]' (or remove {sink!r} from train.metric_sinks)")


def run_params(run_dir: str | Path, run_id: str) -> dict[str, Any]:
    """The provenance a tracker records once per run, from the run directory's run.json and config.json."""
    root = Path(run_dir)
    params: dict[str, Any] = {"rlctl_run_id": run_id}
    info = _read_json(root / "run.json")
    name = _read_json(root / "config.json").get("run", {}).get("name")
    if name:
        params["run_name"] = name
    for key in ("config_hash", "code_version", "dataset_version", "tokenizer_hash", "seed"):
        if info.get(key) is not None:
            params[key] = info[key]
    return params


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def ending() -> str:
    """How the run is ending, judged from the exception in flight when ``close()`` runs.

    Sinks are closed in the run's ``finally``: no exception means the loop
    finished; KeyboardInterrupt (also how SIGTERM arrives) means interrupted.
    """
    err = sys.exc_info()[1]
    if err is None:
        return "finished"
    return "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
