"""Every import inside ``distgrad/`` points down a floor (issue 46).

The package is built in floors. A module may import its own top-level package (or
module) freely, and any module of a lower floor; never one of a higher floor. Lazy
imports (inside functions, under ``if TYPE_CHECKING``) count as much as the ones at
the top of a file: a reader sees them all. So do the reaches by name: a literal
``"distgrad...."`` given to ``importlib.import_module``, ``__import__`` or looked up
in ``sys.modules``. Top-level units on one floor may import each other only without
a circle; today none does.

The floors, lowest first (:data:`FLOORS`):

0. small shared modules that know nothing of RPC: ``errors``, ``ids``,
   ``safe_files``, ``intra_op``, ``_cpp_cache``, ``_build`` (the message path's
   chooser: it names the compiled modules, never imports them), ``observe`` (the
   tracer's slot and clock, read by the floors below the tracer);
1. ``transport``: frames between workers;
2. ``wire``: Python objects to frames and back;
3. ``launch``: rendezvous on torch's stores and the ``distgrad launch`` front; it
   sits under ``rpc`` because ``init_rpc`` runs its rendezvous (and it never imports
   ``rpc``);
4. ``rpc``: the agent and torch.distributed.rpc's API; the floors above plug in
   through ``rpc.extensions`` (agent extensions, ``at_shutdown``,
   ``provide_backward``);
5. ``autograd``: distributed autograd;
6. ``optim``, ``nn``, ``trace``, ``graph``: built on the floors below; the tracer
   learns what happens there through ``observe`` and ``rpc.extensions``, the graph
   exporter by reading autograd's contexts;
7. the front: ``demo``, ``cli``, ``testing``, ``__main__`` and the package itself
   (``distgrad/__init__.py``: ``distgrad.info()`` reads every floor).

A new top-level module fails :func:`test_every_module_has_a_floor` until it is given
one here.
"""
from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "distgrad"

#: each top-level module or package of distgrad/ -> its floor (higher imports lower);
#: "" is the package's own __init__
FLOORS = {
    "errors": 0, "ids": 0, "safe_files": 0, "intra_op": 0, "_cpp_cache": 0, "_build": 0, "observe": 0,
    "transport": 1,
    "wire": 2,
    "launch": 3,
    "rpc": 4,
    "autograd": 5,
    "optim": 6, "nn": 6, "trace": 6, "graph": 6,
    "demo": 7, "cli": 7, "testing": 7, "__main__": 7, "": 7,
}

# calls whose first argument, a literal module name, is an import all the same
_BY_NAME = {"import_module", "__import__", "find_spec"}


