"""The simulator's reach into asyncio's and aiohttp's private parts stays in one module
(``splitserve/sim/asyncio_internals.py``), checked against the Python it was written for."""

from __future__ import annotations

import ast
import hashlib
import inspect
import pathlib
import sys

import aiohttp

from splitserve.sim import asyncio_internals

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "splitserve"
ISOLATED = PACKAGE / "sim" / "asyncio_internals.py"

PRIVATE = {"_run_once", "_scheduled", "_ready", "_timer_cancelled_count", "_clock_resolution", "_cancelled",
           "_check_closed", "_write_to_self", "_MIN_SCHEDULED_TIMER_HANDLES", "_match_info"}
"""asyncio's and aiohttp's private names the simulator uses; none of ours is spelled so."""
PRIVATE_ON_OTHERS = {"_stopping", "_run", "_handle"}
"""Private names of theirs that our own classes use too: flagged on anything but ``self`` in a file
that imports asyncio or aiohttp."""


def _imports_asyncio_or_aiohttp(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n.split(".")[0] in ("asyncio", "aiohttp") for n in names):
            return True
    return False


def test_no_private_name_of_asyncio_or_aiohttp_outside_the_isolated_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ISOLATED:
            continue
        tree = ast.parse(path.read_text())
        loose = _imports_asyncio_or_aiohttp(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if node.attr in PRIVATE or (loose and node.attr in PRIVATE_ON_OTHERS and not on_self):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in PRIVATE:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} def {node.name}")
    assert not found, f"asyncio/aiohttp internals outside sim/asyncio_internals.py: {found}"
    isolated = list(ast.walk(ast.parse(ISOLATED.read_text())))
    used = {n.attr for n in isolated if isinstance(n, ast.Attribute)} | {
        n.name for n in isolated if isinstance(n, ast.FunctionDef)}
    assert PRIVATE | PRIVATE_ON_OTHERS <= used, f"listed but no longer used: {(PRIVATE | PRIVATE_ON_OTHERS) - used}"


def test_asyncio_and_aiohttp_are_what_the_isolated_module_was_checked_on():
    """Fails loudly when Python or aiohttp moves under the simulator's loop: the module's
    docstring says what to do."""
    version = sys.version_info[:2]
    assert version in asyncio_internals.CHECKED_ON, (
        f"Python {version[0]}.{version[1]}: splitserve/sim/asyncio_internals.py was checked on "
        f"{sorted(asyncio_internals.CHECKED_ON)} only; check it on this one (its docstring says how)")
    now = {name: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16]
           for name, f in asyncio_internals.relied_on().items()}
    assert now == asyncio_internals.CHECKED_ON[version], (
        f"asyncio changed under the simulator's loop: {now} (see asyncio_internals.py's docstring)")
    assert aiohttp.__version__ == asyncio_internals.AIOHTTP_CHECKED, aiohttp.__version__


OURS_STILL_REACHED: set[tuple[str, str]] = set()
"""Private attributes the simulator still reads or sets on objects not its own (file, name): each
is to become a seam of the real code (a constructor parameter, or a public reader)."""


def test_the_simulator_reaches_no_private_attribute_but_the_listed_ones():
    """``x._name`` in ``sim/`` (but on ``self`` / ``cls``, and outside the isolated module): the
    test fails on one not listed, and on a listed one that is gone (strike it)."""
    found = set()
    for path in sorted((PACKAGE / "sim").glob("*.py")):
        if path == ISOLATED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add((path.name, node.attr))
    assert found - OURS_STILL_REACHED == set(), f"new reaches into private attributes: {sorted(found - OURS_STILL_REACHED)}"
    assert OURS_STILL_REACHED - found == set(), f"gone, strike them: {sorted(OURS_STILL_REACHED - found)}"
