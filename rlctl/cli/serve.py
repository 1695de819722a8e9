"""``rlctl serve``: run an rlctl engine behind a serving-engine HTTP API.

``rlctl serve rollout --model DIR --port N`` serves the local rollout engine
behind the SGLang native API subset the sglang plugin uses (rlctl.serve).
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Serve rlctl engines over HTTP (SGLang-compatible API).", no_args_is_help=True)


@app.command("rollout")
def rollout(
    model: Path = typer.Option(..., "--model", help="Hugging Face model directory (e.g. from `rlctl sft`)."),
    port: int = typer.Option(30000, "--port", help="TCP port; 0 picks a free one (printed on start)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; keep 127.0.0.1 unless you need more."),
    backend: str = typer.Option("local", "--backend", help="Registered rollout backend that does the sampling."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed of the engine."),
    batch_wait_ms: float = typer.Option(5.0, "--batch-wait-ms", help="How long to collect requests into a batch."),
    verbose: bool = typer.Option(False, "--verbose", help="Log every HTTP request to stderr."),
) -> None:
    """Serve a rollout engine over SGLang's native HTTP API (/generate, /update_weights_from_disk, ...)."""
    from rlctl.serve.server import build_service, serve

    service = build_service(model, backend=backend, seed=seed, max_wait_s=batch_wait_ms / 1000.0)
    serve(service, host, port, verbose=verbose,
          ready=lambda url: typer.echo(f"rlctl serve rollout: listening on {url} (model {model})"))
