"""Get the GPU machine's own python ready for tests/gpu/run.sh, where nothing can be fetched.

What this is: the first step of run.sh, run with the machine's python (``PY``), in three verbs:
  plan     which of rlctl's requirements (pyproject's dependencies and the test runner; the bench extra
           for the TRL step) the image meets and which come from a wheel in ``.whl/`` (scripts/gpu_wheels.sh
           fills it). A wheel is taken only where the image lacks the package or its version is outside
           rlctl's range, and the wheels taken have their own requirements checked the same way. A core
           requirement that neither the image nor a wheel meets fails here, in seconds, naming it and the
           fix; an unmet bench one only leaves TRL out (run.sh's TRL step then fails at its import);
  install  ``plan``, then ``pip install --no-index --no-deps --target SITE`` of those wheels and of rlctl
           itself (editable, so its ``rlctl`` entry points, which load the built-in plugins, are there),
           for ``PYTHONPATH=REPO:REPO/plugins:SITE``;
  check    imports every module the run needs under that PYTHONPATH, prints a table of versions and where
           each came from, and fails naming each module that does not import and the step that needs it;
  cuda     names the device torch sees, or says "no CUDA device" and exits 3 (run.sh then stops cleanly).
What this is not: a dependency resolver (one pinned wheel per name, chosen by scripts/gpu_wheels.sh), nor a
way to set up a developer's venv (README's pip install).
"""

from __future__ import annotations

import argparse
import email.parser
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
EXTRA = "bench"  # TRL's GRPOTrainer for run.sh's step-time comparison: optional, the other steps run without it
TEST_RUNNER = ("pytest>=8", "hypothesis>=6.100")  # the image's own; the dev extra's exact pins are for venvs
OPTIONAL = {"ray": "the Ray-actor GPU test skips without it (its 76 MiB wheel does not travel)"}

# module to import, its distribution, the run.sh step that needs it (modules of OPTIONAL_STEP only warn)
OPTIONAL_STEP = "TRL step time"
IMPORTS: tuple[tuple[str, str, str], ...] = (
    ("torch", "torch", "every step"),
    ("torch.distributed.fsdp", "torch", "gpu tests, fsdp ledger (FSDP2)"),
    ("transformers", "transformers", "every step"),
    ("tokenizers", "tokenizers", "every step"),
    ("safetensors", "safetensors", "every step"),
    ("numpy", "numpy", "every step"),
    ("yaml", "pyyaml", "every step (configs)"),
    ("pydantic", "pydantic", "every step (config models)"),
    ("sqlalchemy", "sqlalchemy", "quickstart, fsdp ledger (registry)"),
    ("alembic", "alembic", "quickstart, fsdp ledger (registry migrations)"),
    ("typer", "typer", "quickstart (CLI)"),
    ("rich", "rich", "quickstart (CLI)"),
    ("pluggy", "pluggy", "every step (plugins)"),
    ("sympy", "sympy", "rewards (symbolic grader)"),
    ("matplotlib", "matplotlib", "rlctl plots (a dependency)"),
    ("pytest", "pytest", "gpu tests"),
    ("hypothesis", "hypothesis", "gpu tests (tests.unit.test_colocate)"),
    ("accelerate", "accelerate", OPTIONAL_STEP),
    ("datasets", "datasets", OPTIONAL_STEP),
    ("trl", "trl", OPTIONAL_STEP),
    ("rlctl.cli.app", "rlctl", "quickstart"),
    ("rlctl.placement.build", "rlctl", "every step"),
    ("rlctl.planning.dryrun", "rlctl", "fsdp ledger"),
    ("rlctl_local_engine.engine", "rlctl", "every step"),
    ("rlctl_fsdp_learner.learner", "rlctl", "gpu tests, fsdp ledger"),
    ("tests.unit.test_bf16", "rlctl", "gpu tests (imported inside them)"),
    ("tests.unit.test_fsdp_checkpoint", "rlctl", "gpu tests (imported inside them)"),
    ("tests.unit.test_colocate", "rlctl", "gpu tests (imported inside them)"),
)


class PrepareError(Exception):
    """A requirement neither the image nor .whl/ meets, or a broken .whl/; the message names it and the fix."""


