"""Which rlctl package imports which, read from the source: a picture, the import cycles, the layer check.

What this is: a reader of ``rlctl/`` (and ``plugins/``) with ``ast``; no module is imported or run. It
builds the module-level import graph of the ``rlctl`` package, folds it to packages (``rlctl/<pkg>/``;
``rlctl/__init__.py``, the public API, is the package ``rlctl``), and reports:

- every import cycle between modules and between packages (an import inside a function body is a
  *lazy* edge and an import under ``if TYPE_CHECKING:`` a *typing* edge; both are still arrows of the
  design, so they count, marked as such);
- every arrow that breaks the declared layer order ``LAYERS`` below: a package may import packages in
  lower tiers only; packages of one tier must not import each other; a package missing from ``LAYERS``
  is a problem too;
- which rlctl packages each plugin under ``plugins/`` imports (information: plugins are meant to import
  only ``rlctl``, ``rlctl.kit`` and ``rlctl.contracts``).

``LAYERS`` is the only thing written here by hand: every other name comes from the files.

    python scripts/architecture_graph.py                      # the Markdown section (picture + problems)
    python scripts/architecture_graph.py --check              # exit 1 when there are problems
    python scripts/architecture_graph.py --write docs/architecture.md   # refresh its generated section
    python scripts/architecture_graph.py --check-doc docs/architecture.md  # exit 1 when that is stale

    python scripts/architecture_graph.py --plugins            # plugin imports outside PLUGIN_MAY_IMPORT

Tests call ``problems()`` and ``plugin_problems()`` (lists of one-line strings) and ``doc_is_current(path)``.

What this is not: a checker of what a module does at run time (``importlib`` calls and entry-point
strings are not followed), and a package-level import implies nothing about which names are used.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]

# The floors, lowest first. A package may import any package on a lower tier; packages on one tier are
# peers and must not import each other (to allow it, give them tiers of their own). ``kit`` is the public plugin kit: on top, so no core package
# may import it; plugins import it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("contracts",),
    ("config",),
    ("hooks",),
    ("rlctl",),  # rlctl/__init__.py: the public API (hookimpl, contract types, errors)
    ("algo", "storage"),
    ("models",),
    ("engine", "registry"),
    ("placement", "serve"),
    ("incidents",),
    ("lifecycle",),
    ("planning",),
    ("cli",),
    ("kit",),
)

# What a plugin may import from rlctl (the module itself, or anything below these); a plugin never imports
# another plugin.
PLUGIN_MAY_IMPORT = ("rlctl", "rlctl.kit", "rlctl.contracts")

BEGIN = "<!-- architecture_graph.py: generated from here; edit the script, not this section -->"
END = "<!-- architecture_graph.py: generated up to here -->"
KINDS = ("top", "lazy", "typing")  # module level / inside a function / under `if TYPE_CHECKING:`


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted (rlctl.engine.loop)
    target: str  # imported module, dotted
    kind: str  # one of KINDS
    where: str  # path:line of the import statement


def module_name(path: Path, root: Path) -> str:
    """``rlctl/engine/loop.py`` -> ``rlctl.engine.loop``; ``rlctl/engine/__init__.py`` -> ``rlctl.engine``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str, top: str = "rlctl") -> str:
    """``rlctl.engine.transports.disk`` -> ``engine``; ``rlctl`` itself -> ``rlctl``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == top else parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with its kind, walking into functions, classes and ``if`` blocks."""

    def walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "lazy" if kind == "top" else kind)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, "top")


