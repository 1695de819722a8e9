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
from typing import Any, Mapping, Sequence

import torch

from rlctl import RoleError, RolloutRequest, Trajectory, WeightUpdate
from rlctl.contracts.types import RolloutContext
from rlctl.models.device import resolve_device
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
        self._calls = 0

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        out: list[Trajectory] = []
        chunk: list[RolloutRequest] = []
        rows = 0
        for req in requests:
            if chunk and rows + req.group_size > self.options.max_batch_sequences:
                out.extend(self._generate_chunk(chunk))
                chunk, rows = [], 0
            chunk.append(req)
            rows += req.group_size
        if chunk:
            out.extend(self._generate_chunk(chunk))
        return out

    def _generate_chunk(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        sampling = requests[0].sampling
        if any(r.sampling != sampling for r in requests):
            raise RoleError("one generate() call mixes sampling configs", "split the requests by sampling config")
        self._calls += 1
        started = time.time()
        prompts = [list(r.prompt_tokens) for r in requests for _ in range(r.group_size)]
        stop_check = self._stop_check(sampling.stop) if sampling.stop else None
        with self.device:  # prompt, cache and sampling tensors live beside the model
            result = sample(self.model, prompts, sampling, eos_id=self.tokenizer.eos_token_id,
                            pad_id=self.tokenizer.pad_token_id, generator=self._generator, stop_check=stop_check)
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

    def _stop_check(self, stops: Sequence[str]) -> Any:
        def check(tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return any(text.endswith(s) for s in stops)

        return check

    def update_weights(self, update: WeightUpdate) -> None:
        current = self.model.state_dict()
        missing = sorted(set(current) - set(update.state_dict))
        if missing:
            raise RoleError(f"weight update v{update.version} lacks {len(missing)} tensor(s), e.g. {missing[0]}",
                            "publish the full state dict")
        staged = {k: v.detach().to(device=current[k].device, dtype=current[k].dtype, copy=True)
                  for k, v in update.state_dict.items() if k in current}
        got = fingerprint(staged)
        if got != update.fingerprint:
            raise RoleError(f"weight update v{update.version} fingerprint mismatch ({got} != {update.fingerprint})",
                            "the weights changed in transit; republish")
        self.model.load_state_dict(staged, strict=False)
        self.fingerprint, self.policy_version = got, update.version

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
