"""The rules of the house, checked statically (``ast``; nothing of asyncflat is imported).

Where things live, what each folder may import (declared once, in each ``__init__.py``'s
``May import:`` paragraph; the format is in ``tests/helpers/house.py``), no import cycle, no
private name across modules, no long class or function, tests on the public API only, no compat
shims, and the house figure in ``docs/design.md`` equal to what the code draws. Every failure
names the file, the line and the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

from helpers import house

REPO = house.REPO
TESTS = REPO / "tests"

#: The root modules; everything else lives in a folder.
ROOT_MODULES = {"__init__", "__main__", "config", "errors", "_typecheck"}
#: The two paths that must stay apart, whatever the folders declare.
READ_PATH = {"loader", "engine", "source"}
WRITE_PATH = {"writer", "text"}
#: The package faces whose module-level ``__getattr__`` resolves public names on first use.
LAZY_FACES = {"asyncflat", "asyncflat.loader", "asyncflat.storage"}
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
#: Private attributes of other libraries that tests use and that asyncflat happens to define too.
THIRD_PARTY_PRIVATES = {
    "_put",  # fsspec's AsyncFileSystem._put: upload a local tree to the emulated bucket
    "_ls",  # fsspec's AsyncFileSystem._ls: list a directory (asyncflat.testing's filesystem too)
    "_request",  # gcsfs.GCSFileSystem._request: which retry wrapper gcsfs installed
    "_result_queue",  # concurrent.futures' process pool
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def fail_if(violations: Iterable[str], rule: str) -> None:
    found = sorted(set(violations))
    assert not found, f"{rule}: {len(found)} violation(s)\n" + "\n".join(found)


def package_sources() -> Iterator[tuple[str, str, ast.Module]]:
    """``(module name, "path", tree)`` of every module of the package."""
    for module in house.modules().values():
        yield module.name, module.where, module.tree


def test_the_root_holds_only_the_five_root_modules() -> None:
    found = {p.stem for p in house.PACKAGE.glob("*.py")}
    fail_if(
        (
            f"asyncflat/{name}.py:1: root modules: only {sorted(ROOT_MODULES)} live at the root; "
            "move it to its folder"
            for name in found - ROOT_MODULES
        ),
        "root modules",
    )
    assert ROOT_MODULES <= found, f"root modules: missing {sorted(ROOT_MODULES - found)}"


# -- folders and their layering -----------------------------------------------------------------


def folder_violations() -> Iterator[str]:
    for directory in sorted(p for p in house.PACKAGE.rglob("*") if p.is_dir()):
        if directory.name == "__pycache__" or not any(directory.glob("*.py")):
            continue
        init = directory / "__init__.py"
        where = f"{init.relative_to(REPO)}:1"
        if not init.exists():
            yield f"{where}: folders: {directory.relative_to(REPO)} holds modules but no __init__.py"
            continue
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        if not docstring or len(docstring.split("\n\n")[0]) < 20:
            yield f"{where}: folders: no docstring saying what the folder holds"
        _, why = house.parse_may_import(docstring)
        if why:
            yield f"{where}: folders: {why}"
    for module in house.modules().values():
        if (
            module.name.count(".") == 1
            and not module.is_package
            and module.name not in house.UNDECLARED
        ):
            _, why = house.parse_may_import(ast.get_docstring(module.tree))
            if why:
                yield f"{module.where}:1: folders: {why}"
    for name, names in house.declared().items():
        for unknown in sorted(
            n for n in names - {"*"} if f"{house.ROOT}.{n}" not in house.modules()
        ):
            yield f"{house.modules()[name].where}:1: folders: 'May import:' names {unknown}, no module"


def test_every_folder_says_what_it_holds_and_may_import() -> None:
    fail_if(folder_violations(), "folders")


def test_may_import_lines_parse_exactly() -> None:
    parse = house.parse_may_import
    assert parse(
        "Holds x.\n\nMay import: ``engine``, ``engine.loop`` and\n``errors``; never ``x``."
    ) == (
        frozenset({"engine", "engine.loop", "errors"}),
        "",
    )
    assert parse("x\n\nMay import: nothing.") == (frozenset(), "")
    assert parse("x\n\nMay import: ``*``.")[0] == frozenset({"*"})
    assert parse("x\n\nMay import: :mod:`asyncflat.engine` and ``errors``.")[0] is None
    assert parse("x\n\nMay import: ``a`` ``b``.")[0] is None
    assert parse("no line")[0] is None
    assert parse("x\n\nMay import: ``a``.\n\nMay import: ``b``.")[0] is None
    assert house.allowed({"engine.loop"}, "asyncflat.engine.loop")
    assert not house.allowed({"engine.loop"}, "asyncflat.engine.core")
    assert not house.allowed({"engine"}, "asyncflat.engine_x")


def test_every_import_names_a_module_that_exists() -> None:
    fail_if(
        (
            f"{i.where}: imports: {i.target} is not a module of asyncflat"
            for i in house.imports()
            if i.target not in house.modules()
        ),
        "imports",
    )


def test_folders_import_only_what_they_declare() -> None:
    fail_if((message for _, message in house.layering_breaks()), "layering")


def test_the_read_and_write_paths_do_not_import_each_other() -> None:
    def crossing(imp: house.Import) -> bool:
        a, b = house.folder_of(imp.source), house.folder_of(imp.target)
        return (a in READ_PATH and b in WRITE_PATH) or (a in WRITE_PATH and b in READ_PATH)

    fail_if(
        (
            f"{i.where}: read/write paths: {i.source} imports {i.target} ({i.kind})"
            for i in house.imports()
            if crossing(i)
        ),
        "read/write paths",
    )


def test_no_import_cycle_between_modules() -> None:
    fail_if(
        (
            f"{c[0].where}: module cycle: {house.describe_cycle(c)}"
            for c in house.cycles(house.module_graph())
        ),
        "module cycles (function-level and TYPE_CHECKING imports count)",
    )


def test_no_import_cycle_between_folders() -> None:
    fail_if(
        (
            f"{c[0].where}: folder cycle: {house.describe_cycle(c, fold=True)}"
            for c in house.cycles(house.folder_graph())
        ),
        "folder cycles (function-level and TYPE_CHECKING imports count)",
    )


def test_cycles_are_found_with_their_path() -> None:
    def edge(a: str, b: str) -> house.Import:
        return house.Import(a, b, (), 1, "top", f"{a}.py:1")

    graph = {
        "a": {"b": edge("a", "b")},
        "b": {"c": edge("b", "c")},
        "c": {"a": edge("c", "a")},
        "d": {"a": edge("d", "a")},
    }
    (cycle,) = house.cycles(graph)
    assert [e.source for e in cycle] == ["a", "b", "c"]
    assert house.describe_cycle(cycle).startswith("a -> b -> c -> a")
    assert house.cycles({"a": {"b": edge("a", "b")}}) == []


# -- private names across modules ----------------------------------------------------------------


def private_import_violations() -> Iterator[str]:
    for imp in house.imports():
        parts = imp.target.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])  # the package holding the private module
            inside = imp.source == owner or imp.source.startswith(f"{owner}.")
            if is_private(part) and not inside:
                yield f"{imp.where}: private names: {imp.source} imports the private module {imp.target}"
        for name in imp.names:
            if is_private(name):
                yield f"{imp.where}: private names: {imp.source} imports {name} from {imp.target}"


def module_reach_in_violations(where: str, tree: ast.Module) -> Iterator[str]:
    """``alias._name`` where ``alias`` is bound to an asyncflat module or object by an import."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "asyncflat"
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == "asyncflat"
        ):
            bound |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                yield f"{where}:{node.lineno}: private names: {ast.unparse(node)} reaches into asyncflat's private {node.attr}"


