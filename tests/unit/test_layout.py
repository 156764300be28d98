"""The import graph of `trace_common` and `services`: no cycles; the FP4 numerics
(`trace_common/fp4`) import nothing of `trace_common` outside themselves; the RL core
(`trace_common/rl`) imports neither the run configuration that is built from its parts
(`trace_common/config.py`) nor the local launcher above both (`trace_common/launch`).

The graph is read from the source with `ast`, so it sees every import statement: module level,
inside functions, and under `if TYPE_CHECKING:`. `from a.b import c` is an edge to `a.b.c` when
that is a module, else to `a.b`; importing a module does not add edges to its parent packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trace_common", "services")
FP4 = "trace_common.fp4"


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of `packages` under `root`."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of our modules (None for an outside import)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The package a (possibly relative) `from ... import` names."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports."""
    modules = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path, node)
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges.update(
                t for t in (_resolve(n, modules) for n in names) if t not in (None, module)
            )
        graph[module] = edges  # type: ignore[assignment]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Module-level, function-level, relative and TYPE_CHECKING imports are edges, and a cycle
    through them is found (a small package written for the test)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "from . import c\n",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "d.py": "import os\nfrom pkg.a import f\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert len(import_graph()) > 100, "the real tree: too few modules found"


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (each line: the modules of one cycle):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_fp4_imports_nothing_above_it() -> None:
    graph = import_graph()
    upward = {
        m: sorted(t for t in targets if _in(t, "trace_common") and not _in(t, FP4))
        for m, targets in graph.items()
        if _in(m, FP4)
    }
    upward = {m: t for m, t in upward.items() if t}
    assert not upward, f"trace_common.fp4 modules importing trace_common outside fp4: {upward}"


def test_rl_core_imports_neither_the_run_config_nor_the_launcher() -> None:
    above = ("trace_common.config", "trace_common.launch")
    upward = {
        m: sorted(t for t in targets if any(_in(t, a) for a in above))
        for m, targets in import_graph().items()
        if _in(m, "trace_common.rl")
    }
    upward = {m: t for m, t in upward.items() if t}
    assert not upward, f"trace_common.rl modules importing {above}: {upward}"


def test_wire_and_stores_stay_below_the_clients_and_the_rl_core() -> None:
    """The wire formats import only themselves; the stores' code only the wire formats and the
    service runtime (errors, settings): neither knows of clients, models, the RL core or the
    launcher, so a store can be read and tested on its own."""
    allowed = {
        "trace_common.wire": ("trace_common.wire",),
        "trace_common.stores": ("trace_common.stores", "trace_common.wire", "trace_common.service"),
    }
    upward = {
        m: sorted(t for t in targets if _in(t, "trace_common") and not any(_in(t, a) for a in ok))
        for floor, ok in allowed.items()
        for m, targets in import_graph().items()
        if _in(m, floor)
    }
    upward = {m: t for m, t in upward.items() if t}
    assert not upward, f"wire/stores modules importing above their floor: {upward}"
