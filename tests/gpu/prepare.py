"""Get the GPU machine's own python ready for tests/gpu/run.sh, where nothing can be fetched.

What this is: the first step of run.sh, run with the machine's python (``PY``), in three verbs:
  plan     which of rlctl's requirements (pyproject's dependencies and bench extra, plus the test runner)
           the image meets and which come from a wheel in ``.whl/`` (scripts/gpu_wheels.sh fills it). A wheel
           is taken only where the image lacks the package or its version is outside rlctl's range, and the
           wheels taken have their own requirements checked the same way. A requirement that neither the
           image nor a wheel meets fails here, in seconds, naming it and the fix;
  install  ``plan``, then ``pip install --no-index --no-deps --target SITE`` of those wheels and of rlctl
           itself (editable, so its ``rlctl`` entry points, which load the built-in plugins, are there),
           for ``PYTHONPATH=REPO:REPO/plugins:SITE``;
  check    imports every module the run needs under that PYTHONPATH, prints a table of versions and where
           each came from, and fails naming each module that does not import and the step that needs it.
What this is not: a dependency resolver (one pinned wheel per name, chosen by scripts/gpu_wheels.sh), nor a
way to set up a developer's venv (README's pip install).
"""

from __future__ import annotations

import argparse
import email.parser
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("bench",)  # TRL's GRPOTrainer for run.sh's step-time comparison
TEST_RUNNER = ("pytest>=8", "hypothesis>=6.100")  # the image's own; the dev extra's exact pins are for venvs
OPTIONAL = {"ray": "the Ray-actor GPU test skips without it (its 76 MiB wheel does not travel)"}

# module to import, its distribution, the run.sh step that needs it
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
    ("sympy", "sympy", "every step (math rewards)"),
    ("matplotlib", "matplotlib", "rlctl.ops plots"),
    ("pytest", "pytest", "gpu tests"),
    ("hypothesis", "hypothesis", "gpu tests (tests.unit helpers)"),
    ("accelerate", "accelerate", "TRL step time"),
    ("datasets", "datasets", "TRL step time"),
    ("trl", "trl", "TRL step time"),
    ("rlctl.cli.app", "rlctl", "quickstart"),
    ("rlctl_fsdp_learner.learner", "rlctl", "gpu tests, fsdp ledger"),
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


def rlctl_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in EXTRAS:
        specs += project["optional-dependencies"][extra]
    return [Requirement(s) for s in (*specs, *TEST_RUNNER)]


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
        spec = ",".join(sorted({str(r.specifier) for r, _ in reqs if str(r.specifier)})) or "any"
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
    print(f"{'distribution':<22}{'rlctl needs':<26}{'version':<12}source")
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


def check_imports(imports: tuple[tuple[str, str, str], ...] = IMPORTS) -> list[str]:
    """Import each module; print its distribution's version and folder; return one line per failure."""
    import importlib

    failures = []
    print(f"{'module':<30}{'version':<16}{'from':<48}needed by")
    for module, dist, step in imports:
        try:
            mod = importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure is the finding
            missing = getattr(err, "name", None) or module
            failures.append(f"{module}: {type(err).__name__}: {err} (missing: {missing}; needed by {step})")
            print(f"{module:<30}{'FAILED':<16}{missing:<48}{step}")
            continue
        where = str(Path(getattr(mod, "__file__", None) or "?").parent)
        print(f"{module:<30}{str(image_version(dist) or '?'):<16}{where[-47:]:<48}{step}")
    return failures + _check_plugins()


def _check_plugins() -> list[str]:
    try:
        from rlctl.hooks.manager import load_plugins

        names = load_plugins().names("learner_backend")
    except Exception as err:  # noqa: BLE001
        return [f"rlctl plugins: {type(err).__name__}: {err} (is rlctl installed into SITE? run prepare.py install)"]
    if "fsdp2" not in names:
        return [f"rlctl plugins: no fsdp2 learner among {sorted(names)}: rlctl's entry points are not installed"]
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("verb", choices=("plan", "install", "check"))
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="Folder of wheels (scripts/gpu_wheels.sh).")
    p.add_argument("--site", type=Path, help="Target folder for install (then PYTHONPATH=REPO:REPO/plugins:SITE).")
    args = p.parse_args(argv)
    try:
        if args.verb == "check":
            failures = check_imports()
            for line in failures:
                print(f"import check failed: {line}", file=sys.stderr)
            return 2 if failures else 0
        result = plan(rlctl_requirements(), read_wheels(args.wheels))
        print_plan(result)
        if result.problems:
            raise PrepareError("\n".join(["requirements neither the image nor .whl/ meets:", *result.problems]))
        if args.verb == "install":
            if args.site is None:
                raise PrepareError("install needs --site DIR")
            install(result, args.site)
            print(f"installed {len(result.wheels)} wheels and rlctl (editable) into {args.site}")
    except PrepareError as err:
        print(f"prepare.py {args.verb}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
