"""Resolve a run config: YAML file -> dotted overrides -> validation -> hash.

What this is: the single place a config is read. Errors name the file, the full
dotted path of the bad key, and (for unknown keys) the closest valid key.

What this is not: the schema (rlctl.config.models) or plugin options checking
(rlctl.hooks.manager validates those when a name is resolved).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml
from pydantic import BaseModel, ValidationError

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import ConfigError


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read ``path`` (or start from defaults when None), apply ``key=value`` overrides, validate."""
    raw: dict[str, Any] = {} if path is None else read_yaml(Path(path))
    for item in overrides:
        apply_override(raw, item)
    return validate(raw, source=str(path) if path else "<defaults>")


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", "pass an existing YAML file, e.g. configs/quickstart.yaml")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path} at {where}: {problem}", "fix the YAML syntax there") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text", "save the config as UTF-8") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at top level, got {type(data).__name__}", "start with keys like 'train:'")
    return data


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} is not of the form key.path=value", "e.g. train.steps=20")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {item!r}: value is not valid YAML", "quote strings with special characters") from err
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override {item!r}: {where} is a value, not a section", f"set {where}=... directly")
        node = child
    node[parts[-1]] = value


def validate(raw: Mapping[str, Any], source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, raw, source), "see configs/quickstart.yaml for every key") from None


def config_json(config: BaseModel) -> str:
    """Canonical JSON of a resolved config (sorted keys): what is hashed and stored."""
    return json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def config_hash(config: BaseModel) -> str:
    return hashlib.sha256(config_json(config).encode()).hexdigest()[:16]


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any],
                   allowed: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    """``(dotted path, old value, new value)`` for every leaf that differs, outside ``allowed`` paths."""
    allowed = tuple(allowed)
    out: list[tuple[str, Any, Any]] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if any(path == p or path.startswith(p + ".") for p in allowed):
            return
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b), key=str):
                walk(a.get(key, _MISSING), b.get(key, _MISSING), f"{path}.{key}" if path else str(key))
        elif a != b:
            out.append((path, None if a is _MISSING else a, None if b is _MISSING else b))

    walk(old, new, "")
    return out


_MISSING = object()


def validate_options(model: type[BaseModel] | None, options: Mapping[str, Any], where: str) -> Any:
    """Validate a plugin's ``options`` block with the plugin's model; ``where`` is the dotted path."""
    if model is None:
        if options:
            raise ConfigError(f"{where} takes no options (got {', '.join(sorted(options))})", f"remove {where}")
        return None
    try:
        return model.model_validate(dict(options))
    except ValidationError as err:
        raise ConfigError(_describe(err, options, where, model=model, prefix=where), "fix that option") from None


def _describe(err: ValidationError, raw: Any, source: str, model: type[BaseModel] = RunConfig, prefix: str = "") -> str:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    path = ".".join(([prefix] if prefix else []) + loc) or prefix or "<root>"
    if first["type"] == "extra_forbidden":
        close = _closest(model, first["loc"], section=isinstance(first.get("input"), dict))
        near = f"; did you mean {'.'.join(([prefix] if prefix else []) + loc[:-1] + [close])}?" if close else ""
        return f"{source}: unknown config key {path}{near}"
    if first["type"] == "missing":
        return f"{source}: required key {path} is missing"
    got = first.get("input")
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error" and isinstance(got, dict):  # a cross-field rule: its message names the keys
        return f"{source}: {msg}"
    return f"{source}: {path}: {msg} (got {got!r})"


def _closest(model: type[BaseModel], loc: tuple[Any, ...], section: bool = False) -> str | None:
    """The valid key at ``loc`` nearest in spelling to the bad one (a section when the bad key holds one)."""
    node: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = node.model_fields.get(part) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return None
        node = _model_of(field.annotation)
        if node is None:
            return None
    if not (isinstance(node, type) and issubclass(node, BaseModel)):
        return None
    names = [n for n, f in node.model_fields.items() if not section or _holds_mapping(f.annotation)]
    hits = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.5)
    return hits[0] if hits else None


def _holds_mapping(annotation: Any) -> bool:
    import typing

    return _model_of(annotation) is not None or typing.get_origin(annotation) in (dict, typing.Mapping) \
        or annotation is dict


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):  # list[Model], Model | None
        found = _model_of(arg)
        if found is not None:
            return found
    return None
