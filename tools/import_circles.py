"""The circles of mutually importing modules in grain_core: strongly connected components of
the graph whose edges are every import of a module, at module level or inside a function.

``python tools/import_circles.py`` prints each circle of two or more modules, biggest first.
Imports under ``if TYPE_CHECKING:`` are left out (they never run). A package is a node (its
``__init__``) where a module imports it or a name from it that is not a module; with
``--packages``, every import also reaches the packages above its target, as Python runs them
(importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``): an upper bound, with the
package ``__init__``s counted.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["circles", "import_graph", "import_statements", "main"]

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path, top: Path) -> str:
    parts = [top.name, *path.relative_to(top).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement of ``tree``, with whether it is inside a function and whether it
    runs (False under ``if TYPE_CHECKING:``)."""

    def walk(node: ast.AST, in_function: bool, runs: bool) -> Iterator[Any]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_function, runs
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(ast.Module(body=child.body, type_ignores=[]), in_function, False)
                yield from walk(ast.Module(body=child.orelse, type_ignores=[]), in_function, runs)
            else:
                function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                yield from walk(child, in_function or function, runs)

    yield from walk(tree, False, True)


def _targets(path: Path, name: str, modules: set[str]) -> Iterator[str]:
    """The modules the imports of ``path`` (module ``name``) that run name."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node, _, runs in import_statements(tree):
        if not runs:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
            continue
        module = node.module or ""
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            module = ".".join([*base, module] if module else base)
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            yield sub if sub in modules else module


def import_graph(top: Path, *, packages: bool = False) -> dict[str, set[str]]:
    """Module → the modules of ``top`` it imports (a package stands for its ``__init__``).

    Args:
      top: The package directory (``grain_core/``).
      packages: Whether an import also reaches every package above its target.
    """
    paths = {_module_name(p, top): p for p in sorted(top.rglob("*.py"))}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, set())
        for target in _targets(path, name, modules):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target:
                continue
            parts = target.split(".")
            reached = [target]
            if packages:
                reached += [".".join(parts[:i]) for i in range(1, len(parts))]
            edges.update(t for t in reached if t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes, biggest first (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=lambda c: (-len(c), c))


def main(argv: list[str] | None = None) -> None:
    """Prints the circles of grain_core's import graph, biggest first."""
    parser = argparse.ArgumentParser(description="The circles of grain_core's import graph.")
    parser.add_argument("--packages", action="store_true", help="count package __init__s")
    args = parser.parse_args(argv)
    for circle in circles(import_graph(ROOT / "grain_core", packages=args.packages)):
        print(f"{len(circle)} modules: {' '.join(circle)}")


if __name__ == "__main__":
    main()
