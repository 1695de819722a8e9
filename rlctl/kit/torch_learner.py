"""The plain-torch learner: one process, AdamW, PPO-clip with GRPO advantages.

What this is: the LearnerBackend for CPU and single-device runs (registered as
learner backend ``torch`` by the rlctl_torch_learner plugin), and the base a
sharded learner's rank extends (the fsdp2 and deepspeed plugins override
``_forward``, ``_backward``, ``_mini_batch_step``, ``_clip_grad_norm`` or
``_trained`` and set ``shrink_on_oom = False``). It owns the trainable
policy, an optional frozen reference (when the KL coefficient is > 0), the
optimizer and LR schedule. One ``train_step`` = the configured PPO
epochs x mini-batches over one rollout batch, with gradient accumulation over
micro-batches, gradient clipping, and a skipped update on NaN/Inf gradients
(no parameter or optimizer-state change; the skip counter goes up and the
policy version does not).

Precision: with ``dtype: bfloat16`` the model's parameters are bf16 (forward
and backward run in bf16) and the optimizer owns an fp32 master copy of each:
gradients are cast to fp32, clipped and applied by AdamW with fp32 moments,
and the master weights are cast back into the bf16 parameters. With
``float32`` the parameters are their own master.

Checkpoints: ``checkpoint_state`` returns a private copy of the weights (tied
aliases such as ``lm_head.weight`` dropped, as save_pretrained does; the fp32
master copy when there is one), the
optimizer and LR-schedule state dicts, the mini-batch shuffling generator,
the policy version and the NaN-skip counter; ``load_checkpoint_state`` puts
them back and refuses a checkpoint whose parameter names or shapes differ.
There is no grad scaler: CPU training runs in fp32 or bf16 without loss
scaling (``grad_scaler`` is None).

What this is not: sharded training (the FSDP2 / DeepSpeed learner plugins
wrap ranks of it in a rlctl.kit.ranks.RankGroup) or advantage estimation (the
engine passes advantages in the batch).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any, Mapping

import torch

from rlctl import CheckpointError, PolicyLoss, RoleError, WeightUpdate
from rlctl.algo import (
    entropy_from_logits, gspo_loss, kl_penalty_loss, ppo_clip_loss, process_logits, token_logprobs,
    truncated_is_weights,
)
from rlctl.contracts.batch import TrainBatch
from rlctl.contracts.types import LearnerContext
from rlctl.contracts.checkpoints import LearnerState
from rlctl.engine import state_codec
from rlctl.engine.faults import fault_site, report_recovery
from rlctl.kit.oom import classify_oom
from rlctl.kit.packing import micro_batch_rows, packed_logprobs, sequence_lengths, use_segment_attention
from rlctl.kit.prefill import distinct_prompt_tokens, prefix_shared_logprobs, shared_token_counts
from rlctl.kit.torch_options import TorchLearnerOptions
from rlctl.models.device import placed, resolve_device
from rlctl.models.fingerprint import fingerprint
from rlctl.models.load import load_policy


class TorchLearner:
    """LearnerBackend over an in-process torch model: ``TorchLearner(ctx, TorchLearnerOptions())``.

    Subclasses (a sharded learner's rank) may override the hooks named in the
    module docstring; the update maths stays this class's.
    """

    _capture: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None  # set inside train_step_with_logprobs

    shrink_on_oom = True  # halve the micro-batch and retry after an OOM (a sharded rank cannot: see _recover_oom)

    def __init__(self, ctx: LearnerContext, options: TorchLearnerOptions | None = None) -> None:
        self.options = options or TorchLearnerOptions()
        self.algo, self.optim_cfg = ctx.algo, ctx.optim
        self.norm_len = ctx.max_response_tokens
        self.device = resolve_device(ctx.device, "train.device")
        a = ctx.algo
        self.loss = ctx.policy_loss or PolicyLoss(
            kind="token", clip_low=a.clip_eps, clip_high=a.clip_eps_high or a.clip_eps,
            agg=a.loss_agg or "token-mean", tis_cap=a.tis_cap)
        self.model, _ = load_policy(ctx.model_dir, dtype=self.options.dtype)
        self.model.to(self.device)
        if self.options.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.reference = None
        if self.algo.kl.coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.master: list[torch.Tensor] | None = None  # fp32 master copy of low-precision parameters
        if any(p.dtype != torch.float32 for p in self.model.parameters()):
            self.master = [p.detach().float().clone().requires_grad_(True) for p in self.model.parameters()]
        self._build_optimizer()
        self.generator = torch.Generator().manual_seed(ctx.seed)
        self.policy_version = 0
        self.nan_skips = 0
        self.micro_batch_size = self.algo.micro_batch_size  # halved for the rest of the run after an OOM
        self.micro_batch_tokens = ctx.micro_batch_tokens  # None: padded micro-batches; else packed (rlctl.kit.packing)
        if self.micro_batch_tokens is not None:
            use_segment_attention(self.model)
            use_segment_attention(self.reference)
        self.oom_recoveries = 0
        self._tokens = [0.0, 0.0, 0.0]  # since the last train step: computed, real, FLOP-weighted real (rlctl profile)

    def _build_optimizer(self) -> None:
        """AdamW over the trained tensors and its linear-warmup LR schedule (again after a sharder swaps them)."""
        o = self.optim_cfg
        self.optimizer = torch.optim.AdamW(self._trained(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        warmup = max(1, o.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))

    # -- forward ---------------------------------------------------------------

    def _logprobs(self, model: Any, batch: TrainBatch, with_entropy: bool = False):
        ids, mask = batch.input_ids, batch.attention_mask  # [n, T]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1]  # [n, T-1, V]
        s = batch.sampling
        logp = token_logprobs(logits, ids[:, 1:], s.temperature, s.top_k, s.top_p)  # [n, T-1]
        logp = torch.nn.functional.pad(logp, (1, 0))  # [n, T]: token t is predicted at t-1
        entropy = None
        if with_entropy:
            with torch.no_grad():
                shaped = logits if s.greedy else process_logits(logits.detach(), s.temperature, s.top_k, s.top_p)
                entropy = torch.nn.functional.pad(entropy_from_logits(shaped), (1, 0))  # [n, T]
        return logp, entropy

    def _forward(self, model: Any, batch: TrainBatch, with_entropy: bool = False):
        """Per-token log-probs (and entropy); packed, or with prompts shared by several rows prefilled once."""
        batch = batch.to(self.device)
        real = float(batch.attention_mask.sum())
        with placed(self.device):  # tensors built during the forward (positions, masks) land beside the model
            if self.micro_batch_tokens is not None:
                shared = self.options.share_prompt_prefill and bool((batch.action_mask.sum(-1) > 0).all())
                needed = distinct_prompt_tokens(batch) if shared else real
                self._count_tokens(needed, needed)
                return packed_logprobs(model, batch, with_entropy, self.options.share_prompt_prefill)
            if self.options.share_prompt_prefill:
                shared = prefix_shared_logprobs(model, batch, with_entropy)
                if shared is not None:
                    self._count_tokens(*shared_token_counts(batch))
                    return shared
            self._count_tokens(real, float(batch.attention_mask.numel()))
            return self._logprobs(model, batch, with_entropy)

    def _count_tokens(self, needed: float, computed: float) -> None:
        """Tokens a forward needed (real ones; a shared prompt once) and computed (padding included; none when
        packed, where a shared prompt still counts once per row); a forward with grad is followed by its
        backward, so it weighs 3 forwards in the FLOP count (``rlctl profile``)."""
        self._tokens[0] += computed
        self._tokens[1] += needed
        self._tokens[2] += needed * (3.0 if torch.is_grad_enabled() else 1.0)

    def _micro_batches(self, batch: TrainBatch):
        """Consecutive slices of ``batch``: ``micro_batch_size`` rows, or packed under ``micro_batch_tokens``."""
        for rows in micro_batch_rows(sequence_lengths(batch), self.micro_batch_size, self.micro_batch_tokens):
            yield batch.select(rows)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.cat([self._forward(self.model, mb)[0] for mb in self._micro_batches(batch)]).cpu()

    @property
    def has_reference(self) -> bool:
        """Whether the loss needs reference log-probs (``algo.kl.coef`` > 0), so ``ref_logprobs`` is not None."""
        return self.reference is not None

    @torch.no_grad()
    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.reference is None:
            return None
        return torch.cat([self._forward(self.reference, mb)[0] for mb in self._micro_batches(batch)]).cpu()

    # -- update ----------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        return self._train(batch, capture=False)[0]

    def train_step_with_logprobs(self, batch: TrainBatch) -> tuple[Mapping[str, float], torch.Tensor]:
        """``train_step``, and log pi of the trained tokens under the weights *before* the step, [N, T] on the CPU.

        On the trained tokens (``action_mask``; 0 elsewhere) they are the values
        ``logprobs(batch)`` returns just before ``train_step``
        (up to float rounding of a different micro-batch grouping). With one
        mini-batch (any epochs, any micro-batches) they are the first epoch's
        training forward of every row, taken before its optimizer step, so they
        cost nothing; with several mini-batches, or when the loss already needs
        pi_old (``tis_cap``), they come from that no-grad pass before the step.
        """
        stats, before = self._train(batch, capture=True)
        assert before is not None
        on = batch.action_mask > 0  # prompt positions differ with prefill sharing, and are not trained
        return stats, torch.where(on, before, torch.zeros((), dtype=before.dtype))

    def _train(self, batch: TrainBatch, capture: bool) -> tuple[Mapping[str, float], torch.Tensor | None]:
        fault_site("learner.train_step", rows=batch.num_sequences)
        algo = self.algo
        kl_in_loss = algo.kl.coef > 0 and algo.kl.placement == "loss"  # the reference exists exactly then
        if self.reference is not None and batch.ref_logprobs is None:
            batch = _with_ref(batch, self.ref_logprobs(batch))
        before: torch.Tensor | None = None
        if self.loss.tis_cap is not None and batch.old_logprobs is None:
            before = self.logprobs(batch)
            batch = replace(batch, old_logprobs=before)  # pi_old: before this step's updates
        elif capture and algo.num_mini_batches > 1:  # later mini-batches are forwarded after an update
            before = self.logprobs(batch)
        batch = batch.to(self.device)
        stats: dict[str, list[float]] = {}
        size = batch.num_sequences // algo.num_mini_batches
        applied = 0
        for epoch in range(algo.ppo_epochs):
            order = torch.randperm(batch.num_sequences, generator=self.generator)
            for m in range(algo.num_mini_batches):
                rows = order[m * size:(m + 1) * size]
                mini = batch.select(rows)
                first = epoch == 0 and m == 0  # weights still equal the behaviour policy's
                self._capture = (rows, {}) if capture and before is None and first else None
                try:
                    applied += self._mini_batch_step(mini, kl_in_loss, first, stats)
                    if self._capture is not None:  # every row's forward before the optimizer step, batch order
                        rows_of, parts = self._capture
                        before = torch.empty(batch.action_mask.shape, dtype=parts[0].dtype)
                        before[rows_of] = torch.cat([parts[i] for i in sorted(parts)])
                finally:
                    self._capture = None
        if applied:  # a new policy exists only if some update was applied
            self.policy_version += 1
        out = {k: float(sum(v) / len(v)) for k, v in stats.items() if v}
        for key in ("ratio_max", "logprob_mismatch_max", "is_ratio_max"):
            if stats.get(key):
                out[key] = max(stats[key])
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["nan_inf_skipped_steps"] = float(self.nan_skips)
        out["oom_recoveries"] = float(self.oom_recoveries)
        out["micro_batch_size"] = float(self.micro_batch_size)
        computed, real, weighted = self._tokens  # summed over every forward since the last step
        self._tokens = [0.0, 0.0, 0.0]
        out.update(learner_real_tokens=real, learner_computed_tokens=computed, learner_flop_tokens=weighted,
                   learner_padding_waste=1.0 - real / computed if computed else 0.0)
        return out, before

    def scale_lr(self, factor: float) -> float:
        """Multiply the learning rate (base and current) by ``factor`` for the rest of the run; return the new base."""
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        return self.scheduler.base_lrs[0]

    def _trained(self) -> list[torch.Tensor]:
        """The tensors AdamW updates: the fp32 master copy, or the parameters themselves."""
        return self.master if self.master is not None else list(self.model.parameters())

    def _mini_batch_step(self, mini: TrainBatch, kl_in_loss: bool, first: bool, stats: dict[str, list[float]]) -> bool:
        """One optimizer step over ``mini`` (accumulated over micro-batches); False when it was skipped.

        An out-of-memory error inside the accumulation is recovered here: the
        partial gradient is dropped, the OOM is classified from a memory
        snapshot, the micro-batch is halved (for the rest of the run) and the
        whole mini-batch is accumulated again. Each micro-batch's loss is
        weighted by its share of the mini-batch, so the update is the same sum
        whatever the micro-batch size.
        """
        while True:
            attempt: dict[str, list[float]] = {}
            try:
                self._accumulate(mini, kl_in_loss, first, attempt)
                break
            except torch.OutOfMemoryError as err:
                self.optimizer.zero_grad(set_to_none=True)
                self.model.zero_grad(set_to_none=True)
                self._recover_oom(err, mini)
        for key, values in attempt.items():
            stats.setdefault(key, []).extend(values)
        if self.master is not None:  # fp32 gradients for the fp32 optimizer math
            for param, master in zip(self.model.parameters(), self.master):
                master.grad = None if param.grad is None else param.grad.float()
                param.grad = None
        grad_norm = self._clip_grad_norm()
        stats.setdefault("grad_norm", []).append(grad_norm)
        if not math.isfinite(grad_norm):
            # never apply a non-finite update: parameters, optimizer moments and LR schedule stay as they were
            self.nan_skips += 1
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            return False
        self.optimizer.step()
        self.scheduler.step()
        if self.master is not None:
            with torch.no_grad():
                for param, master in zip(self.model.parameters(), self.master):
                    param.copy_(master)
        return True

    def _recover_oom(self, err: BaseException, mini: TrainBatch) -> None:
        old = self.micro_batch_size
        kind, breakdown = classify_oom(self.model, self.optimizer, min(old, mini.num_sequences),
                                       int(mini.input_ids.shape[1]))
        if not self.shrink_on_oom:
            raise RoleError(f"a sharded learner rank ran out of memory at micro-batch size {old} ({kind}: {err})",
                            "lower algo.micro_batch_size (one rank cannot shrink its micro-batch alone: every rank "
                            "must run the same collectives), enable gradient_checkpointing, or add ranks") from err
        if old <= 1:
            report_recovery("oom_unrecoverable", f"OOM at micro-batch size 1 ({kind}); the step cannot shrink further",
                            {"classification": kind, "bytes": breakdown, "error": str(err)[:200]})
            raise RoleError(f"learner out of memory at micro-batch size 1 ({kind}: {err})",
                            "the step cannot shrink further; see `rlctl runbook show oom` (shard the model, "
                            "lower rollout.max_tokens, or enable gradient checkpointing)") from err
        self.micro_batch_size = max(1, old // 2)
        if self.micro_batch_tokens is not None:  # packed: the token budget is what bounds the activations
            self.micro_batch_tokens = max(1, self.micro_batch_tokens // 2)
        self.oom_recoveries += 1
        report_recovery("oom_recovered", f"OOM in the learner classified as {kind}; micro-batch {old} -> "
                        f"{self.micro_batch_size}, step retried with the same effective batch",
                        {"classification": kind, "micro_batch_from": old, "micro_batch_to": self.micro_batch_size,
                         "bytes": breakdown, "error": str(err)[:200]})

    def _accumulate(self, mini: TrainBatch, kl_in_loss: bool, first: bool, stats: dict[str, list[float]]) -> None:
        algo, spec = self.algo, self.loss
        token_mode = spec.kind == "token" and spec.agg == "token-mean"
        total_tokens = float(mini.action_mask.sum())
        total_seqs = float((mini.action_mask.sum(-1) > 0).sum())
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        micros = list(self._micro_batches(mini))
        capture = self._capture[1] if self._capture is not None else None
        if capture is not None:
            capture.clear()  # an OOM retry forwards the mini-batch again in smaller pieces
        for index, micro in enumerate(micros):
            fault_site("learner.alloc", rows=micro.num_sequences)
            logp, entropy = self._forward(self.model, micro, with_entropy=True)
            if capture is not None:
                capture[index] = logp.detach().cpu()
            mask = micro.action_mask
            anchor, weights, tis = micro.behavior_logprobs, None, {}
            if spec.tis_cap is not None:  # ratio against pi_old, each token weighted by min(pi_old / mu, cap)
                weights, tis = truncated_is_weights(micro.old_logprobs, micro.behavior_logprobs, mask, spec.tis_cap)
                anchor = micro.old_logprobs
            if spec.kind == "sequence":
                loss, info = gspo_loss(logp, anchor, micro.advantages, mask, spec.clip_low, spec.clip_high, weights)
            else:
                loss, info = ppo_clip_loss(logp, anchor, micro.advantages, mask, spec.clip_low, spec.clip_high,
                                           spec.agg, norm_len=self.norm_len, is_weights=weights)
            info.update(tis)
            if micro.ref_logprobs is not None:
                kl_loss, kl_value = kl_penalty_loss(logp, micro.ref_logprobs, mask, algo.kl.estimator,
                                                    spec.agg, norm_len=self.norm_len)
                if kl_in_loss:
                    loss = loss + algo.kl.coef * kl_loss
                info["kl_ref"] = kl_value
            n_tok, n_seq = float(mask.sum()), float((mask.sum(-1) > 0).sum())
            share = (n_tok / max(total_tokens, 1.0)) if token_mode else (n_seq / max(total_seqs, 1.0))
            loss = fault_site("learner.loss", loss)
            self._backward(loss * share, last=index == len(micros) - 1)
            for key in ("loss", "clip_fraction", "ratio_mean", "ratio_max", "approx_kl_behavior", "kl_ref",
                        "tis_weight_mean", "tis_truncated_frac", "is_ratio_max"):
                if key in info:
                    stats.setdefault(key, []).append(float(info[key]))
            on = mask > 0
            if on.any():
                stats.setdefault("entropy", []).append(float(entropy[on].mean()))
                if first:
                    delta = (logp.detach() - micro.behavior_logprobs)[on].abs()
                    stats.setdefault("logprob_mismatch_mean", []).append(float(delta.mean()))
                    stats.setdefault("logprob_mismatch_max", []).append(float(delta.max()))

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate ``loss``'s gradients (``last``: the mini-batch's final micro-batch; a sharder reduces then)."""
        loss.backward()

    def _clip_grad_norm(self) -> float:
        """Clip the trained tensors' gradients to ``grad_clip`` in place; the global norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self._trained(), self.optim_cfg.grad_clip))

    def export_weights(self) -> WeightUpdate:
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        return WeightUpdate(version=self.policy_version, state_dict=state, fingerprint=fingerprint(state))

    def save_pretrained(self, directory: str) -> None:
        self.model.save_pretrained(directory)

    def resident_tensors(self) -> Mapping[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        out = {"policy parameters": params,
               "policy gradients": [p.grad for p in self._trained() if p.grad is not None],
               "policy optimizer states": [t for st in self.optimizer.state.values() for t in st.values()
                                           if isinstance(t, torch.Tensor) and t.dim() > 0]}
        if self.master is not None:
            out["policy master weights"] = list(self.master)
        if self.reference is not None:
            out["reference parameters"] = list(self.reference.parameters())
        return out

    # -- checkpoints -----------------------------------------------------------

    def checkpoint_state(self) -> LearnerState:
        return LearnerState(
            policy_version=self.policy_version,
            weights={k: v.detach().to("cpu", copy=True) for k, v in self._master_state().items()},
            model_files=self._model_files(), optimizer=state_codec.clone(self.optimizer.state_dict()),
            scheduler=state_codec.clone(self.scheduler.state_dict()), grad_scaler=None,
            rng={"minibatch_order": self.generator.get_state()}, counters=self._counters(),
        )

    def _counters(self) -> dict[str, int]:
        out = {"nan_skips": self.nan_skips, "micro_batch_size": self.micro_batch_size,
               "oom_recoveries": self.oom_recoveries}
        if self.micro_batch_tokens is not None:
            out["micro_batch_tokens"] = self.micro_batch_tokens
        return out

    def _restore_progress(self, state: LearnerState) -> None:
        """Everything but weights and optimizer: LR schedule, mini-batch RNG, version, counters."""
        self.scheduler.load_state_dict(state.scheduler)
        self.generator.set_state(state.rng["minibatch_order"])
        self.policy_version = state.policy_version
        self.nan_skips = int(state.counters.get("nan_skips", 0))
        self.micro_batch_size = int(state.counters.get("micro_batch_size", self.algo.micro_batch_size))
        self.oom_recoveries = int(state.counters.get("oom_recoveries", 0))
        if self.micro_batch_tokens is not None:
            self.micro_batch_tokens = int(state.counters.get("micro_batch_tokens", self.micro_batch_tokens))

    def load_checkpoint_state(self, state: LearnerState) -> None:
        current = _unaliased(self.model.state_dict())
        problems = [f"{k} is missing" for k in sorted(set(current) - set(state.weights))]
        problems += [f"{k} is unexpected" for k in sorted(set(state.weights) - set(current))]
        problems += [f"{k} is {list(state.weights[k].shape)} in the checkpoint but {list(v.shape)} now"
                     for k, v in current.items() if k in state.weights and state.weights[k].shape != v.shape]
        if problems:
            raise CheckpointError(f"the model shape changed since the checkpoint: {'; '.join(problems[:3])}"
                                  + (f" and {len(problems) - 3} more" if len(problems) > 3 else ""),
                                  "resume with the model the run was trained with")
        masters = self._masters_by_storage()
        with torch.no_grad():
            for name, tensor in current.items():
                tensor.copy_(state.weights[name])
                if tensor.data_ptr() in masters:
                    masters[tensor.data_ptr()].copy_(state.weights[name])
        self.optimizer.load_state_dict(state.optimizer)
        self._restore_progress(state)

    def _masters_by_storage(self) -> dict[int, torch.Tensor]:
        if self.master is None:
            return {}
        return {p.data_ptr(): m for p, m in zip(self.model.parameters(), self.master)}

    def _master_state(self) -> dict[str, torch.Tensor]:
        """The unaliased state dict with each parameter's fp32 master in its place (when there is one)."""
        masters = self._masters_by_storage()
        return {k: masters.get(v.data_ptr(), v) for k, v in _unaliased(self.model.state_dict()).items()}

    def _model_files(self) -> dict[str, str]:
        config = copy.deepcopy(self.model.config)
        config.architectures = [type(self.model).__name__]
        files = {"config.json": config.to_json_string()}
        generation = getattr(self.model, "generation_config", None)
        if generation is not None:
            files["generation_config.json"] = generation.to_json_string()
        return files


def _unaliased(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without tied aliases (e.g. lm_head.weight sharing the embedding): first name wins."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() == 0 or key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def _with_ref(batch: TrainBatch, ref: torch.Tensor | None) -> TrainBatch:
    return replace(batch, ref_logprobs=ref)

