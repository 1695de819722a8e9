"""The plain-torch critic: a value model (the policy's backbone + a scalar head) with its own AdamW.

What this is: the CriticBackend for CPU and single-device runs. The backbone
is loaded from ``ctx.model_dir`` (the policy's directory when
``algo.critic.init`` is "policy", else the given directory); the head is a
zero-initialised linear layer, so V starts at 0. Token t's value is read from
the hidden state at t - 1 (the state before token t is generated), the same
alignment as the policy's log-probs. ``train_step`` runs ``critic.epochs``
passes of micro-batched, gradient-clipped regression with the clipped value
loss; ``state``/``load_state`` carry weights, optimizer and the shuffling
generator through checkpoints. With ``train.micro_batch_tokens`` set the
micro-batches are packed exactly as the policy learner's (the kit's
``micro_batch_rows`` over each epoch's shuffled rows, ``packed_forward`` of
the backbone, ``unpack_shifted`` of the head's outputs): no padding is
forwarded, and values, value loss, clipping and gradients are the padded
path's. Either way values exist, and are regressed, on policy tokens only
(``action_mask``): an episode's environment tokens get value 0 and no loss.

What this is not: the advantage maths (rlctl.algo) or the policy learner.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from rlctl import CheckpointError, CriticContext
from rlctl.kit.algo import explained_variance, value_loss
from rlctl.contracts.batch import TrainBatch
from rlctl.kit import (
    load_policy, micro_batch_rows, packed_forward, sequence_lengths, state_codec, unpack_shifted,
    use_segment_attention,
)


class ValueModel(torch.nn.Module):
    """Backbone of a causal LM (no LM head) + ``Linear(hidden, 1)``; ``packed``: micro-batches forwarded packed."""

    def __init__(self, lm: Any, packed: bool = False) -> None:
        super().__init__()
        self.backbone = lm.get_decoder()
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.packed = packed
        if packed:
            use_segment_attention(self.backbone)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        """[n, T] values of the states before each policy token (0 elsewhere), in the batch's padded layout."""
        if self.packed:
            out, _, index = packed_forward(self.backbone, batch)
            raw = self.head(out.last_hidden_state[0]).squeeze(-1).float()  # [S]: value after flat token j
            values = unpack_shifted(raw[:-1], index)  # [n, T]: value before token t
        else:
            ids, mask = batch.input_ids, batch.attention_mask  # [n, T]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            hidden = self.backbone(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
            raw = self.head(hidden).squeeze(-1).float()  # [n, T]: value of the state after token t
            values = torch.nn.functional.pad(raw[:, :-1], (1, 0))  # [n, T]: value before token t
        return values * (batch.action_mask > 0)


class TorchCritic:
    """CriticBackend over an in-process torch value model."""

    def __init__(self, ctx: CriticContext, options: Any = None) -> None:
        self.cfg, self.optim_cfg = ctx.critic, ctx.optim
        self.micro_batch_size = ctx.micro_batch_size
        self.micro_batch_tokens = ctx.micro_batch_tokens  # None: padded micro-batches; else packed
        lm, _ = load_policy(ctx.model_dir)
        with torch.random.fork_rng():
            torch.manual_seed(ctx.seed)
            self.model = ValueModel(lm, packed=self.micro_batch_tokens is not None).train()
        o = self.optim_cfg
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.generator = torch.Generator().manual_seed(ctx.seed + 1)

    def _micro(self, batch: TrainBatch, rows: torch.Tensor | None = None):
        """Row indices of each micro-batch, taken in ``rows`` order (default: batch order), as the learner's."""
        order = rows if rows is not None else torch.arange(batch.num_sequences)
        lengths = sequence_lengths(batch)
        for span in micro_batch_rows([lengths[i] for i in order.tolist()], self.micro_batch_size,
                                     self.micro_batch_tokens):
            yield order[span.start:span.stop]

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        return torch.cat([self.model(batch.select(idx)) for idx in self._micro(batch)])

    def train_step(self, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor) -> Mapping[str, float]:
        mask = batch.action_mask
        stats: dict[str, list[float]] = {}
        out = {"explained_variance": explained_variance(old_values, returns, mask)}  # of the values used for GAE
        total = float(mask.sum())
        for _ in range(self.cfg.epochs):
            order = torch.randperm(batch.num_sequences, generator=self.generator)
            self.optimizer.zero_grad(set_to_none=True)
            for idx in self._micro(batch, order):
                micro = batch.select(idx)
                v = self.model(micro)
                loss, info = value_loss(v, old_values[idx], returns[idx], micro.action_mask, self.cfg.value_clip)
                (loss * float(micro.action_mask.sum()) / max(total, 1.0)).backward()
                for key, value in info.items():
                    stats.setdefault(key, []).append(value)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip))
            stats.setdefault("critic_grad_norm", []).append(grad_norm)
            if math.isfinite(grad_norm):  # never apply a poisoned update
                self.optimizer.step()
        out.update({k: sum(v) / len(v) for k, v in stats.items()})
        out["value_mean"] = float(old_values[mask > 0].mean()) if bool((mask > 0).any()) else 0.0
        return out

    def resident_tensors(self) -> Mapping[str, list[torch.Tensor]]:
        """Tensors held between steps, by memory-ledger term (the dry run measures them)."""
        params = list(self.model.parameters())
        return {"critic parameters": params,
                "critic gradients": [p.grad for p in params if p.grad is not None],
                "critic optimizer states": [t for st in self.optimizer.state.values() for t in st.values()
                                            if isinstance(t, torch.Tensor) and t.dim() > 0]}

    def state(self) -> Mapping[str, Any]:
        return {"weights": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": state_codec.clone(self.optimizer.state_dict()),
                "generator": self.generator.get_state()}

    def load_state(self, state: Mapping[str, Any]) -> None:
        current = self.model.state_dict()
        saved = state["weights"]
        if set(saved) != set(current) or any(saved[k].shape != v.shape for k, v in current.items()):
            raise CheckpointError("the critic's value model in the checkpoint does not match the configured one",
                                  "resume with the algo.critic settings and model the run was trained with")
        self.model.load_state_dict(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
