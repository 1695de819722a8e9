"""State trees <-> JSON plus named tensors, so checkpoints never pickle.

What this is: ``encode`` walks a tree of dicts, lists, tuples, scalars, numpy
arrays and torch tensors (an optimizer's ``state_dict()``, RNG states, a
backend's ``state()``) and returns JSON data in which every tensor is replaced
by ``{"__tensor__": key}``; the tensors come back in a dict for safetensors.
``decode`` is the inverse. Tuples, dicts with non-string keys and numpy arrays
are tagged so they come back as the same types (``random.setstate`` needs
tuples; an optimizer's state is keyed by int). ``clone`` makes a private copy
of a tree (every tensor cloned), which is what a snapshot needs.

What this is not: a general serialiser. An object of any other type is a
TypeError naming its path: loading a checkpoint must never run code (no pickle).
"""

from __future__ import annotations

from typing import Any, Mapping

_TAGS = ("__tensor__", "__tuple__", "__items__", "__ndarray__")


def encode(tree: Any, prefix: str, tensors: dict[str, Any]) -> Any:
    """JSON-able form of ``tree``; each tensor goes into ``tensors`` under ``prefix/path``."""
    import torch

    if isinstance(tree, torch.Tensor):
        key = prefix
        if key in tensors:
            raise ValueError(f"two tensors would be saved under {key!r}")
        tensors[key] = tree.detach().cpu().contiguous()
        return {"__tensor__": key}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, tuple):
        return {"__tuple__": [encode(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [encode(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
    if isinstance(tree, Mapping):
        if all(isinstance(k, str) and k not in _TAGS for k in tree):
            return {k: encode(v, f"{prefix}/{k}", tensors) for k, v in tree.items()}
        return {"__items__": [[encode(k, f"{prefix}/key{i}", tensors), encode(v, f"{prefix}/{k}", tensors)]
                              for i, (k, v) in enumerate(tree.items())]}
    if type(tree).__module__ == "numpy" and hasattr(tree, "tolist"):
        if getattr(tree, "ndim", 0) == 0:
            return tree.item()
        return {"__ndarray__": tree.tolist(), "dtype": str(tree.dtype)}
    raise TypeError(f"cannot save {type(tree).__name__} at {prefix!r} in a checkpoint: "
                    "only dicts, lists, tuples, scalars, numpy arrays and tensors are allowed")


def decode(data: Any, tensors: Mapping[str, Any]) -> Any:
    """The tree ``encode`` was given, with tensors taken from ``tensors``."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        key = data["__tensor__"]
        if key not in tensors:
            raise KeyError(f"tensor {key!r} is named in the state but missing from the tensor file")
        return tensors[key]
    if "__tuple__" in data:
        return tuple(decode(v, tensors) for v in data["__tuple__"])
    if "__items__" in data:
        return {decode(k, tensors): decode(v, tensors) for k, v in data["__items__"]}
    if "__ndarray__" in data:
        import numpy as np

        return np.asarray(data["__ndarray__"], dtype=data["dtype"])
    return {k: decode(v, tensors) for k, v in data.items()}


def clone(tree: Any) -> Any:
    """A private copy of ``tree``: containers rebuilt, tensors and arrays copied."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, tuple):
        return tuple(clone(v) for v in tree)
    if isinstance(tree, list):
        return [clone(v) for v in tree]
    if isinstance(tree, Mapping):
        return {k: clone(v) for k, v in tree.items()}
    if hasattr(tree, "copy") and type(tree).__module__ == "numpy":
        return tree.copy()
    return tree
