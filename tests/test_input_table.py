"""Every input has its row: ``docs/security.md``'s table *Every input* against the places in the
code that take input, read from the code as ``tests/test_import_order.py`` reads its imports.

The places (:func:`code_sites`), each named as the table names it:

- HTTP routes, ``router GET /health`` or ``worker POST /role``: every ``app.router.add_*`` call of a
  module under ``splitserve/`` (a path from a loop over a literal or a module-level constant is
  followed to its strings);
- environment variables, ``$NAME``: a literal or module-level constant read through
  ``os.environ``/``os.getenv``, and every ``SPLITSERVE_*`` string (the key tables name theirs);
- files named by flags, ``--NAME``: every option of ``splitserve serve``, ``router`` and ``launch``
  (their real parser) that names a file (``-file``, ``certfile``, ``keyfile``, ``ca-certs``,
  ``--model``, ``--chat-template``);
- ZMQ frames, ``module::function``: every ``recv``-family call and ``recv_monitor_message``;
- HTTP answers the router or a worker reads, ``module::function``: every ``get``/``post``/
  ``put``/``delete``/``request`` on an object named ``session``;
- etcd, ``module::function``: every ``get_prefix`` and ``watch_prefix`` call.

The benchmark client, the simulator and the test helpers (``bench``, ``sim``, ``testing``) are not
the worker's or the router's and are left out. A place without a row fails; so does a row naming a
place that is gone, or a test that does not exist.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "splitserve"
SKIPPED = ("bench", "sim", "testing")
HEADING = "## Every input"
ZMQ_READS = {"recv", "recv_multipart", "recv_json", "recv_string", "recv_pyobj", "recv_serialized"}
HTTP_CALLS = {"get", "post", "put", "delete", "request"}
ETCD_READS = {"get_prefix", "watch_prefix"}
FILE_FLAG = re.compile(r"^--(.*-file|.*certfile|.*keyfile|.*ca-certs|model|chat-template)$")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] not in SKIPPED:
            found[str(rel)] = path
    return found


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = value`` assignments."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node.value
    return found


def _resolve(name: str, tree: ast.Module) -> ast.expr | None:
    """``name``'s module-level value in ``tree``, or in the splitserve module it is imported from."""
    if name in _constants(tree):
        return _constants(tree)[name]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("splitserve"):
            if any((a.asname or a.name) == name for a in node.names):
                path = ROOT / Path(*node.module.split("."))
                path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
                return _constants(_tree(path)).get(name)
    return None


def _strings(node: ast.expr | None) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)} \
        if node is not None else set()


def _functions(tree: ast.Module):
    """(innermost function name or ``<module>``, node) for every node."""
    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            yield inner, child
            yield from walk(child, inner)
    yield from walk(tree, "<module>")


def _parents(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _route_paths(call: ast.Call, tree: ast.Module, parents: dict) -> set[str]:
    """The path(s) of one ``add_*`` call: a literal, or the strings a loop variable takes."""
    arg = call.args[1] if call.func.attr == "add_route" else call.args[0]
    if isinstance(arg, ast.Constant):
        return {arg.value}
    node = call
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.For) and arg.id in {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}:
            values = _resolve(node.iter.id, tree) if isinstance(node.iter, ast.Name) else node.iter
            return {s for s in _strings(values) if s.startswith("/")}
    raise AssertionError(f"a route whose path this test cannot read: {ast.unparse(call)}")


def _routes(module: str, tree: ast.Module, nodes: list | None = None) -> set[str]:
    side = {"router": "router", "server": "worker"}.get(module.split("/")[0])
    parents, found = None, set()
    for node in nodes if nodes is not None else ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("add_") \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "router":
            assert side is not None, f"{module}: an HTTP route outside the router's and the worker's apps"
            method = ast.literal_eval(node.args[0]) if node.func.attr == "add_route" else node.func.attr[4:].upper()
            parents = parents or _parents(tree)
            found |= {f"{side} {method} {path}" for path in _route_paths(node, tree, parents)}
    return found


def _is_environ(node: ast.expr) -> bool:
    return ast.unparse(node) in ("os.environ", "environ")


def _env_reads(tree: ast.Module, nodes: list | None = None) -> set[str]:
    found = set()
    for node in nodes if nodes is not None else ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and (
                ast.unparse(node.func) == "os.getenv"
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "get" and _is_environ(node.func.value))):
            name = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            name = node.slice
        if isinstance(name, ast.Name):
            name = _resolve(name.id, tree)
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            found.add("$" + name.value)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"SPLITSERVE_[A-Z0-9_]+",
                                                                                           node.value):
            found.add("$" + node.value)
    return found


