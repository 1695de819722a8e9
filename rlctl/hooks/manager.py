"""Plugin discovery and the component registry built from it.

What this is: loads plugins from the ``rlctl`` entry-point group (the built-in
ones under plugins/ arrive the same way), collects what they register, and
builds components by name with validated options and a protocol check.

What this is not: a plugin. Nothing here knows a concrete backend.

Environment: ``RLCTL_LOAD_PLUGINS=a,b`` pins the third-party plugins loaded
(built-ins, shipped in the rlctl distribution, always load);
``RLCTL_TRACE_PLUGINS=1`` prints every hook call.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Mapping

import pluggy
from pydantic import BaseModel

from rlctl.config.load import validate_options
from rlctl.contracts.errors import PluginError
from rlctl.contracts.roles import ROLE_PROTOCOLS
from rlctl.hooks import hookspecs

ENTRY_POINT_GROUP = "rlctl"
BUILTIN_DISTRIBUTION = "rlctl"

# kind -> (hook name, protocol key, human label)
KINDS: dict[str, tuple[str, str, str]] = {
    "task_source": ("register_task_sources", "task_source", "task source"),
    "rollout_backend": ("register_rollout_backends", "rollout_backend", "rollout backend"),
    "learner_backend": ("register_learner_backends", "learner_backend", "learner backend"),
    "critic_backend": ("register_critic_backends", "critic_backend", "critic backend"),
    "reward_function": ("register_reward_functions", "reward_function", "reward function"),
    "metric_sink": ("register_metric_sinks", "metric_sink", "metric sink"),
    "advantage_estimator": ("register_advantage_estimators", "advantage_estimator", "advantage estimator"),
    "fault": ("register_faults", "fault", "fault"),
    "weight_transport": ("register_weight_transports", "weight_transport", "weight transport"),
    "environment": ("register_environments", "environment", "environment"),
    "tool": ("register_tools", "tool", "tool"),
}


@dataclass(frozen=True, slots=True)
class Component:
    kind: str
    name: str
    factory: Callable[..., Any]
    options: type[BaseModel] | None
    plugin: str


@dataclass(frozen=True, slots=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    builtin: bool
    hooks: tuple[str, ...]
    registers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class Plugins:
    """The loaded plugins and everything they registered."""

    def __init__(self, pm: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
        self.pm = pm
        self._infos = infos
        self._components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
        for kind, (hook_name, _, _) in KINDS.items():
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                plugin_name = pm.get_name(impl.plugin) or repr(impl.plugin)
                impl.function(register=self._registrar(kind, plugin_name))

    def _registrar(self, kind: str, plugin: str) -> Callable[..., None]:
        def register(name: str, factory: Callable[..., Any], options: type[BaseModel] | None = None) -> None:
            label = KINDS[kind][2]
            existing = self._components[kind].get(name)
            if existing is not None:
                raise PluginError(
                    f"{label} {name!r} is registered twice: by plugin {existing.plugin!r} and by {plugin!r}",
                    "uninstall one of them or pin plugins with RLCTL_LOAD_PLUGINS",
                )
            if not callable(factory):
                raise PluginError(f"plugin {plugin!r} registered {label} {name!r} with a non-callable factory")
            self._components[kind][name] = Component(kind, name, factory, options, plugin)

        return register

    def names(self, kind: str) -> list[str]:
        return sorted(self._components[kind])

    def get(self, kind: str, name: str) -> Component:
        found = self._components[kind].get(name)
        if found is None:
            label = KINDS[kind][2]
            known = self.names(kind)
            close = difflib.get_close_matches(name, known, n=1)
            near = f"; did you mean {close[0]!r}?" if close else ""
            raise PluginError(
                f"no {label} named {name!r} is installed{near} (installed: {', '.join(known) or 'none'})",
                "install the plugin that provides it, or run `rlctl plugins` to see what is available",
            )
        return found

    def build(self, kind: str, name: str, options: Mapping[str, Any], where: str, **kwargs: Any) -> Any:
        """Validate ``options`` with the component's model, call its factory, check the protocol."""
        component = self.get(kind, name)
        validated = validate_options(component.options, options, where)
        obj = component.factory(options=validated, **kwargs)
        protocol = ROLE_PROTOCOLS[KINDS[kind][1]]
        if not isinstance(obj, protocol):
            raise PluginError(
                f"{KINDS[kind][2]} {name!r} from plugin {component.plugin!r} does not implement "
                f"{protocol.__name__}",
                "fix the plugin: it must provide every method of the protocol in rlctl.contracts.roles",
            )
        return obj

    def infos(self) -> list[PluginInfo]:
        out = []
        for info in self._infos.values():
            regs = {
                KINDS[kind][2]: tuple(sorted(c.name for c in comps.values() if c.plugin == info.name))
                for kind, comps in self._components.items()
            }
            out.append(
                PluginInfo(
                    name=info.name,
                    distribution=info.distribution,
                    version=info.version,
                    builtin=info.builtin,
                    hooks=info.hooks,
                    registers={k: v for k, v in regs.items() if v},
                )
            )
        return sorted(out, key=lambda p: (not p.builtin, p.name))


def load_plugins(extra: Mapping[str, Any] | None = None) -> Plugins:
    """Discover entry-point plugins (plus ``extra`` name -> module/object, used by tests)."""
    pm = pluggy.PluginManager("rlctl")
    pm.add_hookspecs(hookspecs)
    pinned = _pinned()
    infos: dict[str, PluginInfo] = {}
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist else "?"
        builtin = dist == BUILTIN_DISTRIBUTION
        if pinned is not None and not builtin and ep.name not in pinned:
            continue
        if pm.get_plugin(ep.name) is not None:
            raise PluginError(f"two installed packages both provide an rlctl plugin named {ep.name!r}", "uninstall one")
        try:
            plugin = ep.load()
        except Exception as err:  # a broken third-party package must not hide which one it is
            raise PluginError(f"plugin {ep.name!r} ({dist}) failed to import: {err}", "reinstall or uninstall it") from err
        _register(pm, plugin, ep.name, infos, dist, ep.dist.version if ep.dist else "?", builtin)
    for name, plugin in (extra or {}).items():
        _register(pm, plugin, name, infos, "<in-process>", "-", False)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        raise PluginError(f"plugin {pm.get_name(err.plugin)!r} implements a hook rlctl does not have: {err}",
                          "check the hook names in rlctl/hooks/hookspecs.py (e.g. register_reward_functions)") from err
    if os.environ.get("RLCTL_TRACE_PLUGINS") == "1":
        pm.trace.root.setwriter(lambda msg: sys.stderr.write(msg))
        pm.enable_tracing()
    return Plugins(pm, infos)


def _register(pm: pluggy.PluginManager, plugin: Any, name: str, infos: dict[str, PluginInfo],
              dist: str, version: str, builtin: bool) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as err:
        raise PluginError(f"plugin {name!r} ({dist}) does not match rlctl's hook specs: {err}",
                          "fix its hook names/arguments against rlctl/hooks/hookspecs.py") from err
    hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
    infos[name] = PluginInfo(name=name, distribution=dist, version=version, builtin=builtin, hooks=hooks)


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _pinned() -> set[str] | None:
    raw = os.environ.get("RLCTL_LOAD_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}
