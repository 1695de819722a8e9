"""Every ``rlctl ...`` command and every config key the docs quote still exists, as quoted.

What this checks: README.md, docs/*.md and runbooks/*.md. A command is a line of a shell code
block (fenced, or indented four spaces), an inline code span, or a runbook's ``checks:`` entry that
runs ``rlctl`` (after ``VAR=value``, ``nice``, ``taskset``, ``time`` or ``.venv/bin/``). Each is
parsed by the real CLI (click's ``make_context``: nothing runs): the command and subcommand exist,
every option is known and takes the values given, there are no extra arguments; its overrides and
``--axis`` keys name real config keys; a config path it names exists. Placeholders are written in
capitals (``RUN``, ``CONFIG``, ``DIR``), braces or angle brackets, and ``[...]`` marks optional
parts. A config key quoted on its own in a code span (``algo.name``, ``faults.watchdog_timeout_s: 5``),
or named anywhere in a runbook, must exist too, and every relative link must point at a file. Failures
name file:line.

What this is not: a check that a command succeeds, or of plugin options below ``*.options``.
"""

from __future__ import annotations

import difflib
import re
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel

try:  # recent typer carries its own copy of click as typer._click; older typer uses click itself
    from typer._click import core as click_core, exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import core as click_core, exceptions as click_errors

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "runbooks").glob("*.md")])
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
WRAPPERS = {"time", "/usr/bin/time", "nice", "taskset", "sudo", "exec"}
PLACEHOLDER_KEYS = {"k", "key", "key.path", "a.b.c"}


@dataclass(frozen=True)
class Quote:
    where: str  # path:line
    text: str


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _inline_spans(text: str, first_line: int) -> list[tuple[int, str]]:
    """Code spans (`x` or ``x``) of a paragraph, with the line each starts on."""
    out = []
    for match in re.finditer(r"(`+)(.+?)\1", text, flags=re.S):
        out.append((first_line + text.count("\n", 0, match.start()), " ".join(match.group(2).split())))
    return out


