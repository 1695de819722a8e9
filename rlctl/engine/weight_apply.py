"""Applying a weight update to a served torch module: all of it, or none of it.

What this is: the rule every receiver shares (in-process from the learner,
a published version or plain model directory read from disk, a version
broadcast over torch.distributed). ``stage_update`` checks the whole
candidate against the served module before anything served changes: the same
tensor names (none missing, none extra), the same shapes, the same dtype (or
both floating point, then cast), tied tensors (one parameter under two names,
e.g. embeddings and LM head) equal under both names, and the fingerprint
of the update's tensors (as sent, before any cast to the served dtype) equal
to the one the update announces. It returns a fully
built state in fresh tensors. ``swap_in`` then points every parameter and
buffer at its staged tensor: nothing can fail half way, and the served
weights are either all old or all new.

Cost per update: one copy of the weights (the staging, which keeps the
sender's tensors from aliasing the served ones) plus the fingerprint; the
swap itself copies nothing.

What this is not: decoding or transport checks (shard sha256, manifests:
rlctl.engine.weight_codec and rlctl.engine.transports), which run before this.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import WeightUpdate
from rlctl.models.fingerprint import fingerprint

_HINT = "the served weights are unchanged; publish a full state dict of the served model's architecture"


def _slots(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """State-dict name -> (owning submodule, attribute) for every parameter and persistent buffer."""
    wanted = set(module.state_dict())
    out: dict[str, tuple[torch.nn.Module, str]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr in (*sub._parameters, *sub._buffers):
            name = f"{prefix}.{attr}" if prefix else attr
            if name in wanted and (sub._parameters.get(attr) is not None or sub._buffers.get(attr) is not None):
                out[name] = (sub, attr)
    return out


def _tied_groups(served: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names that share one tensor in the served module (e.g. tied embeddings), in groups of 2+."""
    by_storage: dict[tuple[int, int], list[str]] = {}
    for name, t in served.items():
        if t.numel():
            by_storage.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(name)
    return [sorted(names) for names in by_storage.values() if len(names) > 1]


def check_layout(served: Mapping[str, torch.Tensor], candidate: Mapping[str, Any], what: str) -> None:
    """Refuse ``candidate`` unless it has exactly the served names, shapes and compatible dtypes."""
    missing = sorted(set(served) - set(candidate))
    extra = sorted(set(candidate) - set(served))
    if missing:
        raise RoleError(f"{what} lacks {len(missing)} tensor(s) the served model has, e.g. {missing[0]}", _HINT)
    if extra:
        raise RoleError(f"{what} has {len(extra)} tensor(s) the served model does not, e.g. {extra[0]}", _HINT)
    for name in sorted(served):
        have, got = served[name], candidate[name]
        if not isinstance(got, torch.Tensor):
            raise RoleError(f"{what}: {name} is a {type(got).__name__}, not a tensor", _HINT)
        if tuple(got.shape) != tuple(have.shape):
            raise RoleError(f"{what}: tensor {name} has shape {tuple(got.shape)}, the served model has "
                            f"{tuple(have.shape)}", _HINT)
        if got.dtype != have.dtype and not (got.is_floating_point() and have.is_floating_point()):
            raise RoleError(f"{what}: tensor {name} has dtype {got.dtype}, the served model has {have.dtype}", _HINT)


def stage_update(module: torch.nn.Module, update: WeightUpdate) -> tuple[dict[str, torch.Tensor], str]:
    """The fully built, verified state to serve for ``update`` and its fingerprint; the module is untouched."""
    served = module.state_dict()
    what = f"weight update v{update.version}"
    check_layout(served, update.state_dict, what)
    staged = {name: update.state_dict[name].detach().to(device=served[name].device, dtype=served[name].dtype,
                                                        copy=True) for name in served}
    for group in _tied_groups(served):
        first = staged[group[0]]
        for other in group[1:]:
            if not torch.equal(staged[other], first):
                raise RoleError(f"{what}: {group[0]} and {other} are one tied tensor in the served model but "
                                "differ in the update", _HINT)
            staged[other] = first
    # the fingerprint covers the tensors as the sender announced them (a bf16 learner's update served by an fp32
    # engine is cast after the check); the served fingerprint is that of what is served
    sent = fingerprint({name: update.state_dict[name] for name in served})
    if sent != update.fingerprint:
        raise RoleError(f"{what} fingerprint mismatch ({sent} != {update.fingerprint})",
                        "the weights changed in transit; the served weights are unchanged; republish")
    cast = any(staged[name].dtype != update.state_dict[name].dtype for name in served)
    return staged, fingerprint(staged) if cast else sent


def swap_in(module: torch.nn.Module, staged: Mapping[str, torch.Tensor]) -> None:
    """Point every parameter and buffer of ``module`` at its staged tensor (no copy, nothing can fail half way)."""
    slots = _slots(module)
    if set(slots) != set(staged):  # stage_update guarantees this; checked before the first swap anyway
        raise RoleError("staged weights do not match the served module's tensors", _HINT)
    with torch.no_grad():
        for name, (owner, attr) in slots.items():
            if attr in owner._parameters:
                owner._parameters[attr].data = staged[name]
            else:
                owner._buffers[attr] = staged[name]


def apply_update(module: torch.nn.Module, update: WeightUpdate) -> str:
    """Stage, verify, then swap in ``update``; returns the fingerprint now served."""
    staged, got = stage_update(module, update)
    swap_in(module, staged)
    return got