@dataclass(frozen=True, slots=True)
class Wheel:
    name: str
    version: Version
    path: Path
    requires: tuple[Requirement, ...]


@dataclass(slots=True)
class Plan:
    """Per distribution: the version used and where it comes from ('image' or the wheel's file name)."""

    rows: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # name -> (needs, version, source)
    wheels: dict[str, Wheel] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def rlctl_requirements(pyproject: Path = REPO / "pyproject.toml") -> tuple[list[Requirement], list[Requirement]]:
    """(core, bench): pyproject's dependencies plus the test runner, and the bench extra."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    core = [Requirement(s) for s in (*project["dependencies"], *TEST_RUNNER)]
    return core, [Requirement(s) for s in project["optional-dependencies"][EXTRA]]


def read_wheels(folder: Path) -> dict[str, Wheel]:
    """The wheels in ``folder`` by canonical name; two versions of one name are an error (pip would take both)."""
    found: dict[str, Wheel] = {}
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        name, version, _, _ = parse_wheel_filename(path.name)
        if name in found:
            raise PrepareError(f"{folder} holds two wheels of {name} ({found[name].path.name}, {path.name}): "
                               "pip would install both; keep one (scripts/gpu_wheels.sh empties the folder first)")
        found[name] = Wheel(name, version, path, _wheel_requires(path))
    return found


def _wheel_requires(path: Path) -> tuple[Requirement, ...]:
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = email.parser.Parser().parsestr(zf.read(meta).decode())
    return tuple(Requirement(r) for r in message.get_all("Requires-Dist") or [])


def image_version(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def plan(requirements: list[Requirement], wheels: dict[str, Wheel],
         installed: Callable[[str], Version | None] = image_version) -> Plan:
    """Take a wheel where the image's version (``installed``) is missing or outside a requirement, then hold
    every requirement seen, the picked wheels' own included, against the versions finally used."""
    out = Plan()
    needs: dict[str, list[tuple[Requirement, str]]] = {}
    queue = [(r, "rlctl") for r in requirements]
    while queue:
        req, by = queue.pop(0)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        needs.setdefault(name, []).append((req, by))
        have = installed(name)
        if name in out.wheels or (have is not None and req.specifier.contains(have, prereleases=True)):
            continue
        wheel = wheels.get(name)
        if wheel is not None and req.specifier.contains(wheel.version, prereleases=True):
            out.wheels[name] = wheel
            queue += [(r, name) for r in wheel.requires]
    for name, reqs in needs.items():
        wheel, have = out.wheels.get(name), installed(name)
        used = wheel.version if wheel is not None else have
        spec = str(SpecifierSet(",".join(str(r.specifier) for r, _ in reqs if str(r.specifier)))) or "any"
        source = wheel.path.name if wheel is not None else "image"
        out.rows[name] = (spec, str(used) if used is not None else "-", source if used is not None else "MISSING")
        for req, by in reqs:
            if used is None or not req.specifier.contains(used, prereleases=True):
                out.problems.append(_problem(name, req, by, have, wheels.get(name)))
    return out


def _problem(name: str, req: Requirement, by: str, have: Version | None, wheel: Wheel | None) -> str:
    image = f"the image has {have}" if have is not None else "the image lacks it"
    carried = f".whl/ has {wheel.version}" if wheel is not None else ".whl/ has no wheel of it"
    fix = (f"add '{name}==VERSION' (a version in that range) to scripts/gpu_wheels.sh and run it"
           if wheel is None else "change its pin in scripts/gpu_wheels.sh to a version in that range and run it")
    return f"{req} (needed by {by}): {image}, {carried}; {fix}"


def print_plan(result: Plan) -> None:
    print(f"{'distribution':<22}{'required':<26}{'version':<12}source")
    for name, (spec, version, source) in sorted(result.rows.items()):
        print(f"{name:<22}{spec[:25]:<26}{version:<12}{source}")
    for name, why in OPTIONAL.items():
        have = image_version(name)
        print(f"{name:<22}{'optional':<26}{str(have or '-'):<12}{'image' if have else 'absent: ' + why}")