def module_name(root: Path, path: Path) -> str:
    """``distgrad/rpc/agent.py`` -> ``distgrad.rpc.agent``; a package's ``__init__.py``
    -> the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit(name: str) -> str:
    """The top-level module or package of distgrad a module belongs to ("" for the package)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_module(root: Path, name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_sys_modules(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and \
        isinstance(node.value, ast.Name) and node.value.id == "sys"


def _relative(name: str, package: list[str]) -> str:
    """``..autograd`` from package ``distgrad.rpc`` -> ``distgrad.autograd``."""
    level = len(name) - len(name.lstrip("."))
    rest = name[level:]
    return ".".join(package[:len(package) - (level - 1)] + ([rest] if rest else []))


def _package_arg(node: ast.Call, here: list[str]) -> list[str] | None:
    """The package an ``import_module(name, package)`` call resolves a relative name in:
    a literal, or this module's own (``__package__``, ``__name__``)."""
    arg = node.args[1] if len(node.args) > 1 else next(
        (k.value for k in node.keywords if k.arg == "package"), None)
    if arg is None:
        return None
    if _literal(arg):
        return _literal(arg).split(".")
    if isinstance(arg, ast.Name) and arg.id in ("__package__", "__name__"):
        return here
    return None


def _dotted(node: ast.AST) -> str | None:
    """``distgrad.autograd.backward`` for the expression ``distgrad.autograd.backward``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def _deepest_module(root: Path, dotted: str) -> str:
    """The longest prefix of ``dotted`` that is a module of the package."""
    parts = dotted.split(".")
    for n in range(len(parts), 1, -1):
        if _is_module(root, ".".join(parts[:n])):
            return ".".join(parts[:n])
    return parts[0]


def imports(root: Path, path: Path) -> list[tuple[int, str]]:
    """Every module of the package ``path`` imports, with its line: ``import`` and
    ``from`` statements at any depth (relative ones resolved; ``from pkg import sub``
    names the submodule ``sub`` where there is one); names given to
    ``importlib.import_module``/``__import__``/``find_spec`` or looked up in
    ``sys.modules`` (literal, relative ones resolved, or a module-level constant); an
    attribute chain through the package (``distgrad.autograd.backward`` after ``import
    distgrad.rpc``). Names built at run time (``+``, f-strings) are not seen."""
    pkg = root.name
    me = module_name(root, path)
    here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out = []
    tree = ast.parse(path.read_text(), str(path))
    consts = {t.id: v.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)
              for v in [n.value] if isinstance(v, ast.Constant) and isinstance(v.value, str)}

    def named(arg: ast.AST) -> str | None:
        if _literal(arg):
            return _literal(arg)
        if isinstance(arg, ast.Name):
            return consts.get(arg.id)
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            dotted = _dotted(node)
            if dotted and dotted.startswith(pkg + "."):
                out.append((node.lineno, _deepest_module(root, dotted)))

        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if target.split(".")[0] == pkg and _is_module(root, sub)
                            else target))
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            by_name = name in _BY_NAME or (name == "get" and _is_sys_modules(getattr(f, "value", None)))
            target = named(node.args[0]) if by_name else None
            if target and target.startswith("."):
                package = _package_arg(node, here)
                target = _relative(target, package) if package else None
            if target:
                out.append((node.lineno, target))
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value) and named(node.slice):
            out.append((node.lineno, named(node.slice)))
    return [(line, t) for line, t in out if t == pkg or t.startswith(pkg + ".")]


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def arrows(root: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, from unit, to unit) for every import between two units (once per line)."""
    out: dict[tuple[str, int, str, str], None] = {}
    for path in modules(root):
        src = unit(module_name(root, path))
        for line, target in imports(root, path):
            if unit(target) != src:
                out[(str(path.relative_to(root.parent)), line, src, unit(target))] = None
    return list(out)


def upward(root: Path, floors: dict[str, int]) -> list[str]:
    """Each import from a lower floor to a higher one, as ``file:line: ...``."""
    return [f"{f}:{line}: {src or 'distgrad'} (floor {floors[src]}) imports "
            f"{dst or 'distgrad'} (floor {floors[dst]}), a floor above it"
            for f, line, src, dst in arrows(root)
            if src in floors and dst in floors and floors[dst] > floors[src]]


def circles(root: Path) -> list[str]:
    """Each circle of imports between units (strongly connected components of more than
    one unit), with one import of each of its arrows."""
    where: dict[tuple[str, str], str] = {}
    graph: dict[str, set[str]] = {}
    for f, line, src, dst in arrows(root):
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
        where.setdefault((src, dst), f"{f}:{line}")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                members = set(comp)
                edges = sorted(f"{a or 'distgrad'} -> {b or 'distgrad'} ({where[a, b]})"
                               for a in members for b in graph[a] if b in members)
                found.append("a circle of imports: " + "; ".join(edges))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_floor():
    units = {unit(module_name(PACKAGE, p)) for p in modules(PACKAGE)}
    missing = sorted(units - set(FLOORS))
    assert not missing, f"give these top-level modules of distgrad/ a floor in FLOORS: {missing}"
    stale = sorted(set(FLOORS) - units)
    assert not stale, f"FLOORS names modules distgrad/ no longer has: {stale}"


def test_no_import_points_up():
    found = upward(PACKAGE, FLOORS)
    assert not found, "imports that point up a floor (see this file's docstring):\n" + "\n".join(found)


def test_no_circle_between_units():
    found = circles(PACKAGE)
    assert not found, "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """The reader on a small package: each kind of upward arrow is found, with its file
    and line, and a circle between two units of one floor too."""
    root = tmp_path / "distgrad"
    files = {
        "__init__.py": "from . import low, high\n",
        "low/__init__.py": "",
        "low/a.py": textwrap.dedent("""\
            import sys


            def f():
                from ..high import x          # lazy and relative
                import distgrad.high.x        # absolute
                import importlib
                importlib.import_module("distgrad.high.x")
                return sys.modules.get("distgrad.high"), sys.modules["distgrad.high.x"]
            """),
        "low/b.py": "from distgrad import side\nfrom . import a\n",
        "side.py": "from distgrad.low import b\n",
        "high/__init__.py": "",
        "high/x.py": "from ..low import a\nfrom distgrad import low\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    floors = {"": 9, "low": 1, "side": 1, "high": 2}
    found = upward(root, floors)
    a_py = os.path.join("distgrad", "low", "a.py") + ":"
    assert [s.split(":")[1] for s in found if s.startswith(a_py)] == ["5", "6", "8", "9"], found
    assert all("low (floor 1) imports high (floor 2)" in s for s in found), found
    assert len(found) == 4, found           # high -> low and the package -> anything: down
    (circle,) = circles(root)
    assert "low -> side (distgrad/low/b.py:1)" in circle, circle
    assert "side -> low (distgrad/side.py:1)" in circle, circle


def test_names_given_at_run_time_and_attribute_chains_are_seen(tmp_path):
    """The reaches an import statement does not show (the audit of the move): a relative
    name given to import_module with this package or a literal one, find_spec, a
    module-level constant looked up in sys.modules, an attribute chain through the
    package after importing another part of it."""
    root = tmp_path / "distgrad"
    files = {
        "__init__.py": "", "high/__init__.py": "", "high/x.py": "",
        "low/__init__.py": "",
        "low/a.py": textwrap.dedent("""\
            import importlib
            import importlib.util
            import sys

            import distgrad.low

            NAME = "distgrad.high"


            def f():
                importlib.import_module(".high", "distgrad")
                importlib.import_module("..high.x", package=__package__)
                importlib.util.find_spec("distgrad.high.x")
                sys.modules.get(NAME)
                return distgrad.high.x.thing
            """),
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    found = upward(root, {"": 9, "low": 1, "high": 2})
    assert sorted(int(s.split(":")[1]) for s in found) == [11, 12, 13, 14, 15], found


@pytest.mark.parametrize("source, expected", [
    ("from distgrad import rpc\n", "distgrad.rpc"),
    ("from distgrad import info\n", "distgrad"),
    ("from .rpc import agent\n", "distgrad.rpc.agent"),
    ("from . import __version__\n", "distgrad"),
])
def test_a_from_import_names_the_submodule_where_there_is_one(tmp_path, source, expected):
    root = tmp_path / "distgrad"
    (root / "rpc").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "rpc" / "__init__.py").write_text("")
    (root / "rpc" / "agent.py").write_text("")
    (root / "mod.py").write_text(source)
    assert imports(root, root / "mod.py") == [(1, expected)]