def quotes(path: Path) -> tuple[list[Quote], list[Quote]]:
    """(shell lines from code blocks and runbook checks, inline code spans) of one Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    shell: list[Quote] = []
    spans: list[Quote] = []
    fence: str | None = None
    lang = ""
    paragraph: list[tuple[int, str]] = []
    in_front_matter = path.parent.name == "runbooks" and lines[:1] == ["---"]

    def flush() -> None:
        if paragraph:
            for number, span in _inline_spans("\n".join(t for _, t in paragraph), paragraph[0][0]):
                spans.append(Quote(f"{_rel(path)}:{number}", span))
            paragraph.clear()

    pending, pending_from = "", 0
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if in_front_matter:
            if number > 1 and stripped == "---":
                in_front_matter = False
            elif stripped.startswith("- rlctl "):
                shell.append(Quote(f"{_rel(path)}:{number}", stripped[2:]))
            else:
                paragraph.append((number, line))
            continue
        if stripped.startswith("```"):
            flush()
            if fence is None:
                fence, lang = stripped[:3], stripped[3:].strip().lower()
            else:
                fence = None
            continue
        indented = line.startswith("    ") and (bool(pending) or not stripped.startswith(("- ", "* ")))
        code = (fence is not None and lang in SHELL_LANGS) or (fence is None and indented)
        if fence is not None and not code:
            continue
        if code:
            flush()
            joined, first = pending + stripped, pending_from or number
            if joined.endswith("\\"):
                pending, pending_from = joined[:-1] + " ", first
                continue
            pending, pending_from = "", 0
            shell.append(Quote(f"{_rel(path)}:{first}", joined))
            continue
        if pending:  # a continued line whose block ended
            shell.append(Quote(f"{_rel(path)}:{pending_from}", pending))
            pending, pending_from = "", 0
        if not stripped:
            flush()
        else:
            paragraph.append((number, line))
    flush()
    return shell, spans


def rlctl_argv(text: str) -> list[str] | None:
    """The arguments after ``rlctl`` in one shell line, or None when the line does not run rlctl."""
    text = text.replace("…", " ... ")  # `rlctl train … > log.txt`: an elided part
    for segment in re.split(r"&&|\|\||;|\s\|\s", text):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError:
            words = segment.split()
        for i, word in enumerate(words):
            if word == "rlctl" or word.endswith("/rlctl"):
                before = words[:i]
                if all("=" in w or w in WRAPPERS or w.startswith("-") or w.isdigit() for w in before):
                    return _clean(words[i + 1:])
                break
            if not ("=" in word or word in WRAPPERS or word.startswith("-") or word.isdigit()):
                break
    return None


def _clean(words: list[str]) -> list[str]:
    out = []
    for word in words:
        if word in ("<", "|") or word.startswith((">", "2>")):
            break  # a redirect or a pipe ends the command (`<run-id>` is a placeholder, not a redirect)
        word = word.replace("[", "").replace("]", "") if not re.search(r"=\S*\[", word) else word
        if word:
            out.append(word)
    return out


def is_placeholder(word: str) -> bool:
    """``RUN``, ``CONFIG|RUN``, ``{run}``, ``<run-id>``, ``...``: a value the reader fills in."""
    return (bool(re.fullmatch(r"[A-Z][A-Z0-9_]*([|/][A-Z][A-Z0-9_]*)*", word)) or any(c in word for c in "{<")
            or word in ("...", "…"))


@pytest.fixture(scope="module")
def cli() -> typing.Any:
    import typer

    from rlctl.cli.app import build_app

    return typer.main.get_command(build_app())


def _is_group(cmd: typing.Any) -> bool:
    return hasattr(cmd, "get_command") and hasattr(cmd, "list_commands")


def _resolve(cli: typing.Any, argv: list[str]) -> tuple[list[str], typing.Any, list[str]]:
    """(command path, command, its arguments); raises UsageError for an unknown command or group option."""
    cmd = cli
    path: list[str] = []
    args = list(argv)
    while _is_group(cmd) and args:
        ctx = click_core.Context(cmd)
        if is_placeholder(args[0]) or args[0] == "--help":
            return path, None, []  # `rlctl COMMAND --help`, `rlctl --help`
        if args[0].startswith("-"):
            if args[0] not in {o for p in cmd.params for o in getattr(p, "opts", ())}:
                raise click_errors.UsageError(f"no option {args[0]} on `{' '.join(['rlctl', *path])}`")
            if len(args) == 1 or cmd.get_command(ctx, args[1]) is None:
                break  # the group's own options (e.g. `rlctl plugins --json`)
            args = args[1:]
            continue
        sub = cmd.get_command(ctx, args[0])
        if sub is None:
            close = difflib.get_close_matches(args[0], cmd.list_commands(ctx), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise click_errors.UsageError(f"no command `{' '.join(['rlctl', *path, args[0]])}`{hint}")
        path.append(args[0])
        cmd, args = sub, args[1:]
    return path, cmd, args


def _make_context(cmd: typing.Any, name: str, args: list[str]) -> typing.Any:
    """``cmd.make_context``; a placeholder given to a typed option (``--at-step N``) is retried as 1."""
    args = list(args)
    while True:
        try:
            return cmd.make_context(name, list(args))
        except click_errors.BadParameter as err:
            if type(err) is not click_errors.BadParameter:
                raise  # e.g. MissingParameter
            opts = set(getattr(err.param, "opts", ()))
            spot = next((i for i, a in enumerate(args) if i and is_placeholder(a) and args[i - 1] in opts), None)
            if spot is None:
                raise
            args[spot] = "1"


def config_key_problem(key: str) -> str | None:
    """Why ``key`` (a.b.c) is not a key of the run config, or None when it is."""
    from rlctl.config.models import RunConfig

    node: typing.Any = RunConfig
    parts = key.split(".")
    for depth, part in enumerate(parts):
        fields = node.model_fields
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f"; did you mean {'.'.join([*parts[:depth], close[0]])}?" if close else ""
            return f"unknown config key {'.'.join(parts[:depth + 1])}{hint}"
        annotation = fields[part].annotation
        model = _model_of(annotation)
        if model is None:
            if depth < len(parts) - 1 and not _is_mapping(annotation):
                return f"{'.'.join(parts[:depth + 1])} is a value, not a section"
            return None  # a leaf, or a free-form mapping (plugin options)
        node = model
    return None


def _model_of(annotation: typing.Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if typing.get_origin(annotation) is list:
            return None  # a list of sections is set whole
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _is_mapping(annotation: typing.Any) -> bool:
    return annotation is dict or typing.get_origin(annotation) in (dict, typing.Mapping) or any(
        _is_mapping(a) for a in typing.get_args(annotation))


def command_problem(cli: typing.Any, argv: list[str]) -> str | None:
    """Why ``rlctl ARGV`` would not parse, or None."""
    try:
        path, cmd, args = _resolve(cli, argv)
    except click_errors.UsageError as err:
        return err.format_message()
    if not args or "--help" in args:
        return None  # a reference to the command itself (`rlctl drill`), or its help
    try:
        ctx = _make_context(cmd, f"rlctl {' '.join(path)}", args)
    except click_errors.NoArgsIsHelpError:
        return None
    except click_errors.UsageError as err:
        return err.format_message()
    for item in [*(ctx.params.get("overrides") or []), *(ctx.params.get("axis") or [])]:
        key, sep, _ = item.partition("=")
        if not sep and not is_placeholder(item):
            return f"{item!r} is not key=value (overrides follow the config)"
        if key in PLACEHOLDER_KEYS or is_placeholder(key) or is_placeholder(item):
            continue
        problem = config_key_problem(key)
        if problem:
            return problem
    config = ctx.params.get("config") or ctx.params.get("target")
    if config is not None and str(config).endswith((".yaml", ".yml")) and not (REPO / str(config)).is_file():
        return f"config file {config} does not exist"
    return None


def _all_commands() -> list[tuple[Quote, list[str]]]:
    out = []
    for path in DOCS:
        shell, spans = quotes(path)
        for quote in [*shell, *spans]:
            argv = rlctl_argv(quote.text)
            if argv is not None:
                out.append((quote, argv))
    return out


def test_the_docs_quote_commands_at_all():
    commands = _all_commands()
    files = {q.where.split(":")[0] for q, _ in commands}
    assert len(commands) > 100 and {"README.md", "docs/faults.md", "runbooks/oom.md"} <= files


def test_every_quoted_command_parses(cli):
    stale = [f"{quote.where}: `{quote.text}`: {problem}" for quote, argv in _all_commands()
             if (problem := command_problem(cli, argv)) is not None]
    assert stale == [], "stale commands in the docs:\n" + "\n".join(stale)


def _fault_sites() -> set[str]:
    """Fault-site names (``rollout.generate``), which look like config keys but are not."""
    found = set()
    for source in [*(REPO / "rlctl").rglob("*.py"), *(REPO / "plugins").rglob("*.py")]:
        found.update(re.findall(r"fault_site\(\s*\"([a-z_.]+)\"", source.read_text(encoding="utf-8")))
    return found


def test_every_quoted_config_key_exists():
    from rlctl.config.models import RunConfig

    sections = "|".join(RunConfig.model_fields)
    alone = re.compile(rf"((?:{sections})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?:\s*[=:].*)?")
    anywhere = re.compile(rf"(?<![\w/.`-])((?:{sections})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?![\w(/-])")
    sites = _fault_sites()
    stale = []
    for path in DOCS:
        _, spans = quotes(path)
        keys = [(q.where, m.group(1)) for q in spans if (m := alone.fullmatch(q.text))]
        if path.parent.name == "runbooks":
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                keys += [(f"{_rel(path)}:{number}", m.group(1)) for m in anywhere.finditer(line)]
        for where, key in keys:
            if key in sites or re.search(r"\.(py|md|yaml|json|jsonl|db|png|html|safetensors)$", key):
                continue
            problem = config_key_problem(key)
            if problem:
                stale.append(f"{where}: {key}: {problem}")
    assert stale == [], "config keys the docs name that do not exist:\n" + "\n".join(sorted(set(stale)))


@pytest.mark.parametrize("argv, needle", [
    (["trian", "configs/quickstart.yaml"], "did you mean 'train'"),
    (["train", "configs/quickstart.yaml", "--sedes", "3"], "--sedes"),
    (["train", "configs/quickstart.yaml", "algo.grup_size=4"], "algo.group_size"),
    (["ablate", "configs/quickstart.yaml", "--axis", "algo.name=grpo", "--set", "train.steps=2"], None),
    (["resume", "RUN", "faults.oom_min_micro_batch=1"], "faults.oom_min_micro_batch"),
    (["train", "configs/nosuch.yaml"], "does not exist"),
    (["runs", "show", "RUN", "OTHER"], "unexpected extra argument"),
    (["inject", "--run", "RUN"], "Missing option '--fault'"),
    (["export", "--hf"], "requires an argument"),
    (["inject", "--fault", "nan", "--at-step", "three", "--run", "RUN"], "--at-step"),
])
def test_a_stale_command_is_caught(cli, argv, needle):
    problem = command_problem(cli, argv)
    if needle is None:  # --set is accepted by the parser (hidden) and refused by the command with the fix
        assert problem is None
    else:
        assert problem is not None and needle in problem, problem


def test_placeholders_and_optional_parts_are_understood(cli):
    for text in ["rlctl eval RUN [RUN ...] [--group G] [--split hidden] [--json]",
                 "OMP_NUM_THREADS=1 nice -n 10 rlctl drill --json", "rlctl inject --fault nan --at-step N --run RUN",
                 ".venv/bin/rlctl train configs/quickstart.yaml > log.txt", "rlctl runs show {run}",
                 "rlctl ablate CONFIG --axis KEY=v1,v2 [--axis ...] --seeds 3 [--budget-tokens N]",
                 "rlctl train … > log.txt", "rlctl runs show <run-id> --json"]:
        argv = rlctl_argv(text)
        assert argv is not None and command_problem(cli, argv) is None, (text, argv, command_problem(cli, argv))
    assert rlctl_argv("python scripts/sweep_quickstart.py --grid ppo") is None


def test_every_relative_link_points_at_a_file():
    broken = []
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line):
                if not re.match(r"[a-z]+://", target) and not (path.parent / target).exists():
                    broken.append(f"{_rel(path)}:{number}: {target}")
    assert broken == [], "broken links:\n" + "\n".join(broken)
