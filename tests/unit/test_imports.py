"""The layers' arrows, read from the sources with `ast` (nothing is imported): the plugin
(`libra_ext`) never imports the training app (`megatron.libra`); no module imports itself back
through others; and a module imports what it needs at its top, except where a function defers
an import for a reason it states (`# deferred: ...` or `# optional: ...` on the import or the
line above it: an optional dependency, or the torch-free start of the `libra` command)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("libra_ext", "megatron/libra")
REASON = re.compile(r"#\s*(deferred|optional):\s*\S")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The project module an imported name lives in (None: not the project's)."""
    hits = [m for m in MODULES if name == m or name.startswith(m + ".")]
    return max(hits, key=len) if hits else None


def _imports(path: Path):
    """(import node, the function it sits in or None) of every import of a module."""
    tree = ast.parse(path.read_text())
    owner = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    owner.setdefault(id(node), fn)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, owner.get(id(node))


def _edges(module: str, node) -> set[str]:
    """The project modules an import statement reaches (`from pkg import submodule` reaches the
    submodule, a name defined in pkg reaches pkg)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: resolved against the importing module's package
            parts = module.split(".")
            keep = parts[: len(parts) - node.level + (1 if MODULES[module].name == "__init__.py"
                                                      else 0)]
            base = ".".join(keep + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                 for a in node.names]
    return {t for t in map(_target, names) if t is not None and t != module}


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node, _ in _imports(path):
            graph[module] |= _edges(module, node)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_plugin_never_imports_the_training_app():
    upward = sorted((m, t) for m, targets in _graph().items() if m.startswith("libra_ext")
                    for t in targets if t.startswith("megatron."))
    assert upward == []


def test_no_module_imports_itself_back_through_others():
    assert _cycles(_graph()) == []


def test_a_deferred_import_says_why():
    unexplained = []
    for module, path in MODULES.items():
        lines = path.read_text().split("\n")
        by_function: dict = {}
        for node, fn in _imports(path):
            if fn is not None:
                by_function.setdefault(fn.name + f"@{fn.lineno}", []).append(node)
        for where, nodes in by_function.items():
            said = any(REASON.search(lines[n.lineno - 1]) or
                       (n.lineno >= 2 and REASON.search(lines[n.lineno - 2])) for n in nodes)
            if not said:
                unexplained.append(f"{module}:{nodes[0].lineno} ({where.split('@')[0]})")
    assert unexplained == []


def test_the_graph_reader_sees_a_cycle_and_an_upward_arrow():
    # the checks above are only as good as the reader: it must see what they look for
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse("from megatron.libra import steps\nimport libra_ext.planner\n")
    reached = set().union(*(_edges("libra_ext.workload", n) for n in tree.body))
    assert reached == {"megatron.libra.steps", "libra_ext.planner"}


def test_the_cpp_headers_include_no_cycle():
    graph = {}
    for header in (ROOT / "cpp" / "include" / "libra").glob("*.h"):
        graph[header.name] = set(re.findall(r'#include "libra/(\w+\.h)"', header.read_text()))
    assert _cycles(graph) == []
