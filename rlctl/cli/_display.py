"""Live progress for training: a rich progress bar with the key metrics of each step.

What this is: callbacks for rlctl.ops.train that render the warm start and the
RL steps (step, reward mean, kl_ref, entropy, response length, clip fraction,
tokens/s, ETA). What this is not: metric storage.
"""

from __future__ import annotations

from typing import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlctl.contracts.types import RunRecord
from rlctl.ops.train import TrainCallbacks

SHOWN = (("reward", "reward_mean"), ("kl_ref", "kl_ref"), ("entropy", "entropy"),
         ("len", "response_length_mean"), ("clip", "clip_fraction"), ("tok/s", "generated_tokens_per_s"))


class TrainDisplay:
    def __init__(self, total_steps: int, console: Console, enabled: bool = True) -> None:
        self.total = total_steps
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, disable=not enabled, transient=False,
        )
        self._warm = None
        self._steps = None
        self.run_id: str | None = None

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

    def warm_start(self, step: int, total: int, loss: float, dev_accuracy: float | None = None) -> None:
        if self._warm is None:
            self._warm = self.progress.add_task("warm start (SFT)", total=total, info="")
            self._dev = ""
        if dev_accuracy is not None:
            self._dev = f"  dev {dev_accuracy:.1%}"
        self.progress.update(self._warm, completed=step, info=f"loss {loss:.3f}{self._dev}")

    def run_started(self, run: RunRecord) -> None:
        self.run_id = run.id
        self.progress.console.print(f"run [bold]{run.id}[/] -> {run.run_dir}")
        self._steps = self.progress.add_task("GRPO", total=self.total, info="")

    def start(self, first_step: int, total_steps: int) -> None:
        if self._steps is not None:
            self.progress.update(self._steps, completed=first_step, total=total_steps)
        if first_step:
            self.progress.console.print(f"resuming at step {first_step} of {total_steps}")

    def warning(self, message: str) -> None:
        self.progress.console.print(f"[yellow]warning:[/] {message}", markup=True, highlight=False)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        info = "  ".join(f"{label} {metrics[key]:.3g}" for label, key in SHOWN if key in metrics)
        self.progress.update(self._steps, completed=step + 1, info=info)

    def eval_progress(self, message: str) -> None:
        self.progress.console.print(f"eval: {message}")
