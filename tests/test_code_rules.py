"""Rules that keep the code readable, read from the code as ``test_import_order.py`` reads imports:
no function longer than 70 lines (TigerBeetle's limit); no import cycle — between modules (any
import: at the top, in a function, or only for type checking) nor between sibling packages (as
``disagg/control`` and ``disagg/transfer``); no module docstring over 20 lines; and no test file
importing another (shared helpers live in ``tests/helpers/``). Each test names every offender."""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "splitserve"
TESTS = ROOT / "tests"
MAX_FUNCTION_LINES = 70
MAX_DOCSTRING_LINES = 20


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(path: pathlib.Path, name: str) -> set[str]:
    """The splitserve modules ``path`` (module ``name``) imports, anywhere in it. ``from pkg import
    x`` is an edge to ``pkg.x`` when that is a module, else to ``pkg``: a package's ``__init__``
    that runs first on the way to a submodule is not counted."""
    mods = modules()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names} & mods.keys()
            found |= subs if len(subs) == len(node.names) else subs | {base}
    return {m for m in found if m in mods and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_function_is_longer_than_70_lines():
    """Counted from the ``def`` line to the function's last line, its docstring included."""
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 70 lines: " + ", ".join(long)


def long_module_docstrings() -> dict[str, int]:
    """Each module under ``splitserve/`` whose docstring is over :data:`MAX_DOCSTRING_LINES`
    lines (from its opening to its closing quotes), with its count."""
    out = {}
    for path in modules().values():
        body = ast.parse(path.read_text()).body
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines = first.end_lineno - first.lineno + 1
            if lines > MAX_DOCSTRING_LINES:
                out[str(path.relative_to(ROOT))] = lines
    return out


def test_no_module_docstring_is_longer_than_20_lines():
    """A module docstring says what the module is for, briefly: at most 20 lines (design reasoning
    belongs in ``docs/``)."""
    long = long_module_docstrings()
    named = ", ".join(f"{m} ({n} lines)" for m, n in sorted(long.items()))
    assert not long, f"module docstrings over 20 lines: {named}"


def test_no_import_cycle_between_modules():
    graph = {name: imported(path, name) for name, path in modules().items()}
    assert not cycles(graph), f"modules that import each other, by some path: {cycles(graph)}"


def test_no_import_cycle_between_sibling_packages():
    """Within one package, its subpackages' modules import in one direction only."""
    def subpackage(module: str) -> str:
        path = modules()[module]
        return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        here = subpackage(name)
        for other in imported(path, name):
            there = subpackage(other)
            parent_of = lambda a, b: b.startswith(a + ".")  # noqa: E731 (a package and its own)
            if here != there and here.rsplit(".", 1)[0] == there.rsplit(".", 1)[0] \
                    and not parent_of(here, there) and not parent_of(there, here):
                graph.setdefault(here, set()).add(there)
    assert not cycles(graph), f"sibling packages that import each other: {cycles(graph)}"


def test_no_test_file_imports_another():
    """No module under ``tests/`` (a test file or a helper; at the top or in a function) imports a
    ``test_*`` module (``test_x`` or ``tests.test_x``): what two test files share belongs in
    ``tests/helpers/``."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "tests":
                    parts = parts[1:]
                if parts and parts[0].startswith("test_"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not found, "test files importing test files: " + ", ".join(found)
