"""A weight transport by name, from whichever plugin registered it (``register_weight_transports``).

What this is: ``weight_transport``, what a rollout backend that publishes
weights to engines in other processes calls to get its transport, so the
built-in ``disk`` transport and a third party's (an object store, a
shared-memory ring) are chosen the same way: by name in the backend's options.

What this is not: a transport (rlctl.engine.transports) or the publish
protocol around it (rlctl.engine.weight_sync).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence


def weight_transport(name: str, options: Mapping[str, Any], directory: str | Path,
                     extra_files: Sequence[str | Path] = (), where: str = "rollout.options.transport_options") -> Any:
    """The WeightTransport registered as ``name``, its ``options`` validated by its plugin (errors name ``where``).

    ``directory``: where the publisher keeps what it sends; ``extra_files``:
    model files every version carries (config.json, ...).
    """
    from rlctl.hooks.manager import load_plugins

    return load_plugins().build("weight_transport", name, options, where, directory=str(directory),
                                extra_files=tuple(str(p) for p in extra_files))
