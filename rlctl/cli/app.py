"""The ``rlctl`` command: composes the command groups; no logic lives here.

``rlctl --help`` must stay fast: nothing here imports torch (a test checks).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional, Sequence

import typer

from rlctl.cli import ablate as ablate_cli
from rlctl.cli import checkpoints as checkpoints_cli
from rlctl.cli import diagnose as diagnose_cli
from rlctl.cli import faults as faults_cli
from rlctl.cli import dryrun as dryrun_cli
from rlctl.cli import episodes as episodes_cli
from rlctl.cli import eval as eval_cli
from rlctl.cli import plugins as plugins_cli
from rlctl.cli import profile as profile_cli
from rlctl.cli import registry as registry_cli
from rlctl.cli import reward as reward_cli
from rlctl.cli import runs as runs_cli
from rlctl.cli import serve as serve_cli
from rlctl.cli import train as train_cli
from rlctl.cli._errors import report
from rlctl.cli._output import json_only_stdout


def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors (same as RLCTL_DEBUG=1).")) -> None:
    """rlctl: reliable, versioned LLM RL post-training (GRPO, PPO)."""
    if debug:
        os.environ["RLCTL_DEBUG"] = "1"


def build_app(with_plugins: bool = True) -> typer.Typer:
    app = typer.Typer(name="rlctl", no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                      callback=_root)
    app.command("train")(train_cli.train)
    app.command("sft")(train_cli.sft)
    app.command("resume")(checkpoints_cli.resume)
    app.command("export")(checkpoints_cli.export)
    app.command("eval")(eval_cli.eval_cmd)
    app.command("dryrun")(dryrun_cli.dryrun)
    app.command("profile")(profile_cli.profile)
    app.command("ablate")(ablate_cli.ablate)
    app.add_typer(runs_cli.app, name="runs")
    app.command("episodes")(episodes_cli.episodes)
    app.add_typer(plugins_cli.app, name="plugins")
    app.add_typer(registry_cli.app, name="registry")
    app.add_typer(reward_cli.app, name="reward")
    app.add_typer(serve_cli.app, name="serve")
    app.command("diagnose")(diagnose_cli.diagnose)
    app.command("inject")(faults_cli.inject)
    app.command("drill")(faults_cli.drill)
    app.add_typer(diagnose_cli.runbook_app, name="runbook")
    if with_plugins:
        from rlctl.hooks.manager import load_plugins

        load_plugins().pm.hook.register_commands(app=app)
    return app


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point: run the app, turn known errors into one line + exit code."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        with json_only_stdout() if "--json" in args else contextlib.nullcontext():
            build_app()(args=args, prog_name="rlctl", standalone_mode=True)
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    except BaseException as err:  # noqa: BLE001 - report() re-raises anything it does not know
        return report(err)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def console_main() -> None:
    sys.exit(main())
