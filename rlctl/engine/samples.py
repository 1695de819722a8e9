"""A few of each step's episodes, kept for people to read (``rlctl episodes RUN``, the HTML report).

What this is: ``SampleLog``, which appends ``per_step`` trajectories of each
step to ``<run dir>/samples.jsonl`` (a few from the trained groups, and, when
the step dropped groups, a few of those too: a flagged episode is the one to
look at), one JSON object per line::

    {"step": 3, "split": "train", "status": "trained" | "dropped" | "no_signal",
     "prompt_text": "...", "turn_texts": ["...", ...], "trajectory": {...}}

``trajectory`` is the whole Trajectory (rlctl.engine.queue_log's dict, turns
included; its checksum is checked when read back); ``turn_texts`` is each
turn's span decoded with the run's tokenizer (one text for a single-turn
sample), for display only: the token ids stay the truth. ``read_samples``
reads them back, filtered by step and split; a step written twice (a resumed
or rolled-back run redoes it) keeps its last write.

What this is not: training data or an audit log (the queue's WAL and the
checkpoints are those); a lost line costs nothing but a picture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlctl.contracts.types import Trajectory, Turn, Writer
from rlctl.engine.queue_log import trajectory_from_dict, trajectory_to_dict

FILE = "samples.jsonl"


@dataclass(frozen=True, slots=True)
class Sample:
    """One stored episode: where it came from, its texts per turn, and the trajectory itself."""

    step: int
    split: str
    status: str
    prompt_text: str
    turn_texts: tuple[str, ...]
    trajectory: Trajectory


class SampleLog:
    """Appends up to ``per_step`` episodes of every step (0: none) to ``path``."""

    def __init__(self, path: Path, per_step: int, tokenizer: Any = None) -> None:
        self.path, self.per_step, self.tokenizer = Path(path), per_step, tokenizer

    def record(self, step: int, *, trained: Sequence[Trajectory], dropped: Sequence[Trajectory] = (),
               no_signal: Sequence[Trajectory] = (), split: str = "train") -> None:
        if self.per_step <= 0:
            return
        share = max(1, self.per_step // 2) if dropped else self.per_step  # dropped episodes get half the room
        picked = [("dropped", t) for t in dropped[:share]]
        rest = [("trained", t) for t in trained] + [("no_signal", t) for t in no_signal]
        picked += rest[:self.per_step - len(picked)]
        lines = [json.dumps({"step": step, "split": split, "status": status,
                             "prompt_text": self._decode(t.prompt_tokens), "turn_texts": self.turn_texts(t),
                             "trajectory": trajectory_to_dict(t)}) for status, t in picked]
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")

    def turn_texts(self, t: Trajectory) -> list[str]:
        if not t.turns:
            return [t.response_text]
        return [self._decode(t.response_tokens[u.start:u.end]) for u in t.turns]

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


def read_samples(path: Path, *, step: int | None = None, split: str | None = None) -> list[Sample]:
    """The stored episodes at ``path`` (a run directory or its samples.jsonl), oldest step first.

    ``step``: only that step (negative: counted from the last stored step, -1 = the last); ``split``: only
    that split. A line cut short by a crash is skipped."""
    file = path / FILE if path.is_dir() else path
    if not file.exists():
        return []
    latest: dict[tuple[int, str], Sample] = {}
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            raw = json.loads(line)
            sample = Sample(step=int(raw["step"]), split=str(raw["split"]), status=str(raw["status"]),
                            prompt_text=str(raw.get("prompt_text", "")),
                            turn_texts=tuple(str(x) for x in raw.get("turn_texts", ())),
                            trajectory=trajectory_from_dict(raw["trajectory"]))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line, or a trajectory whose checksum fails: not shown
        key = (sample.step, sample.trajectory.id)
        latest.pop(key, None)  # a redone step: its last write wins
        latest[key] = sample
    samples = sorted(latest.values(), key=lambda s: s.step)
    if split is not None:
        samples = [s for s in samples if s.split == split]
    if step is not None and samples:
        steps = sorted({s.step for s in samples})
        want = steps[step] if step < 0 and -step <= len(steps) else step
        samples = [s for s in samples if s.step == want]
    return samples


def episode_json(sample: Sample) -> dict[str, Any]:
    """A stored episode turn by turn (what ``rlctl episodes --json`` prints and the renderers draw).

    Each turn: who wrote it (``policy`` / ``env``), its token span and ids, its text, the weight version
    that sampled a policy turn, the tool, its status and seconds of an environment turn, and its per-turn
    reward. A single-turn sample is one policy turn over the whole response."""
    t = sample.trajectory
    spans = t.turns or (Turn(start=0, end=len(t.response_tokens), writer=Writer.POLICY,
                             policy_version=t.policy_version),)
    texts = list(sample.turn_texts)
    if len(texts) != len(spans):  # no decoded texts stored: the whole response, or nothing per turn
        texts = [t.response_text] if len(spans) == 1 else [""] * len(spans)
    turns = [{"writer": u.writer.value, "start": u.start, "end": u.end,
              "tokens": list(t.response_tokens[u.start:u.end]), "text": text, "policy_version": u.policy_version,
              "reward": u.reward, "tool": u.tool, "tool_status": u.tool_status, "tool_seconds": u.tool_seconds}
             for u, text in zip(spans, texts)]
    return {"id": t.id, "prompt_id": t.prompt_id, "step": sample.step, "split": sample.split,
            "status": sample.status, "multi_turn": bool(t.turns), "prompt": sample.prompt_text,
            "reward": t.reward, "reward_components": dict(t.reward_components), "reward_error": t.reward_error,
            "terminal_reason": t.terminal_reason.value, "policy_versions": list(t.policy_versions),
            "policy_tokens": sum(t.action_mask), "env_tokens": len(t.action_mask) - sum(t.action_mask),
            "turns": turns}