def test_no_private_name_is_imported_across_modules() -> None:
    fail_if(private_import_violations(), "private names")


def class_reach_in_violations() -> Iterator[str]:
    """``obj._attr`` (``obj`` not ``self``/``cls``) of a private attribute that another module defines.

    Static analysis does not know ``obj``'s class: an attribute this module defines itself counts as
    its own (a class may read another instance's privates); one only other modules define is a
    reach-in.
    """
    defined = {name: private_attributes(tree) for name, _, tree in package_sources()}
    everywhere = set().union(*defined.values())
    for name, where, tree in package_sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in everywhere and node.attr not in defined[name]:
                yield (
                    f"{where}:{node.lineno}: private names: {ast.unparse(node)} reaches into "
                    f"{node.attr}, private to another module"
                )


def test_no_module_reaches_into_another_modules_privates() -> None:
    by_module = (
        v for _, where, tree in package_sources() for v in module_reach_in_violations(where, tree)
    )
    fail_if([*by_module, *class_reach_in_violations()], "private names")


# -- sizes ----------------------------------------------------------------------------------------


def size_violations(where: str, tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        lines = (
            (node.end_lineno or node.lineno) - node.lineno + 1
        )  # from the def line: no decorators
        limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
        if lines > limit:
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield f"{where}:{node.lineno}: sizes: {kind} {node.name} has {lines} lines (at most {limit})"


def test_no_class_or_function_is_too_long() -> None:
    fail_if(
        (v for _, where, tree in package_sources() for v in size_violations(where, tree)), "sizes"
    )


def test_sizes_count_from_the_def_line() -> None:
    body = "\n".join(["@decorator", "def f():", *["    x = 1"] * 79])
    assert list(size_violations("m.py", ast.parse(body))) == []
    assert list(size_violations("m.py", ast.parse(body + "\n    x = 2"))) == [
        "m.py:2: sizes: function f has 81 lines (at most 80)"
    ]


# -- no compat shims ------------------------------------------------------------------------------


def shim_violations(name: str, where: str, tree: ast.Module) -> Iterator[str]:
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and node in tree.body:
            if name not in LAZY_FACES:
                yield f"{where}:{node.lineno}: shims: module-level __getattr__ outside the lazy faces {sorted(LAZY_FACES)}"
    for node in tree.body:  # top level only: the lazy faces' maps and aliases live there
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if isinstance(value, ast.Dict) and name in LAZY_FACES:
            for key in value.keys:
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and key.value.startswith("_")
                ):
                    yield f"{where}:{node.lineno}: shims: lazy name {key.value!r} is not public"
        root = value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in imported:
            for target in targets:
                if isinstance(target, ast.Name) and target.id != "__all__":
                    yield f"{where}:{node.lineno}: shims: {target.id} = {ast.unparse(value)} aliases an imported name"


