"""A run's stored episodes, turn by turn, for people to read (``rlctl episodes RUN``, ``rlctl diagnose --report``).

What this is: ``stored_episodes(run_dir, step=, n=)``, which reads the samples
the run kept in ``<run_dir>/samples.jsonl`` (rlctl.engine.samples: a few of
every logged step's samples, the first group dropped for an unscorable
sample among them) and returns the newest ``n`` as ``episode_json`` dicts:
each turn with who wrote it (``policy`` / ``env``), its span and token ids,
its text, the weight version that sampled a policy turn, the tool, status and
seconds of an environment turn, and its per-turn reward. A single-turn sample
is one policy turn over the whole response. ``status`` is "dropped" for the
samples of a group with a sample that has no reward (``reward_error``: the
group was dropped whole, that sample never scored 0, its siblings not trained
on), else "trained".

Texts: a turn's text is its token ids decoded with the run's tokenizer (read
from the run's final policy directory, else its initial policy), for display
only; without a tokenizer the final answer is ``response_text`` and other
turns show their ids.

What this is not: the sample log (rlctl.engine.samples) or a renderer (the CLI
and rlctl.incidents.diagnose draw these dicts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.contracts.types import Trajectory, Turn, Writer
from rlctl.engine.samples import read_samples

Decode = Callable[[Sequence[int]], str]


def stored_episodes(run_dir: str | Path, *, step: int | None = None, n: int = 4,
                    decode: Decode | None = None) -> list[dict[str, Any]]:
    """The newest ``n`` stored episodes (of ``step`` only, when given; negative counts from the last stored
    step, -1 = the last), oldest first. ``decode``: token ids -> text (default: the run's tokenizer)."""
    by_step = dict(read_samples(run_dir))  # a step written twice keeps its last line
    if step is not None and by_step:
        steps = sorted(by_step)
        if step < 0:
            step = steps[step] if -step <= len(steps) else None
        by_step = {step: by_step[step]} if step in by_step else {}
    picked = [(s, t) for s in sorted(by_step) for t in by_step[s]][-n:] if n > 0 else []
    if picked and decode is None:
        decode = run_decoder(Path(run_dir))
    dropped = {(s, t.prompt_id) for s, ts in by_step.items() for t in ts if t.reward_error is not None}
    return [episode_json(s, t, decode, dropped=(s, t.prompt_id) in dropped) for s, t in picked]


def run_decoder(run_dir: Path) -> Decode | None:
    """The run's tokenizer as a decode function (its final policy, else its initial one); None if neither loads."""
    candidates = [run_dir / "policy" / "final"]
    try:
        candidates.append(Path(json.loads((run_dir / "run.json").read_text())["initial_policy"]))
    except (OSError, ValueError, KeyError):
        pass
    for where in candidates:
        if not (where / "tokenizer_config.json").is_file():
            continue
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        except (OSError, ValueError):
            continue
        return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=False))
    return None


def episode_json(step: int, t: Trajectory, decode: Decode | None = None, dropped: bool | None = None
                 ) -> dict[str, Any]:
    """One stored sample turn by turn (see the module docstring); ``dropped``: its group was dropped (default:
    the sample itself has no reward)."""
    spans = t.turns or (Turn(start=0, end=len(t.response_tokens), writer=Writer.POLICY,
                             policy_version=t.policy_version),)
    last = len(spans) - 1

    def text(i: int, u: Turn) -> str:
        ids = t.response_tokens[u.start:u.end]
        if decode is not None:
            return decode(ids)
        return t.response_text if i == last and u.writer is Writer.POLICY else " ".join(map(str, ids))

    turns = [{"writer": u.writer.value, "start": u.start, "end": u.end,
              "tokens": list(t.response_tokens[u.start:u.end]), "text": text(i, u), "policy_version": u.policy_version,
              "reward": u.reward, "tool": u.tool, "tool_status": u.tool_status, "tool_seconds": u.tool_seconds,
              "tool_retries": u.tool_retries}
             for i, u in enumerate(spans)]
    return {"id": t.id, "prompt_id": t.prompt_id, "step": step,
            "status": "dropped" if (t.reward_error is not None if dropped is None else dropped) else "trained", "multi_turn": bool(t.turns),
            "prompt": decode(t.prompt_tokens) if decode is not None else " ".join(map(str, t.prompt_tokens)),
            "reward": t.reward, "reward_components": dict(t.reward_components), "reward_error": t.reward_error,
            "terminal_reason": t.terminal_reason.value, "policy_versions": list(t.policy_versions),
            "policy_tokens": sum(t.action_mask), "env_tokens": len(t.action_mask) - sum(t.action_mask),
            "turns": turns}

