"""Imports point down: the layer order of ``docs/design.md`` (*Layers*), read from the code.

Every import of a ``splitserve`` module, at the top of a file or inside a function, is an edge
from its file's group (a top-level module, or a package one level down: ``splitserve.engine``) to
the imported one's. A group may import its own modules and those of lower layers, never a sibling
of its own layer nor a layer above. The breaches still in the code are listed, each with what
removes it: the test fails on any other, and on a listed one that is gone (strike it). No cycle
among the modules' top-level imports.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "splitserve"

LAYERS = [
    {"splitserve.hosts", "splitserve.transfer_backends"},
    {"splitserve", "splitserve.outcomes", "splitserve.config", "splitserve.log_sparsely", "splitserve.timeline",
     "splitserve.metrics", "splitserve.cpus", "splitserve.tls", "splitserve.discovery", "splitserve.secret_file",
     "splitserve.validation_fields", "splitserve.file_trust"},
    {"splitserve.errors"},
    {"splitserve.layers"},
    {"splitserve.models"},
    {"splitserve.engine"},
    {"splitserve.disagg"},
    {"splitserve.http_util", "splitserve.auth", "splitserve.client_writer", "splitserve.validation"},
    {"splitserve.server", "splitserve.router"},
    {"splitserve.launch", "splitserve.top", "splitserve.bench", "splitserve.sim", "splitserve.testing"},
    {"splitserve.cli"},
]
"""Lowest first; ``docs/design.md`` lists the same."""

KNOWN: dict = {}
"""Breaches not removed yet: (importing module, imported module) -> what removes it."""


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _imports(path: pathlib.Path, top_level_only: bool = False) -> frozenset[str]:
    tree = _tree(path)
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return frozenset(m for m in found if m == "splitserve" or m.startswith("splitserve."))


@functools.lru_cache(maxsize=None)
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text())


def _group(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _layer(group: str) -> int:
    for i, layer in enumerate(LAYERS):
        if group in layer:
            return i
    raise AssertionError(f"{group} is in no layer: add it to LAYERS and to docs/design.md")


def _modules() -> dict[str, pathlib.Path]:
    return {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_imports_point_down():
    breaches = set()
    for module, path in _modules().items():
        for imported in _imports(path):
            a, b = _group(module), _group(imported)
            if a != b and _layer(b) >= _layer(a):
                breaches.add((module, imported))
    assert breaches - set(KNOWN) == set(), f"imports that point up or sideways: {sorted(breaches - set(KNOWN))}"
    assert set(KNOWN) - breaches == set(), f"gone, strike them from KNOWN: {sorted(set(KNOWN) - breaches)}"


def test_no_import_cycle():
    modules = _modules()
    graph = {m: {i for i in _imports(p, top_level_only=True) if i in modules and i != m} for m, p in modules.items()}
    for m in modules:  # a package's __init__ may import its own modules: not a cycle through them
        graph[m] = {i for i in graph[m] if not (i.startswith(m + ".") and m in graph.get(i, set()))}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan: strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layers_in_the_design_doc_are_the_tests():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Layers"):]
    section = section[: section.find("\n## ", 5)] if "\n## " in section[5:] else section
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| layer")]
    documented = [{w.strip("` ,") for w in row.split("|")[2].split(",")} for row in rows]
    assert documented == [{m.removeprefix("splitserve.") if m != "splitserve" else "splitserve" for m in layer}
                          for layer in LAYERS]


def test_the_router_and_launchs_supervisor_do_not_load_torch():
    """The router validates requests (grammars included) but runs no model, and ``launch``'s
    supervisor only starts and watches processes: neither may import torch, which costs seconds of
    CPU and ~190 MB at its start (the supervisor once did, 256 MB, to write a cluster secret).
    The launch here stops at its configuration check, after the secret is written."""
    import os
    import subprocess
    import sys

    code = ("import sys, splitserve.cli, splitserve.router.app\n"
            "from splitserve.launch import LaunchConfig, run_launch\n"
            "assert run_launch(LaunchConfig(model='tiny', num_prefill=0)) == 2\n"
            "print(sorted(m for m in sys.modules if m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"the router or launch imports torch: {out.stdout}"


def test_the_runtime_finds_the_tiny_builder_by_name():
    """``--model tiny`` reaches the test tooling through the installed entry point, not an import."""
    from splitserve.models.resolve import model_builder
    from splitserve.testing.tiny import tiny_model_path

    assert model_builder("tiny") is tiny_model_path
    with pytest.raises(FileNotFoundError, match="no builder named 'nope' is installed"):
        model_builder("nope")
