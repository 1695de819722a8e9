"""Measuring what the roles really hold: the smoke step's memory meter.

What this is: ``make_meter`` (the CUDA allocator's peaks when the learner is
on a GPU, else a dispatch-mode counter of live CPU tensor bytes), ``Phased``
(a role whose verbs run inside a named meter phase), the roles' resident
tensors by ledger term (``persistent_bytes``) and the process's peak RSS.

What this is not: the ledger it is compared with (rlctl.planning.memory) or
the dry run that compares them (rlctl.planning.dryrun).
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any, Iterator



def rss_peak_bytes() -> int:
    """Peak resident set size of this process (VmHWM), 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Phased:
    """Wraps a role so its verbs run inside a named meter phase; everything else passes through."""

    def __init__(self, role: Any, meter: "Meter", verbs: dict[str, str]) -> None:
        self._role, self._meter, self._verbs = role, meter, verbs

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._role, name)
        phase = self._verbs.get(name)
        if phase is None or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._meter.phase(phase):
                return value(*args, **kwargs)

        return call


def make_meter(roles: Any) -> "Meter":
    on_cuda = any(t.device.type == "cuda" for ts in roles.learner.resident_tensors().values() for t in ts)
    return CudaMeter(roles) if on_cuda else DispatchMeter(roles)


class Meter:
    kind = ""

    def __init__(self, roles: Any) -> None:
        self.roles = roles
        self.peaks: dict[str, int] = {}
        self.persistent: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._begin()
        try:
            yield
        finally:
            self.peaks[name] = max(self.peaks.get(name, 0), self._end())
            self.persistent = persistent_bytes(self.roles)

    def __enter__(self) -> "Meter":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> int:
        raise NotImplementedError


class CudaMeter(Meter):
    kind = "torch.cuda.max_memory_allocated"

    def _begin(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def _end(self) -> int:
        import torch

        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())


class DispatchMeter(Meter):
    """Live bytes of CPU tensor storages: role state adopted at start, then every allocation and free."""

    kind = "live tensor bytes (TorchDispatchMode)"

    def __init__(self, roles: Any) -> None:
        super().__init__(roles)
        self.live = self.peak = 0
        self._keys: set[int] = set()
        self._mode: Any = None

    def __enter__(self) -> "DispatchMeter":
        for tensor in role_tensors(self.roles):
            self._add(tensor)
        self._mode = live_mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def _begin(self) -> None:
        self.peak = self.live

    def _end(self) -> int:
        return self.peak

    def _add(self, tensor: Any) -> None:
        storage = _storage(tensor)
        if storage is None:  # a wrapper (FSDP2's DTensor): its local tensor is counted when created
            return
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._keys or tensor.device.type != "cpu":
            return
        self._keys.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        if key in self._keys:
            self._keys.discard(key)
            self.live -= size


def live_mode(meter: DispatchMeter) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveMode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.is_view:
                return out
            inputs = {st.data_ptr() for a in tree_flatten((args, kwargs))[0]
                      if isinstance(a, torch.Tensor) and (st := _storage(a)) is not None}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None and st.data_ptr() not in inputs:
                    meter._add(t)
            return out

    return LiveMode()


def _storage(tensor: Any) -> Any:
    """The tensor's storage, or None for a wrapper subclass without one (FSDP2's DTensor parameters)."""
    try:
        storage = tensor.untyped_storage()
        storage.data_ptr()
    except RuntimeError:
        return None
    return storage


def role_tensors(roles: Any) -> list[Any]:
    """Every tensor the roles report holding between calls (parameters, gradients, optimizer state...)."""
    return [t for role in _roles(roles) for ts in role.resident_tensors().values() for t in ts]


def _roles(roles: Any) -> list[Any]:
    """The roles holding tensors in this process: rollout, learner and (when the run has one) the critic."""
    return [roles.rollout, roles.learner] + ([roles.critic] if roles.critic is not None else [])


def persistent_bytes(roles: Any) -> dict[str, int]:
    """Measured sizes of the ledger's persistent terms (unique storages), as the roles name them."""

    def size(tensors: Any) -> int:
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(seen.values())

    out = {}
    for role in _roles(roles):
        for term, tensors in role.resident_tensors().items():
            out[term] = size(tensors)
    return out