def test_no_compat_shims() -> None:
    fail_if(
        (v for name, where, tree in package_sources() for v in shim_violations(name, where, tree)),
        "shims",
    )


def test_shims_are_found() -> None:
    code = (
        "from a import b\nimport c\n_old = b\nNew = c.d\nT = b[int]\ndef __getattr__(name): pass\n"
    )
    found = list(shim_violations("asyncflat.x", "x.py", ast.parse(code)))
    assert [v.split(": ")[0] for v in found] == ["x.py:6", "x.py:3", "x.py:4"]
    lazy = list(
        shim_violations(
            "asyncflat.loader", "l.py", ast.parse("_M = {'_old': 'x'}\ndef __getattr__(n): pass")
        )
    )
    assert lazy == ["l.py:1: shims: lazy name '_old' is not public"]


# -- the tests use the public API -----------------------------------------------------------------


def private_attributes(tree: ast.Module) -> set[str]:
    """Private attribute names a module defines: on instances, in class bodies, as methods."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        for target in targets:
            names |= {t.attr for t in ast.walk(target) if isinstance(t, ast.Attribute)}
    return {n for n in names if is_private(n)}


def package_private_attributes() -> set[str]:
    names = set()
    for _, _, tree in package_sources():
        names |= private_attributes(tree)
    return names - THIRD_PARTY_PRIVATES


PATCHERS = {"setattr", "delattr", "getattr", "hasattr", "patch", "object", "setitem"}


def check_test_file(
    where: str, tree: ast.Module, privates: set[str], own: set[str]
) -> Iterator[str]:
    """A test's private imports, patches and reach-ins of asyncflat (``own``: what the tests define)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "asyncflat":
            for part in node.module.split("."):
                if is_private(part):
                    yield f"{where}:{node.lineno}: tests: imports the private module {node.module}"
            for alias in node.names:
                if is_private(alias.name):
                    yield f"{where}:{node.lineno}: tests: imports the private name {alias.name} from {node.module}"
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "asyncflat":
                    if any(is_private(p) for p in alias.name.split(".")):
                        yield f"{where}:{node.lineno}: tests: imports the private module {alias.name}"
                    bound.add((alias.asname or alias.name).split(".")[0])
    yield from (
        v.replace("private names:", "tests:") for v in module_reach_in_violations(where, tree)
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if called not in PATCHERS or not node.args:
                continue
            first = node.args[0]
            if (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value.startswith("asyncflat.")
            ):
                if any(is_private(p) for p in first.value.split(".")):
                    yield f"{where}:{node.lineno}: tests: patches the private {first.value}"
            name = node.args[1] if len(node.args) > 1 else None
            if (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and is_private(name.value)
            ):
                root = first
                while isinstance(root, ast.Attribute):
                    root = root.value
                on_asyncflat = isinstance(root, ast.Name) and root.id in bound
                if on_asyncflat or (name.value in privates and name.value not in own):
                    yield f"{where}:{node.lineno}: tests: {called}() of the private attribute {name.value!r}"
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in privates and node.attr not in own:
                yield f"{where}:{node.lineno}: tests: {ast.unparse(node)} reaches into asyncflat's private {node.attr}"


def sources_of_tests() -> Iterator[tuple[str, ast.Module, set[str]]]:
    """Every test file, with the private attributes the tests themselves define for it."""
    helpers = {
        p.stem: private_attributes(ast.parse(p.read_text(encoding="utf-8")))
        for p in (TESTS / "helpers").glob("*.py")
    }
    shared = private_attributes(ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8")))
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = private_attributes(tree) | shared
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("helpers."):
                own |= helpers.get(node.module.split(".")[1], set())
        yield str(path.relative_to(REPO)), tree, own


def test_tests_use_only_public_names_of_asyncflat() -> None:
    privates = package_private_attributes()
    fail_if(
        (
            v
            for where, tree, own in sources_of_tests()
            for v in check_test_file(where, tree, privates, own)
        ),
        "tests (public API or asyncflat.testing only)",
    )


def test_test_reach_ins_are_found() -> None:
    code = (
        "import asyncflat.engine.core as core\n"
        "from asyncflat.loader import ShufflingLoader, _helper\n"
        "from asyncflat.storage._x import y\n"
        "def test(monkeypatch, loader):\n"
        "    core._clock\n"
        "    monkeypatch.setattr(ShufflingLoader, '_start', None)\n"
        "    monkeypatch.setattr('asyncflat.engine.core._now', None)\n"
        "    mock.patch.object(loader, '_engine')\n"
        "    loader._engine.stats()\n"
        "    loader._mine\n"
        "    fs._put()\n"
    )
    found = list(check_test_file("t.py", ast.parse(code), {"_engine", "_mine"}, {"_mine"}))
    lines = sorted(int(v.split(":")[1]) for v in found)
    assert lines == [2, 3, 5, 6, 7, 8, 9], found


# -- the house figure -----------------------------------------------------------------------------


def test_every_folder_has_its_place_in_the_figure() -> None:
    placed = [m for members in house.GROUPS.values() for m in members]
    assert sorted(placed) == house.drawn_units(), (
        f"{Path(house.__file__).relative_to(REPO)}:1: figure: GROUPS must place each folder and "
        f"root module exactly once: {sorted(placed)} vs {house.drawn_units()}"
    )


def test_the_house_figure_is_current() -> None:
    text = house.DESIGN.read_text(encoding="utf-8")
    block = house.current_block(text)
    line = text[: text.find(house.BEGIN)].count("\n") + 1
    assert block is not None, (
        f"docs/design.md:1: figure: no {house.BEGIN!r} ... {house.END!r} block"
    )
    assert block == house.figure_block(), (
        f"docs/design.md:{line}: figure: the house figure is stale; run python3 tests/helpers/house.py"
    )
