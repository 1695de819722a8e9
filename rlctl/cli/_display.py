"""Live progress for training: a rich progress bar on a terminal, plain full lines elsewhere.

What this is: callbacks for rlctl.lifecycle.train / resume that render the warm
start and the RL steps (step, reward mean, kl_ref, entropy, response length,
clip fraction, tokens/s, elapsed, ETA). On a terminal that is a rich progress
bar. Without one (output piped to a file, a cluster job log) a redrawn bar
would be cut to the console width, so the display prints one complete plain
line every ``train.log_every`` RL steps (and the last), and one per 5% of the
warm start: never cropped, never wrapped.

What this is not: metric storage (sinks and the registry hold the metrics).
"""

from __future__ import annotations

import time
from typing import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlctl.contracts.types import RunRecord
from rlctl.lifecycle.train import TrainCallbacks

SHOWN = (("reward", "reward_mean"), ("kl_ref", "kl_ref"), ("entropy", "entropy"),
         ("len", "response_length_mean"), ("clip", "clip_fraction"), ("tok/s", "generated_tokens_per_s"))
WARM_START_LINES = 20  # plain mode: one warm-start line per 1/20 of its steps


class TrainDisplay:
    def __init__(self, total_steps: int, console: Console, enabled: bool = True, plain: bool | None = None) -> None:
        self.total = total_steps
        self.console = console
        self.plain = (not console.is_terminal) if plain is None else plain
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, disable=not enabled or self.plain, transient=False,
        )
        self.enabled = enabled
        self._warm = None
        self._steps = None
        self.run_id: str | None = None
        self.label = "RL"  # the estimator's name once the run is known
        self.every = 1
        self.first = 0
        self._dev: float | None = None
        self._gap: float | None = None  # eval.grader: the latest training-reward-minus-eval-score gap
        self._t0 = self._warm_t0 = time.monotonic()

    def __enter__(self) -> "TrainDisplay":
        import warnings

        self.progress.start()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):  # type: ignore[no-untyped-def]
            from rlctl.models.warm_start import WarmStartWarning

            if issubclass(category, WarmStartWarning):
                self.warning(str(message))
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc: object) -> None:
        self._warnings.__exit__(*exc)
        self.progress.stop()

    def callbacks(self) -> TrainCallbacks:
        return TrainCallbacks(warm_start=self.warm_start, run_started=self.run_started, step=self.step,
                              eval_progress=self.eval_progress, start=self.start, warning=self.warning)

    def line(self, text: str) -> None:
        """One message line: full length (no cropping or wrapping), markup off."""
        if self.enabled:
            self.console.print(text, soft_wrap=True, markup=False, highlight=False, emoji=False)

    def warm_start(self, step: int, total: int, loss: float, dev_accuracy: float | None = None) -> None:
        if self.plain:
            every = max(1, total // WARM_START_LINES)
            if step == 1:
                self._warm_t0 = time.monotonic()
            if dev_accuracy is not None:  # a dev check of the warm start's stopping target: always a line
                self.line(f"warm start (SFT) {step}/{total}  loss {loss:.3f}  dev accuracy {dev_accuracy:.1%}")
            elif step % every == 0 or step == total:
                self.line(f"warm start (SFT) {step}/{total}  loss {loss:.3f}  "
                          f"{_timing(time.monotonic() - self._warm_t0, step, total)}")
            return
        if self._warm is None:
            self._warm = self.progress.add_task("warm start (SFT)", total=total, info="")
            self._dev = ""
        if dev_accuracy is not None:
            self._dev = f"  dev {dev_accuracy:.1%}"
        self.progress.update(self._warm, completed=step, info=f"loss {loss:.3f}{self._dev}")

    def run_started(self, run: RunRecord) -> None:
        self.run_id = run.id
        self.label = str(run.config.get("algo", {}).get("name", "rl")).upper()  # the estimator: GRPO, PPO, ...
        if self.plain:
            self.line(f"run {run.id} -> {run.run_dir}")
            return
        self.progress.console.print(f"run [bold]{run.id}[/] -> {run.run_dir}")
        self._steps = self.progress.add_task(self.label, total=self.total, info="")

    def start(self, first_step: int, total_steps: int, log_every: int = 1) -> None:
        self.total, self.every, self.first = total_steps, max(1, log_every), first_step
        self._t0 = time.monotonic()
        if self._steps is not None:
            self.progress.update(self._steps, completed=first_step, total=total_steps)
        if first_step:
            self.line(f"resuming at step {first_step} of {total_steps}")

    def warning(self, message: str) -> None:
        if self.plain:
            self.line(f"warning: {message}")
            return
        self.progress.console.print(f"[yellow]warning:[/] {message}", markup=True, highlight=False)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        info = "  ".join(f"{label} {metrics[key]:.3g}" for label, key in SHOWN if key in metrics)
        self._dev = metrics.get("eval_dev_pass_at_1", self._dev)  # eval.every_steps: the latest dev pass@1 stays
        if self._dev is not None:
            info += f"  dev {self._dev:.3g}"
        self._gap = metrics.get("eval_reward_gap", self._gap)
        if self._gap is not None:
            info += f"  gap {self._gap:+.3g}"
        if self.plain:
            if step % self.every == 0 or step == self.total - 1:
                done = step + 1 - self.first
                timing = _timing(time.monotonic() - self._t0, done, self.total - self.first)
                self.line(f"{self.label} step {step + 1}/{self.total}  {info}  {timing}")
            return
        self.progress.update(self._steps, completed=step + 1, info=info)

    def eval_progress(self, message: str) -> None:
        self.line(f"eval: {message}")


def _timing(elapsed: float, done: int, total: int) -> str:
    eta = elapsed / done * (total - done) if done > 0 else 0.0
    return f"elapsed {_clock(elapsed)}  ETA {_clock(eta)}"


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
