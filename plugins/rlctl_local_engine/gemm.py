"""The decoders' matrix products: oneDNN's prepacked fp32 inner product for large weights, torch otherwise.

What this is: ``Linear``, one projection of a decoder (a weight refolded once per decoder, an optional bias),
called on ``[..., in]`` activations. A weight of at least ``PACK_MIN`` elements is reordered once into
oneDNN's blocked layout and multiplied by ``torch.ops.mkldnn._linear_pointwise`` (what torch's own
compiler uses for frozen CPU linears); a smaller one keeps the product it had before this module:
``F.linear`` on the ``[out, in]`` weight, or ``x @ W^T`` on a pre-transposed copy (the slot decoder's
batch-invariance choice, slot_decoder.py).

Why: a decode step multiplies a few rows by every weight, and MKL's sgemm behind ``torch.matmul`` ran
those products at 6-8 GB/s of weights on the AMD EPYC host (one thread). The packed product ran them
1.3-1.9x faster from 512x512 up, but 0.25-0.7x below 256x768 (a fixed ~12 us per call); the quickstart
model's weights are all below the threshold, so its numerics are unchanged. The choice is by shape only,
never timed, so a run's numbers do not depend on the machine's load. Reproduce:
``python bench/engines.py --shapes 25m`` (rollout tokens/s) or ``bench/serve_long_tail.py``.

What this is not: a quantized or bf16 path (the product stays fp32 with fp32 accumulation; sums differ from
MKL's in the last bits, like any other kernel), nor used by the learner (autograd keeps torch's linear).
"""

from __future__ import annotations

import functools

import torch

PACK_MIN = 3 << 16  # weight elements (in x out) from which the packed product is used: 256 x 768
_BATCH_HINT = 64  # rows the packed layout is chosen for (fixed: the layout must not depend on the call)


@functools.cache
def packing_available() -> bool:
    """This torch has oneDNN's packed linear and it agrees with torch.matmul on a probe."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 16, generator=gen), torch.randn(3, 16, generator=gen)
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, _BATCH_HINT), None,
                                                 "none", [], "")
        return bool(torch.allclose(got, x @ w.t(), rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class Linear:
    """``x @ weight.T + bias`` for one decoder projection; ``weight`` is ``[out, in]``, reordered (packed) or
    copied transposed, else used as given. Only fp32 CPU weights are packed (a GPU's products stay torch's).

    ``transposed``: below the packing threshold, multiply by a pre-transposed ``[in, out]`` copy with
    ``torch.matmul`` (the slot decoder) instead of ``F.linear`` on the weight (the batch decoder).
    """

    __slots__ = ("weight", "bias", "packed", "transposed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, transposed: bool = False) -> None:
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach().clone()
        self.transposed = transposed
        self.packed = (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= PACK_MIN
                       and packing_available())
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT)
        elif transposed:
            self.weight = weight.t().contiguous()
        else:  # as given: the batch decoder refolds per call and never keeps it past the call
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            flat = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.bias,
                                                      "none", [], "")
            return flat.view(*x.shape[:-1], flat.shape[-1])
        if not self.transposed:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = torch.matmul(x, self.weight)
        return out if self.bias is None else out + self.bias
