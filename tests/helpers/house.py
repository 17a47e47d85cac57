"""The house: asyncflat's modules, their imports and the folders' declared layering, read with ``ast``.

Shared by ``tests/test_structure.py`` (the rules of the house) and the figure in ``docs/design.md``
(section "The house"), so that the picture and the checks see the same graph. Nothing here
imports asyncflat.

Run ``python3 tests/helpers/house.py`` to rewrite the figure after a change of imports, or
``python3 tests/helpers/house.py --check`` to only compare (exit status 1 when it is stale).

**What counts as an import**: every ``import`` and ``from ... import`` statement anywhere in a
module (top level, inside functions, under ``if TYPE_CHECKING:``), relative or absolute, plus the
targets of ``importlib.import_module``: a literal string, or, when the argument is computed, the
module paths written as values of that module's top-level dicts (how the lazy ``__getattr__``
of a package's face names its homes). ``from package import name`` is an import of
``package.name`` when that is a module, else of ``package``. Importing ``a.b.c`` is an edge to
``a.b.c`` only, not to the packages above it (Python runs their ``__init__`` first, but they are
not what the importer depends on).

**The declared layering** (the one place it is written): every package's ``__init__.py``, and every
root module but the package's face and ``__main__``, has in its docstring one paragraph of the
form::

    May import: ``engine``, ``source``, ``storage.guarded`` and ``errors``; free prose after.

The list runs from ``May import:`` to the first ``;``, ``:`` or ``.`` outside double backticks, and is
made only of double-backticked names joined by ``,``, ``and`` or ``, and``. A name is a module or
package below ``asyncflat`` (``engine``, ``engine.loop``, ``loader.mixture.config``, ``config``);
``*`` allows anything; the word ``nothing`` (no backticks) allows nothing. An import that leaves
a package (a module of another folder, or a root module) must be equal to or below one of its
names, for every package that contains the importing module (so a subfolder is held to its own
line and to its folder's). A root module's line holds for its own imports.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
ROOT = "asyncflat"
PACKAGE = REPO / ROOT
DESIGN = REPO / "docs" / "design.md"

#: The package's face and its ``python -m`` entry point sit above every folder; they declare no line.
UNDECLARED = frozenset({ROOT, f"{ROOT}.__main__"})


@dataclasses.dataclass(frozen=True)
class Module:
    name: str  # dotted, "asyncflat.engine.core"; a package is its __init__: "asyncflat.engine"
    path: Path
    is_package: bool
    tree: ast.Module = dataclasses.field(compare=False, repr=False)

    @property
    def package(self) -> str:
        """The package this module's relative imports start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]

    @property
    def where(self) -> str:
        return str(self.path.relative_to(REPO))


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (resolved; may name no module when the import is broken)
    names: tuple[str, ...]  # the names taken by ``from target import ...``; () for the others
    line: int
    kind: str  # "top" (module level), "function", "type_checking" or "dynamic"
    where: str  # "path:line"


@functools.cache
def modules() -> dict[str, Module]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found[name] = Module(name, path, is_package, tree)
    return found


def folder_of(name: str) -> str:
    """The top unit a module belongs to: its folder below asyncflat, a root module, or the face."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def enclosing_packages(name: str) -> list[str]:
    """The packages below the root that contain module ``name`` (outermost first)."""
    parts = name.split(".")
    found = (".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return [p for p in found if p in modules() and modules()[p].is_package]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, kind: str) -> Iterator[tuple[ast.AST, str]]:
    """Every node under ``node`` with where it runs: at import, in a function, or for types only."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            here = "function" if kind == "top" else kind
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            yield child, kind
            for part in child.body:
                yield part, "type_checking"
                yield from _walk(part, "type_checking")
            for part in child.orelse:
                yield part, kind
                yield from _walk(part, kind)
            continue
        else:
            here = kind
        yield child, here
        yield from _walk(child, here)


