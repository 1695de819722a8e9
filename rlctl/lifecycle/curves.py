"""A run's curves from the registry, and the PNG of them (``rlctl runs plot``).

What this is: ``series`` (a run's metric points by step, read from the
registry), ``plot_run`` (one panel per metric against the steps done:
training reward, KL to the reference, and the periodic dev eval's pass@1 as
points -- with the eval grader's score and the training reward on the same
dev answers next to it when ``eval.grader`` is set), and ``pyplot`` /
``save_png``, the matplotlib set-up (Agg, nothing opens a window) and the
save every PNG of rlctl shares (ablate's learning curves, profile's
timeline).

What this is not: the live display (rlctl.cli._display) or the metric sinks,
which record the same points while the run trains.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from rlctl.contracts.errors import ConfigError
from rlctl.registry.store import Registry

# The default panels: a title and the metrics drawn in it (a line for a per-step metric, points for an eval's)
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("training reward", ("reward_mean",)),
    ("KL to the reference", ("kl_ref",)),
    ("dev eval (eval.every_steps)", ("eval_dev_pass_at_1", "eval_dev_score", "eval_dev_train_reward")),
)
EVAL_PREFIX = "eval_"  # metrics recorded at eval steps only: drawn as points


def pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path, **options: Any) -> Path:
    """Write ``fig`` to ``path`` (parents made) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, **options)
    pyplot().close(fig)
    return path


def series(registry: Registry, run_id: str, names: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value)] in step order, finite values only; a name never recorded maps to []."""
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    for point in registry.metrics(run_id, names):
        if math.isfinite(point.value):
            out[point.name].append((point.step, point.value))
    return out


def plot_run(registry: Registry, run_ref: str, path: Path | None = None,
             metrics: Sequence[str] = ()) -> tuple[Path, dict[str, int]]:
    """PNG of a run's curves (``metrics``: one panel each; default DEFAULT_PANELS); (path, points per metric).

    ``path`` defaults to ``<run_dir>/curves.png``. A named metric the run never recorded is a ConfigError
    naming the ones it did.
    """
    run = registry.get_run(run_ref)
    panels = [(name, (name,)) for name in metrics] or list(DEFAULT_PANELS)
    names = [name for _, group in panels for name in group]
    points = series(registry, run.id, names)
    missing = [name for name in metrics if not points[name]]
    if missing:
        known = sorted({p.name for p in registry.metrics(run.id)})
        raise ConfigError(f"run {run.id} recorded no metric {', '.join(missing)}",
                          f"pick from: {', '.join(known) or '(none: the run logged no step)'}")
    if path is None:
        if not run.run_dir:
            raise ConfigError(f"run {run.id} has no run directory to write curves.png into",
                              "name the file with -o FILE.png")
        path = Path(run.run_dir) / "curves.png"
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, group) in zip(axes[:, 0], panels):
        drawn = 0
        for name in group:
            xy = points[name]
            if not xy:
                continue
            xs, ys = [s + 1 for s, _ in xy], [v for _, v in xy]  # x: steps done, as the display counts them
            ax.plot(xs, ys, marker="o" if name.startswith(EVAL_PREFIX) else None, markersize=4, label=name)
            drawn += 1
        if not drawn:  # e.g. kl_ref with algo.kl.coef=0, or no eval.every_steps: say so rather than drop the panel
            ax.text(0.5, 0.5, f"{' / '.join(group)}: not recorded by this run", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8, color="grey")
            ax.set_yticks([])
        elif len(group) > 1 or metrics:
            ax.legend(fontsize="small")
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("steps done")
    fig.suptitle(f"run {run.id} ({run.name}, {run.status})", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path), {name: len(points[name]) for name in names}