def _targets(stmt: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules one import statement names (``from a import b`` names ``a.b`` when that is a module)."""
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    base = stmt.module or ""
    if stmt.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (stmt.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    out = []
    for alias in stmt.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in known else base)
    return out


def _nearest_known(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def scan(root: Path, top: str = "rlctl") -> tuple[set[str], list[Edge]]:
    """All modules under ``root`` (the ``rlctl`` folder) and every import edge between them."""
    paths = sorted(root.rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    edges = [edge for path in paths for edge in _edges_of(path, module_name(path, root), known, top)]
    return known, edges


def _edges_of(path: Path, module: str, known: set[str], top: str) -> Iterator[Edge]:
    """The edges from one file into ``top``'s modules (``known``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for stmt, kind in _imports(tree):
        for target in _targets(stmt, module, path.name == "__init__.py", known):
            if target != top and not target.startswith(top + "."):
                continue
            hit = _nearest_known(target, known)
            if hit is not None and hit != module:
                yield Edge(module, hit, kind, f"{_rel(path)}:{stmt.lineno}")


def _plugin_module(path: Path, plugins_root: Path) -> str:
    """``plugins/rlctl_faults/kinds.py`` -> ``rlctl_faults.kinds`` (plugins are packages under plugins/)."""
    parts = list(path.relative_to(plugins_root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def package_edges(edges: Iterable[Edge]) -> dict[tuple[str, str], dict[str, list[Edge]]]:
    """(source package, target package) -> kind -> the module edges behind it (self-loops dropped)."""
    out: dict[tuple[str, str], dict[str, list[Edge]]] = defaultdict(lambda: defaultdict(list))
    for edge in edges:
        a, b = package_of(edge.source), package_of(edge.target)
        if a != b:
            out[(a, b)][edge.kind].append(edge)
    return out


def cycles(nodes: Iterable[str], arrows: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(set(nodes) | set(graph)):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def tier_of(package: str, layers: Sequence[Sequence[str]] = LAYERS) -> int | None:
    return next((i for i, tier in enumerate(layers) if package in tier), None)


def _cycle_through(start: str, members: set[str], arrows: dict[str, set[str]]) -> list[str]:
    """A shortest closed walk from ``start`` back to it inside one strongly connected component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(arrows.get(node, ())):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child in members and child not in previous:
                previous[child] = node
                frontier.append(child)
    raise ValueError(f"{start} is on no cycle")


def _cycle_walks(component: list[str], arrows: dict[str, set[str]]) -> list[list[str]]:
    """Closed walks that together pass through every member of a strongly connected component."""
    walks: list[list[str]] = []
    covered: set[str] = set()
    for node in component:
        if node not in covered:
            walk = _cycle_through(node, set(component), arrows)
            walks.append(walk)
            covered.update(walk)
    return walks


def _order(edge: Edge) -> tuple[int, str, int]:
    """Module-level imports first, then by file and line."""
    path, _, line = edge.where.rpartition(":")
    return KINDS.index(edge.kind), path, int(line)


def _kinds_label(by_kind: dict[str, list[Edge]]) -> str:
    return "/".join(k for k in KINDS if by_kind.get(k))


def problems(root: Path = REPO / "rlctl", layers: Sequence[Sequence[str]] = LAYERS) -> list[str]:
    """Every import cycle (modules, packages) and every arrow against ``layers``, one line each."""
    modules, edges = scan(root)
    out: list[str] = []
    module_arrows: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        module_arrows[edge.source].add(edge.target)
    for component in cycles(modules, ((e.source, e.target) for e in edges)):
        for walk in _cycle_walks(component, module_arrows):
            steps = []
            for a, b in zip(walk, walk[1:]):
                hit = min((e for e in edges if e.source == a and e.target == b), key=_order)
                steps.append(f"{a} -> {b} ({hit.kind}, {hit.where})")
            out.append(f"module cycle: {'; '.join(steps)}")
    by_package = package_edges(edges)
    package_arrows: dict[str, set[str]] = defaultdict(set)
    for a, b in by_package:
        package_arrows[a].add(b)
    packages = {package_of(m) for m in modules}
    for component in cycles(packages, by_package):
        walks = "; ".join(" -> ".join(walk) for walk in _cycle_walks(component, package_arrows))
        out.append(f"package cycle among {', '.join(component)}: {walks}")
    for package in sorted(packages):
        if tier_of(package, layers) is None:
            out.append(f"package {package} is not in LAYERS (scripts/architecture_graph.py): give it a floor")
    for (a, b), by_kind in sorted(by_package.items()):
        ta, tb = tier_of(a, layers), tier_of(b, layers)
        if ta is None or tb is None or ta > tb:
            continue
        first = min((e for kind in KINDS for e in by_kind.get(kind, [])), key=_order)
        how = "upward" if ta < tb else "sideways (same floor)"
        count = sum(len(v) for v in by_kind.values())
        out.append(f"{how} import: {a} -> {b} ({_kinds_label(by_kind)}; {count} import(s), first "
                   f"{first.source} -> {first.target} at {first.where})")
    return out


def plugin_imports(plugins_root: Path = REPO / "plugins", root: Path = REPO / "rlctl") -> dict[str, dict[str, int]]:
    """plugin package -> rlctl package it imports -> number of import statements (plugins' own files only)."""
    known, _ = scan(root)
    edges = [edge for path in sorted(plugins_root.glob("*/**/*.py"))
             for edge in _edges_of(path, _plugin_module(path, plugins_root), known, "rlctl")]
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for edge in edges:
        out[edge.source.split(".")[0]][package_of(edge.target)] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def plugin_problems(plugins_root: Path = REPO / "plugins", root: Path = REPO / "rlctl",
                    allowed: Sequence[str] = PLUGIN_MAY_IMPORT) -> list[str]:
    """Every import in a plugin of an rlctl module outside ``allowed``, or of another plugin, one line each."""
    known, _ = scan(root)
    plugins = {p.name for p in plugins_root.iterdir() if (p / "__init__.py").is_file()}
    out = []
    for path in sorted(plugins_root.glob("*/**/*.py")):
        own = path.relative_to(plugins_root).parts[0]
        module = _plugin_module(path, plugins_root)
        for stmt, kind in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            for target in dict.fromkeys(_targets(stmt, module, path.name == "__init__.py", known)):
                head = target.split(".")[0]
                inside = target in allowed or target.startswith(tuple(f"{a}." for a in allowed if a != "rlctl"))
                if (head == "rlctl" and not inside) or (head in plugins and head != own):
                    out.append(f"{_rel(path)}:{stmt.lineno}: {own} imports {target} ({kind})")
    return out


def _mermaid_id(package: str) -> str:
    return f"pkg_{package}"


def render_markdown(root: Path = REPO / "rlctl", layers: Sequence[Sequence[str]] = LAYERS) -> str:
    """The generated section of docs/architecture.md: floors table, mermaid picture, plugin imports, problems."""
    modules, edges = scan(root)
    by_package = package_edges(edges)
    packages = sorted({package_of(m) for m in modules}, key=lambda p: (tier_of(p, layers) is None,
                                                                      tier_of(p, layers) or 0, p))
    lines = ["Generated by `python scripts/architecture_graph.py --write docs/architecture.md` from the "
             "code (ast; nothing is imported). Floors are the script's `LAYERS`, lowest first; "
             "*lazy* = only inside functions, *typing* = only under `if TYPE_CHECKING:`.", "",
             "| floor | package | modules | imports (module level) | imports (lazy / typing only) |",
             "|---|---|---|---|---|"]
    for package in packages:
        tier = tier_of(package, layers)
        top = sorted(b for (a, b), kinds in by_package.items() if a == package and kinds.get("top"))
        rest = sorted(f"{b} ({_kinds_label(kinds)})" for (a, b), kinds in by_package.items()
                      if a == package and not kinds.get("top"))
        count = sum(1 for m in modules if package_of(m) == package)
        lines.append(f"| {'?' if tier is None else tier} | `{package}` | {count} | {', '.join(top) or '-'} | "
                     f"{', '.join(rest) or '-'} |")
    lines += ["", "Solid arrows: imported at module level; dotted: only inside functions or for typing; "
              "red: against the floors.", "", "```mermaid", "graph BT"]
    for package in packages:
        lines.append(f"    {_mermaid_id(package)}[{package}]")
    bad: list[int] = []
    for number, ((a, b), kinds) in enumerate(sorted(by_package.items())):
        ta, tb = tier_of(a, layers), tier_of(b, layers)
        lines.append(f"    {_mermaid_id(a)} {'-->' if kinds.get('top') else '-.->'} {_mermaid_id(b)}")
        if ta is None or tb is None or ta <= tb:
            bad.append(number)
    if bad:
        lines.append(f"    linkStyle {','.join(map(str, bad))} stroke:red")
    lines += ["```", "", "Plugins' imports of rlctl packages (import statements per package):", "",
              "| plugin | imports |", "|---|---|"]
    for plugin, used in plugin_imports(root=root).items():
        lines.append(f"| `{plugin}` | " + ", ".join(f"{p} ({n})" for p, n in sorted(used.items())) + " |")
    found = problems(root, layers)
    lines += ["", f"Problems found ({len(found)}):", ""]
    lines += [f"- {p}" for p in found] or ["- none"]
    return "\n".join(lines) + "\n"


def with_generated(text: str, generated: str) -> str:
    """``text`` with the part between the BEGIN and END markers replaced by ``generated``."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"the document lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n{generated}{END}{tail}"


def doc_is_current(path: Path, root: Path = REPO / "rlctl") -> bool:
    text = path.read_text(encoding="utf-8")
    return with_generated(text, render_markdown(root)) == text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO / "rlctl", help="The rlctl package folder.")
    parser.add_argument("--check", action="store_true", help="Exit 1 if there are cycles or layer violations.")
    parser.add_argument("--plugins", action="store_true", help="List plugin imports outside PLUGIN_MAY_IMPORT "
                        "or of another plugin; exit 1 if there are any.")
    parser.add_argument("--write", type=Path, metavar="DOC", help="Refresh DOC's generated section.")
    parser.add_argument("--check-doc", type=Path, metavar="DOC", help="Exit 1 if DOC's generated section is stale.")
    args = parser.parse_args(argv)
    if args.write:
        args.write.write_text(with_generated(args.write.read_text(encoding="utf-8"), render_markdown(args.root)),
                              encoding="utf-8")
        return 0
    if args.check_doc:
        if doc_is_current(args.check_doc, args.root):
            return 0
        print(f"{args.check_doc} is stale: run python scripts/architecture_graph.py --write {args.check_doc}",
              file=sys.stderr)
        return 1
    if args.plugins:
        found = plugin_problems(root=args.root)
        print("\n".join(found) if found else "plugins import only " + ", ".join(PLUGIN_MAY_IMPORT))
        return 1 if found else 0
    if args.check:
        found = problems(args.root)
        print("\n".join(found) if found else "no cycles, no imports against the floors")
        return 1 if found else 0
    print(render_markdown(args.root), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