def _absolute(module: Module, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _dynamic_targets(module: Module, call: ast.Call) -> list[str]:
    """What an ``importlib.import_module(...)`` call can import (see the module docstring)."""
    if not call.args:
        return []
    arg = call.args[0]
    package = module.package if len(call.args) > 1 or call.keywords else ""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [_resolve_text(module, arg.value, package)]
    candidates: list[str] = []
    for node in module.tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if not isinstance(value, ast.Dict):
            continue
        for item in value.values:
            text = item.elts[0] if isinstance(item, ast.Tuple) and item.elts else item
            if isinstance(text, ast.Constant) and isinstance(text.value, str):
                candidates.append(text.value)
    found = []
    for text in candidates:
        for guess in (text, f"{ROOT}.{text}", _resolve_text(module, text, module.package)):
            if guess in modules():
                found.append(guess)
                break
    return found


def _resolve_text(module: Module, text: str, package: str) -> str:
    if text.startswith("."):
        level = len(text) - len(text.lstrip("."))
        base = package.split(".")
        base = base[: len(base) - (level - 1)]
        rest = text.lstrip(".")
        return ".".join([*base, rest] if rest else base)
    return text


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


@functools.cache
def imports() -> tuple[Import, ...]:
    """Every import of an asyncflat module made inside asyncflat."""
    found = []
    for module in modules().values():
        for node, kind in _walk(module.tree, "top"):
            line = getattr(node, "lineno", 0)
            where = f"{module.where}:{line}"
            targets: list[tuple[str, tuple[str, ...], str]] = []
            if isinstance(node, ast.Import):
                targets = [(alias.name, (), kind) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, node.level, node.module)
                plain = []
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules():
                        targets.append((f"{base}.{alias.name}", (), kind))
                    else:
                        plain.append(alias.name)
                if plain:
                    targets.append((base, tuple(plain), kind))
            elif isinstance(node, ast.Call) and _is_import_module(node):
                targets = [(t, (), "dynamic") for t in _dynamic_targets(module, node)]
            for target, names, how in targets:
                if target == ROOT or target.startswith(f"{ROOT}."):
                    found.append(Import(module.name, target, names, line, how, where))
    return tuple(found)


# -- the declared layering --------------------------------------------------------------------

MAY_IMPORT = re.compile(r"^May import:\s*(?P<list>.*)$", re.S)
TOKEN = re.compile(r"``([A-Za-z_][\w.]*|\*)``")


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def parse_may_import(docstring: str | None) -> tuple[frozenset[str] | None, str]:
    """The names of a docstring's ``May import:`` paragraph, or ``None`` and why not."""
    lines = [p for p in _paragraphs(docstring or "") if p.startswith("May import:")]
    if len(lines) != 1:
        return None, f"{len(lines)} 'May import:' paragraphs in the docstring (need exactly one)"
    body = MAY_IMPORT.match(lines[0])
    assert body is not None
    text = body["list"]
    # the list ends at the first ';', ':' or '.' outside double backticks
    end, inside, i = len(text), False, 0
    while i < len(text):
        if text.startswith("``", i):
            inside, i = not inside, i + 2
            continue
        if not inside and text[i] in ";:.":
            end = i
            break
        i += 1
    listed = text[:end].strip()
    if listed == "nothing":
        return frozenset(), ""
    names = TOKEN.findall(listed)
    rest = TOKEN.sub("X", listed)
    if not names or re.fullmatch(r"X((, | and |, and )X)*", rest) is None:
        return (
            None,
            f"malformed 'May import:' list {listed!r} (names in double backticks joined by ', ' or ' and ')",
        )
    return frozenset(names), ""


@functools.cache
def declared() -> dict[str, frozenset[str]]:
    """The allowed imports of each package and root module that declares a line, by module name."""
    result = {}
    for module in modules().values():
        if module.name in UNDECLARED or not (module.is_package or module.name.count(".") == 1):
            continue
        names, _ = parse_may_import(ast.get_docstring(module.tree))
        if names is not None:
            result[module.name] = names
    return result


def allowed(names: Iterable[str], target: str) -> bool:
    return any(
        n == "*" or target == f"{ROOT}.{n}" or target.startswith(f"{ROOT}.{n}.") for n in names
    )


def layering_breaks() -> list[tuple[Import, str]]:
    """Each import a ``May import:`` line does not allow, with the message that names the line."""
    out = []
    lines = declared()
    for imp in imports():
        holders = enclosing_packages(imp.source)
        if imp.source.count(".") == 1 and not modules()[imp.source].is_package:
            holders = [imp.source]  # a root module: its own line
        for holder in holders:
            inside = imp.target == holder or imp.target.startswith(f"{holder}.")
            if holder in lines and not inside and not allowed(lines[holder], imp.target):
                out.append(
                    (
                        imp,
                        (
                            f"{imp.where}: layering: {imp.source} imports {imp.target} ({imp.kind}), "
                            f"which {modules()[holder].where} does not allow "
                            f"(May import: {', '.join(sorted(lines[holder])) or 'nothing'})"
                        ),
                    )
                )
    return out


# -- graphs and cycles ------------------------------------------------------------------------


def module_graph() -> dict[str, dict[str, Import]]:
    """source -> target -> the first import that makes the edge (modules that exist only)."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in imports():
        if imp.target in modules() and imp.target != imp.source:
            graph[imp.source].setdefault(imp.target, imp)
    return graph


def folder_graph() -> dict[str, dict[str, Import]]:
    """Folder (or root module) -> folder -> the first import that makes the edge."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in imports():
        a, b = folder_of(imp.source), folder_of(imp.target)
        if a != b:
            graph[a].setdefault(b, imp)
    return graph


def cycles(graph: dict[str, dict[str, Import]]) -> list[list[Import]]:
    """One cycle (as its edges) per strongly connected component with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    nodes = sorted({*graph, *(t for edges in graph.values() for t in edges)})

    def connect(v: str) -> None:  # Tarjan's, recursive (the limit is raised below)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(nodes) + 100))
    try:
        for v in nodes:
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return [_cycle_in(graph, set(c)) for c in sorted(components)]


def _cycle_in(graph: dict[str, dict[str, Import]], component: set[str]) -> list[Import]:
    """A shortest cycle through the component's first node (breadth first, back to it)."""
    start = min(component)
    parents: dict[str, tuple[str, Import]] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w, imp in sorted(graph.get(v, {}).items()):
                if w == start:
                    path = [imp]
                    while v != start:
                        v, edge = parents[v]
                        path.append(edge)
                    return path[::-1]
                if w in component and w not in parents:
                    parents[w] = (v, imp)
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def describe_cycle(path: list[Import], fold: bool = False) -> str:
    nodes = [folder_of(e.source) if fold else e.source for e in path]
    nodes.append(nodes[0])
    steps = "; ".join(f"{e.where} ({e.kind}): {e.source} -> {e.target}" for e in path)
    return f"{' -> '.join(nodes)}  [{steps}]"


# -- the figure -------------------------------------------------------------------------------

#: Where each folder stands in the picture (a folder missing here fails the structure test).
GROUPS = {
    "entry points": ("cli", "integrations"),
    "read path": ("loader", "engine", "source"),
    "tools": ("inspection", "testing"),
    "write path": ("writer", "text"),
    "shared": ("storage", "plan", "format", "config", "errors"),
}
#: Root modules the picture leaves out: the face and ``python -m`` (above everything) and the
#: argument checker every folder's public calls use.
NOT_DRAWN = frozenset({ROOT, "__main__", "_typecheck"})
BEGIN = "<!-- house: generated by tests/helpers/house.py; do not edit by hand -->"
END = "<!-- /house -->"


def drawn_units() -> list[str]:
    units = {folder_of(name) for name in modules()}
    return sorted(units - NOT_DRAWN)


def mermaid() -> str:
    """The folder-level import graph as a Mermaid flowchart (arrows point at what is imported).

    A unit every other drawn unit imports (``errors``) is drawn once with that said, not with an
    arrow from each; an arrow that some ``May import:`` line does not allow is dotted and labelled.
    """
    graph = folder_graph()
    units = drawn_units()
    edges = {(a, b) for a in graph for b in graph[a] if a in units and b in units}
    everyones = {b for b in units if all((a, b) in edges for a in units if a != b)}
    broken = {(folder_of(i.source), folder_of(i.target)) for i, _ in layering_breaks()}
    lines = ["```mermaid", "flowchart TB"]
    for group, members in GROUPS.items():
        lines.append(f'  subgraph {group.replace(" ", "_")}["{group}"]')
        for m in members:
            lines.append(
                f'    {m}["{m}: imported by every folder"]' if m in everyones else f"    {m}"
            )
        lines.append("  end")
    for a, b in sorted(edges):
        if b not in everyones:
            lines.append(f"  {a} -. undeclared .-> {b}" if (a, b) in broken else f"  {a} --> {b}")
    lines.append("```")
    return "\n".join(lines)


def figure_block() -> str:
    return f"{BEGIN}\n{mermaid()}\n{END}"


def current_block(text: str) -> str | None:
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        return None
    return text[start : stop + len(END)]


def main(argv: list[str]) -> int:
    text = DESIGN.read_text(encoding="utf-8")
    block = current_block(text)
    if block is None:
        print(f"{DESIGN}: no {BEGIN!r} ... {END!r} block", file=sys.stderr)
        return 1
    if block == figure_block():
        return 0
    if "--check" in argv:
        print(
            f"{DESIGN}: the house figure is stale; run python3 tests/helpers/house.py",
            file=sys.stderr,
        )
        return 1
    DESIGN.write_text(text.replace(block, figure_block()), encoding="utf-8")
    print(f"{DESIGN}: house figure rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