def _calls(module: str, tree: ast.Module, names: set[str], receiver: str | None = None,
           located: list | None = None) -> set[str]:
    """``module::function`` of every call of a method (or function) in ``names``; with
    ``receiver``, only on an object whose name ends with it. ``located``: ``_functions(tree)``."""
    found = set()
    for where, node in located if located is not None else _functions(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if called not in names:
            continue
        on = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        if receiver is not None and not on.endswith(receiver):
            continue
        found.add(f"{module}::{where}")
    return found


def _file_flags() -> set[str]:
    from splitserve.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    flags = set()
    for command in ("serve", "router", "launch"):
        for action in commands.choices[command]._actions:
            flags |= {o for o in action.option_strings if FILE_FLAG.match(o)}
    return flags


@functools.lru_cache(maxsize=None)
def code_sites() -> dict[str, frozenset[str]]:
    """Every place that takes input, by kind, each named as the table names it."""
    sites = {"route": set(), "env": set(), "zmq": set(), "http": set(), "etcd": set()}
    for module, path in _modules().items():
        tree = _tree(path)
        located = list(_functions(tree))
        nodes = [node for _, node in located]
        sites["route"] |= _routes(module, tree, nodes)
        sites["env"] |= _env_reads(tree, nodes)
        sites["zmq"] |= _calls(module, tree, ZMQ_READS | {"recv_monitor_message"}, located=located)
        sites["http"] |= _calls(module, tree, HTTP_CALLS, receiver="session", located=located)
        sites["etcd"] |= _calls(module, tree, ETCD_READS, located=located)
    sites["flag"] = _file_flags()
    return {kind: frozenset(found) for kind, found in sites.items()}


def table_rows() -> list[dict[str, str]]:
    """The rows of the table under :data:`HEADING` in docs/security.md, by column name."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split(HEADING + "\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(header), f"a row of {len(cells)} cells, not {len(header)}: {line[:80]}"
        rows.append(dict(zip(header, cells)))
    return rows


def _named(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_every_place_that_takes_input_has_its_row_and_every_row_its_places():
    rows = table_rows()
    assert {"input", "`launch`", "by hand", "Kubernetes", "read at", "shown by"} <= set(rows[0]), rows[0].keys()
    named: dict[str, str] = {}
    for row in rows:
        for site in _named(row["read at"]):
            assert site not in named, f"{site} is in two rows: {named[site]!r} and {row['input']!r}"
            named[site] = row["input"]
        assert row["read at"] == "—" or _named(row["read at"]), row["input"]
    sites = code_sites()
    found = set().union(*sites.values())
    missing = sorted(found - set(named))
    assert not missing, ("input read here without a row in docs/security.md (Every input): " + ", ".join(missing)
                         + ": add it to a row's *read at*, or a row of its own")
    gone = sorted(set(named) - found)
    assert not gone, f"docs/security.md (Every input) names places no longer in the code: {', '.join(gone)}"


def test_every_row_names_tests_that_exist():
    for row in table_rows():
        tests = _named(row["shown by"])
        assert tests, f"{row['input']!r} names no test"
        for ref in tests:
            path, _, name = ref.partition("::")
            file = ROOT / path
            assert file.is_file(), f"{row['input']!r}: no {path}"
            if name:  # a test function at the file's top level
                defined = re.search(rf"^(async )?def {re.escape(name)}\(", file.read_text(), re.M)
                assert defined, f"{row['input']!r}: no test {name} in {path}"


def test_the_reader_finds_each_kind_of_input_in_new_code():
    """A new route, environment variable, ZMQ receive, HTTP answer and etcd list are each found
    (so one added without a row fails above), and the places every deployment has are found."""
    code = ast.parse(
        "import os\nPREFIX_ENV = 'NEW_VAR'\n"
        "def make(app):\n    app.router.add_get('/new', h)\n"
        "    for p in ('/a', '/b'):\n        app.router.add_post(p, h)\n"
        "def read(sock, session, etcd):\n    os.environ.get(PREFIX_ENV)\n    os.environ['OTHER']\n"
        "    sock.recv_multipart()\n    session.post('u')\n    etcd.get_prefix('/p')\n")
    assert _routes("router/new.py", code) == {"router GET /new", "router POST /a", "router POST /b"}
    assert _env_reads(code) == {"$NEW_VAR", "$OTHER"}
    assert _calls("m.py", code, ZMQ_READS) == {"m.py::read"}
    assert _calls("m.py", code, HTTP_CALLS, receiver="session") == {"m.py::read"}
    assert _calls("m.py", code, ETCD_READS) == {"m.py::read"}
    sites = code_sites()
    assert {"router POST /v1/chat/completions", "worker POST /role"} <= sites["route"]
    assert {"$SPLITSERVE_API_KEY", "$UCX_TLS"} <= sites["env"]
    assert {"--cluster-secret-file", "--discovery-password-file", "--model"} <= sites["flag"]
    assert all(sites.values()), sites


def test_an_environment_value_bound_for_a_command_line_is_checked(monkeypatch):
    """``$SPLITSERVE_KERNELS_MARCH`` goes on the compiler's command line: only a -march value."""
    import pytest

    from splitserve.layers import kernels

    monkeypatch.setenv("SPLITSERVE_KERNELS_MARCH", "x86-64-v3")
    assert kernels.march() == "x86-64-v3"
    for value in ("native -o /tmp/x", "native;id", "$(id)"):
        monkeypatch.setenv("SPLITSERVE_KERNELS_MARCH", value)
        with pytest.raises(ValueError, match="is not a -march value"):
            kernels.march()