def install(result: Plan, site: Path, python: str = sys.executable) -> None:
    pip = [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", "--target", str(site)]
    if result.wheels:
        _run([*pip, "--no-compile", "--upgrade", *(str(w.path) for w in result.wheels.values())])
    # editable: the dist-info with rlctl's entry points lands in SITE, the code stays in REPO (on PYTHONPATH)
    _run([*pip, "--no-build-isolation", "--editable", str(REPO)])


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PrepareError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def check_imports(imports: tuple[tuple[str, str, str], ...] = IMPORTS) -> tuple[list[str], list[str]]:
    """Import each module and print its version and origin (image, site = a wheel from .whl/, repo);
    return (failures, warnings): one line each, a module of OPTIONAL_STEP only warns."""
    import importlib

    failures, warnings = [], []
    print(f"{'module':<34}{'version':<16}{'from':<8}needed by")
    for module, dist, step in imports:
        try:
            mod = importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure is the finding
            missing = getattr(err, "name", None) or module
            line = f"{module}: {type(err).__name__}: {err} (missing: {missing}; needed by {step})"
            (warnings if step == OPTIONAL_STEP else failures).append(line)
            print(f"{module:<34}{'FAILED':<16}{'-':<8}{step} (missing: {missing})")
            continue
        print(f"{module:<34}{str(image_version(dist) or '?'):<16}{_origin(mod):<8}{step}")
    return failures + _check_plugins(), warnings


def _origin(module: object) -> str:
    path = Path(getattr(module, "__file__", None) or "/").resolve()
    if path.is_relative_to(REPO):
        return "repo"
    extra = [Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return "site" if any(path.is_relative_to(p) for p in extra) else "image"


def _check_plugins() -> list[str]:
    try:
        from rlctl.hooks.manager import load_plugins

        names = load_plugins().names("learner_backend")
    except Exception as err:  # noqa: BLE001
        return [f"rlctl plugins: {type(err).__name__}: {err} (is rlctl installed into SITE? run prepare.py install)"]
    if "fsdp2" not in names:
        return [f"rlctl plugins: no fsdp2 learner among {sorted(names)}: rlctl's entry points are not installed"]
    return []


def choose(core: list[Requirement], bench: list[Requirement], wheels: dict[str, Wheel],
           installed: Callable[[str], Version | None] = image_version) -> Plan:
    """The plan for core and bench together if it holds, else the core plan (the TRL step is then left out);
    a core requirement nobody meets raises."""
    alone, full = plan(core, wheels, installed), plan(core + bench, wheels, installed)
    chosen = full if not full.problems else alone
    print_plan(chosen)
    if alone.problems:
        empty = [] if wheels else [".whl/ holds no wheels: run `bash scripts/gpu_wheels.sh` here and carry .whl"]
        raise PrepareError("\n".join(["requirements neither the image nor .whl/ meets:", *alone.problems, *empty]))
    for line in full.problems:
        print(f"prepare.py: TRL left out ({OPTIONAL_STEP} will fail): {line}", file=sys.stderr)
    return chosen


def cuda_device() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} sees none (torch.cuda.is_available() is False); "
              "tests/gpu/run.sh needs one CUDA GPU")
        return 3
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("verb", choices=("plan", "install", "check", "cuda"))
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="Folder of wheels (scripts/gpu_wheels.sh).")
    p.add_argument("--site", type=Path, help="Target folder for install (then PYTHONPATH=REPO:REPO/plugins:SITE).")
    args = p.parse_args(argv)
    if args.verb == "cuda":
        return cuda_device()
    try:
        if args.verb == "check":
            failures, warnings = check_imports()
            for line in warnings:
                print(f"import check: {OPTIONAL_STEP} will fail: {line}", file=sys.stderr)
            for line in failures:
                print(f"import check failed: {line}", file=sys.stderr)
            return 2 if failures else 0
        chosen = choose(*rlctl_requirements(), read_wheels(args.wheels))
        if args.verb == "install":
            if args.site is None:
                raise PrepareError("install needs --site DIR")
            install(chosen, args.site)
            print(f"installed {len(chosen.wheels)} wheels and rlctl (editable) into {args.site}")
    except PrepareError as err:
        print(f"prepare.py {args.verb}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
