"""``rlctl resume RUN`` and ``rlctl export CKPT --hf DIR``: continue a run, export a checkpoint's model."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry
from rlctl.cli.train import AllowChangeOpt, run_resume


def resume(run: str = typer.Argument(..., help="Run id (or a unique prefix)."),
           overrides: Optional[List[str]] = typer.Argument(
               None, help="Dotted overrides on the checkpoint's config, e.g. train.steps=40."),
           allow_config_change: bool = AllowChangeOpt, registry: Optional[str] = RegistryOpt,
           json_out: bool = JsonOpt) -> None:
    """Continue a run from its newest committed checkpoint (every checksum verified, else the previous one)."""
    run_resume(run, None, overrides or [], allow_config_change, registry, json_out)


def export(checkpoint: str = typer.Argument(..., help="A checkpoint directory (RUN_DIR/checkpoints/step-000020), "
                                            "a run directory or a run id (its newest verified checkpoint)."),
           hf: Path = typer.Option(..., "--hf", help="New directory for the Hugging Face model (weights, config, "
                                   "tokenizer)."),
           registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Export a checkpoint's policy as a plain Hugging Face model directory (checksums verified first)."""
    from rlctl.lifecycle.resume import export as run_export

    source, target, skipped = run_export(checkpoint, hf, lambda: open_registry(registry))
    for message in skipped:
        _output.err_console.print(f"warning: {message}", markup=False, highlight=False)
    if json_out:
        _output.print_json({"checkpoint": str(source), "hf_dir": str(target), "skipped": skipped})
    else:
        _output.console.print(f"exported {source} -> {target}")
