"""``rlctl inject``: add a fault to a new run, a stopped run (resumed with it), or a running run.

What this is: ``fault_override`` (the ``faults.inject=[...]`` override that
appends one fault to a config) and ``inject_running`` (hands a fault to a run
that is training right now: the spec is written atomically into
``<run_dir>/inject/``, and the run's guard arms it at its next step end and
records a ``fault_armed`` event).

What this is not: the fault kinds (plugins) or recovery (rlctl.incidents.recovery).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlctl.config.models import FaultSpec
from rlctl.contracts.errors import CheckpointError, ConfigError


def make_spec(kind: str, *, at_step: int | None, count: int | None, rate: float | None, target: str | None,
              options: Sequence[str], plugins: Any) -> FaultSpec:
    """A validated FaultSpec; the kind must be a registered fault and its options valid for it."""
    import yaml
    from pydantic import ValidationError

    from rlctl.config.load import validate_options

    component = plugins.get("fault", kind)
    opts: dict[str, Any] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--option {item!r} is not key=value", "e.g. --option delay_s=0.5")
        opts[key] = yaml.safe_load(value)
    validate_options(component.options, opts, f"fault {kind} options")
    raw: dict[str, Any] = {"kind": kind, "options": opts}
    raw.update({k: v for k, v in (("at_step", at_step), ("count", count), ("rate", rate), ("target", target))
                if v is not None})
    try:
        return FaultSpec.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"fault {kind}: {'.'.join(map(str, first['loc']))}: {first['msg']}",
                          "see `rlctl inject --help`") from None


def fault_override(spec: FaultSpec, existing: Sequence[Mapping[str, Any]] = ()) -> str:
    """``faults.inject=[...]``: the existing faults plus ``spec``, as a YAML flow override."""
    items = [dict(x) for x in existing] + [spec.model_dump(mode="json", exclude_unset=True)]
    return "faults.inject=" + json.dumps(items)


def is_running(run_dir: Path) -> bool:
    """True when another process holds the run directory's lock (the run is training now)."""
    from rlctl.engine.rundir import RunDir

    try:
        RunDir(run_dir).lock().release()
    except CheckpointError:
        return True
    return False


def inject_running(run_dir: Path, spec: FaultSpec) -> Path:
    """Hand ``spec`` to the run training in ``run_dir``; it is armed at that run's next step end."""
    inbox = run_dir / "inject"
    inbox.mkdir(parents=True, exist_ok=True)
    target = inbox / f"{time.time_ns()}-{spec.kind}.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec.model_dump(mode="json")), encoding="utf-8")
    os.replace(tmp, target)
    return target
