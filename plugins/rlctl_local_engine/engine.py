"""The local rollout engine: a Hugging Face causal LM sampled in-process on torch.

What this is: the RolloutBackend for CPU and small models. It generates the G
samples of each prompt together in one batch, returns full Trajectory records,
and applies weight updates all-or-nothing (the new version is served only when
every tensor is loaded and the fingerprint matches).

Resumable state: ``state()`` / ``load_state()`` carry the sampler's torch
generator and the call counter (used in trajectory ids), so a resumed run
draws exactly the samples an uninterrupted one would (rlctl.contracts.roles
StatefulRollout).

What this is not: a serving engine. For production rollout use the sglang
plugin; ``rlctl serve rollout`` puts this engine behind the same HTTP API.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Mapping, Sequence

import torch

from rlctl import RoleError, RolloutRequest, Trajectory, WeightUpdate
from rlctl.contracts.types import RolloutContext
from rlctl.engine.faults import fault_site
from rlctl.engine.weight_apply import apply_update
from rlctl.models.device import placed, resolve_device
from rlctl.models.fingerprint import fingerprint
from rlctl.models.load import load_policy
from rlctl_local_engine.options import LocalEngineOptions
from rlctl_local_engine.sampler import sample


class LocalEngine:
    """RolloutBackend over an in-process torch model."""

    def __init__(self, ctx: RolloutContext, options: LocalEngineOptions | None = None) -> None:
        self.options = options or LocalEngineOptions()
        self.device = resolve_device(self.options.device, "rollout.options.device")
        self.model, self.tokenizer = load_policy(ctx.model_dir)
        self.model.to(self.device)
        self.tokenizer_hash = ctx.tokenizer_hash
        self.policy_version = ctx.policy_version
        self.fingerprint = fingerprint(self.model.state_dict())
        self._generator = torch.Generator(device=self.device).manual_seed(ctx.seed)
        self._tail_generator = torch.Generator().manual_seed(ctx.seed + 7919)
        self._calls = 0

    def generate(self, requests: Sequence[RolloutRequest], *,
                 cancelled: Callable[[], Collection[int]] | None = None) -> list[Trajectory]:
        """Trajectories for ``requests``, in order.

        ``cancelled()``, when given, is polled between decode steps and names
        requests (indices into ``requests``) to stop: their rows end with
        TerminalReason.ABORT at once, so nobody's work keeps a core busy.
        """
        fault_site("rollout.generate", requests=len(requests))
        out: list[Trajectory] = []
        chunk: list[RolloutRequest] = []
        first, rows = 0, 0
        for k, req in enumerate(requests):
            if chunk and rows + req.group_size > self.options.max_batch_sequences:
                out.extend(self._generate_chunk(chunk, _shifted(cancelled, first, len(chunk))))
                chunk, rows, first = [], 0, k
            chunk.append(req)
            rows += req.group_size
        if chunk:
            out.extend(self._generate_chunk(chunk, _shifted(cancelled, first, len(chunk))))
        return out

    def _generate_chunk(self, requests: Sequence[RolloutRequest],
                        cancelled: Callable[[], Collection[int]] | None = None) -> list[Trajectory]:
        sampling = requests[0].sampling
        if any(r.sampling != sampling for r in requests):
            raise RoleError("one generate() call mixes sampling configs", "split the requests by sampling config")
        self._calls += 1
        started = time.time()
        prompts = [list(r.prompt_tokens) for r in requests for _ in range(r.group_size)]
        stop_check = self._stop_check(sampling.stop) if sampling.stop else None
        abort = None
        if cancelled is not None:
            offsets = [0]
            for r in requests:
                offsets.append(offsets[-1] + r.group_size)

            def abort() -> list[int]:
                return [row for k in cancelled() for row in range(offsets[k], offsets[k + 1])]

        with placed(self.device):  # prompt, cache and sampling tensors live beside the model
            result = sample(self.model, prompts, sampling, eos_id=self.tokenizer.eos_token_id,
                            pad_id=self.tokenizer.pad_token_id, generator=self._generator, stop_check=stop_check,
                            abort=abort, min_lengths=self._tail_lengths(len(prompts), sampling.max_tokens))
        texts = self.tokenizer.batch_decode(result.tokens, skip_special_tokens=True)
        trajectories = []
        row = 0
        for req in requests:
            for g in range(req.group_size):
                trajectories.append(Trajectory.create(
                    id=f"{req.prompt_id}/v{self.policy_version}/c{self._calls}/{g}",
                    prompt_id=req.prompt_id, group_index=g, dataset_version=req.dataset_version,
                    policy_version=self.policy_version, tokenizer_hash=self.tokenizer_hash,
                    prompt_tokens=tuple(req.prompt_tokens), response_tokens=tuple(result.tokens[row]),
                    response_text=texts[row], action_mask=(1,) * len(result.tokens[row]),
                    behavior_logprobs=tuple(result.logprobs[row]), sampling_config=sampling,
                    terminal_reason=result.reasons[row], rollout_started_at=started,
                ))
                row += 1
        return trajectories

    def _tail_lengths(self, n: int, max_tokens: int) -> list[int] | None:
        """Pareto-distributed decode lengths for the long-tail option (own generator: sampling is unchanged)."""
        alpha = self.options.length_tail_alpha
        if alpha is None:
            return None
        u = torch.rand(n, generator=self._tail_generator).clamp(min=1e-12)
        lengths = (self.options.length_tail_min * u.pow(-1.0 / alpha)).ceil().clamp(max=max_tokens)
        return [int(x) for x in lengths.tolist()]

    def _stop_check(self, stops: Sequence[str]) -> Any:
        def check(tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return any(text.endswith(s) for s in stops)

        return check

    def update_weights(self, update: WeightUpdate) -> None:
        """All or nothing: the whole update is checked and staged before the served weights change."""
        self.fingerprint = apply_update(self.model, update)
        self.policy_version = update.version

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """The weights being served (read only: the base a delta weight update is applied to)."""
        return self.model.state_dict()

    def state(self) -> Mapping[str, Any]:
        return {"generator": self._generator.get_state(), "calls": self._calls}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self._generator.set_state(state["generator"])
        self._calls = int(state["calls"])

    def health(self) -> Mapping[str, Any]:
        return {"ok": True, "policy_version": self.policy_version, "fingerprint": self.fingerprint}

    def resident_tensors(self) -> Mapping[str, Sequence[torch.Tensor]]:
        return {"rollout weights": list(self.model.parameters())} if self.model is not None else {}

    def close(self) -> None:
        self.model = None


def _shifted(cancelled: Callable[[], Collection[int]] | None, first: int,
             count: int) -> Callable[[], list[int]] | None:
    """``cancelled`` for the chunk of requests [first, first + count), as chunk-local indices."""
    if cancelled is None:
        return None
    return lambda: [k - first for k in cancelled() if first <= k < first + count]
