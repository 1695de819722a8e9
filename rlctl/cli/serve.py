"""``rlctl serve``: run an rlctl engine behind a serving-engine HTTP API.

``rlctl serve rollout --model DIR --port N`` serves the local rollout engine
behind the SGLang native API subset the sglang plugin uses (rlctl.serve).
``rlctl serve reward --model DIR --port N`` serves a sequence-classification
reward model (scalar head) for the ``reward_model`` reward (rlctl.serve.reward).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Serve rlctl engines over HTTP (rollout: SGLang-compatible API; reward: a reward model).",
                  no_args_is_help=True)

# The HTTP hardening options both servers share (rlctl.serve.http_common, rlctl.serve.listener).
_MAX_BODY_MB = typer.Option(None, "--max-body-mb", min=0.001, help="Request body size limit in MiB (default 8).")
_MAX_CONNECTIONS = typer.Option(512, "--max-connections", min=1, help="Open connections; requests on more get 503.")
_MAX_REQUESTS = typer.Option(64, "--max-requests", min=1, help="Requests in progress at once; more get 503.")
_READ_TIMEOUT_S = typer.Option(10.0, "--read-timeout-s", min=0.1, help="A request's headers, and then its body, "
                               "must arrive within this; idle connections are closed after it.")
_VERBOSE = typer.Option(False, "--verbose", help="Log every HTTP request to stderr.")


@app.command("rollout")
def rollout(
    model: Path = typer.Option(..., "--model", help="Hugging Face model directory (e.g. from `rlctl sft`)."),
    port: int = typer.Option(30000, "--port", min=0, max=65535, help="TCP port; 0 picks a free one (printed on start)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs --api-key."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="RLCTL_SERVE_API_KEY", show_envvar=True,
                                          help="Require `Authorization: Bearer KEY` on every route (SGLang's "
                                               "convention). Prefer the environment variable: argv is public."),
    weights_root: Optional[Path] = typer.Option(None, "--weights-root", help="Load weights "
                                                "(/update_weights_from_disk model_path) only from under this "
                                                "directory, e.g. the trainer's rollout.options.publish_dir."),
    backend: str = typer.Option("local", "--backend", help="Registered rollout backend that does the sampling."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed of the engine."),
    scheduler: str = typer.Option("auto", "--scheduler", help="continuous: requests join the decode batch "
                                  "between steps and each row frees its slot when it ends (the local engine on an "
                                  "fp32 Llama/Qwen2 model); batch: a batch runs to its longest row; auto: "
                                  "continuous where it can run."),
    batch_wait_ms: float = typer.Option(5.0, "--batch-wait-ms", min=0.0, help="How long to collect requests "
                                        "into a batch (batch scheduler)."),
    max_batch_rows: int = typer.Option(256, "--max-batch-rows", min=1, help="Rows per engine batch, shared "
                                       "evenly among waiting requests (continuous: decode slots)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Cap on "
                                                 "sampling_params.max_new_tokens (default 1024, and at most the "
                                                 "model's positions - 1)."),
    max_prompts: Optional[int] = typer.Option(None, "--max-prompts", min=1, help="Sequences per /generate "
                                              "request, n copies included (default 512)."),
    max_body_mb: Optional[float] = _MAX_BODY_MB,
    max_connections: int = _MAX_CONNECTIONS,
    max_requests: int = _MAX_REQUESTS,
    read_timeout_s: float = _READ_TIMEOUT_S,
    verbose: bool = _VERBOSE,
) -> None:
    """Serve a rollout engine over SGLang's native HTTP API (/generate, /update_weights_from_disk, /metrics, ...)."""
    from rlctl.serve.http_common import HttpOptions, check_exposure
    from rlctl.serve.server import build_service, check_scheduler, serve

    check_exposure(host, api_key)  # before the model loads: refusing should be instant (and a bad key too)
    check_scheduler(scheduler)
    http = HttpOptions(api_key=api_key or None, max_connections=max_connections, max_requests=max_requests,
                       read_timeout_s=read_timeout_s)
    service = build_service(model, backend=backend, seed=seed, max_wait_s=batch_wait_ms / 1000.0,
                            max_batch_rows=max_batch_rows, weights_root=weights_root, scheduler=scheduler,
                            max_new_tokens=max_new_tokens,
                            max_prompts=max_prompts,
                            max_body_bytes=None if max_body_mb is None else int(max_body_mb * (1 << 20)))
    serve(service, host, port, http=http, verbose=verbose,
          ready=lambda url: typer.echo(f"rlctl serve rollout: listening on {url} (model {model})"))
    # Shut down cleanly above (work cancelled, engine thread joined, socket closed); skip the interpreter's
    # teardown of torch, which takes seconds on a busy machine and would stretch SIGTERM past a few seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@app.command("reward")
def reward(
    model: Path = typer.Option(..., "--model", help="Hugging Face AutoModelForSequenceClassification directory with "
                               "num_labels=1 (a tiny one: `python scripts/make_reward_model.py DIR`)."),
    port: int = typer.Option(30100, "--port", min=0, max=65535, help="TCP port; 0 picks a free one (printed on start)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs --api-key."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="RLCTL_SERVE_API_KEY", show_envvar=True,
                                          help="Require `Authorization: Bearer KEY` on every route. Prefer the "
                                               "environment variable: argv is public."),
    batch_wait_ms: float = typer.Option(5.0, "--batch-wait-ms", min=0.0, help="How long to collect concurrent "
                                        "requests into one forward pass."),
    max_batch_rows: int = typer.Option(64, "--max-batch-rows", min=1, help="Sequences per forward pass."),
    max_texts: Optional[int] = typer.Option(None, "--max-texts", min=1, help="Sequences per /score request "
                                            "(default 256)."),
    max_body_mb: Optional[float] = _MAX_BODY_MB,
    max_connections: int = _MAX_CONNECTIONS,
    max_requests: int = _MAX_REQUESTS,
    read_timeout_s: float = _READ_TIMEOUT_S,
    verbose: bool = _VERBOSE,
) -> None:
    """Serve a reward model (scalar head) over HTTP: POST /score, GET /info (its model_hash), /health, /metrics."""
    from rlctl.serve.http_common import HttpOptions, check_exposure
    from rlctl.serve.reward import build_reward_service, serve

    check_exposure(host, api_key, "use the reward model")  # before the model loads: refusing should be instant
    http = HttpOptions(api_key=api_key or None, max_connections=max_connections, max_requests=max_requests,
                       read_timeout_s=read_timeout_s)
    service = build_reward_service(model, max_wait_s=batch_wait_ms / 1000.0, max_batch_rows=max_batch_rows,
                                   max_texts=max_texts,
                                   max_body_bytes=None if max_body_mb is None else int(max_body_mb * (1 << 20)))
    serve(service, host, port, http=http, verbose=verbose,
          ready=lambda url: typer.echo(f"rlctl serve reward: listening on {url} (model {model}, "
                                       f"model_hash {service.model_hash})"))
    sys.stdout.flush()  # as `serve rollout`: skip the interpreter's slow torch teardown after a clean shutdown
    sys.stderr.flush()
    os._exit(0)
