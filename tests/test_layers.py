"""The import directions between grain_core's layers (``docs/architecture.md``), checked on the
syntax tree of every module, imports inside functions included."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "grain_core"
FORMAT_PLUGINS = [
    ROOT / "plugins" / "grain_arrayrecord" / "grain_arrayrecord",
    ROOT / "plugins" / "grain_parquet" / "grain_parquet",
    ROOT / "plugins" / "grain_tfrecord" / "grain_tfrecord",
    ROOT / "plugins" / "grain_ray" / "grain_ray",
    ROOT / "tests" / "plugin_jsonl" / "grain_jsonl",
]
TRANSPORT = "grain_core._ipc"
ENGINES = "grain_core.dataset.mp"

#: Imports that break a rule today, each with the work that removes it. An entry that no
#: longer matches anything fails too, so the list only shrinks.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclasses.dataclass(frozen=True)
class Import:
    """One module an ``import`` statement reaches, and where."""

    path: Path
    line: int
    target: str


def _module_name(path: Path) -> str:
    """``grain_core.dataset.mp.rotation`` for ``grain_core/dataset/mp/rotation.py``."""
    top = next(p for p in (CORE, *FORMAT_PLUGINS) if path.is_relative_to(p))
    parts = [top.name, *path.relative_to(top).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_core_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (ROOT / relative).with_suffix(".py").is_file() or (ROOT / relative).is_dir()


def _sources(top: Path) -> list[Path]:
    return sorted(top.rglob("*.py"))


def _imports(path: Path) -> Iterator[Import]:
    """Every module ``path`` imports, anywhere in it: for ``from m import a``, ``m`` and, if it
    is a module of grain_core, ``m.a``."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = (package or _module_name(path)).split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            yield Import(path, node.lineno, module)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub.startswith("grain_core.") and _is_core_module(sub):
                    yield Import(path, node.lineno, sub)


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    found = set()
    for node in nodes:
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            found.add(id(body[0].value))
    return found


def _violations(paths: list[Path], allowed: object) -> list[str]:
    """``path:line -> target`` for every import of ``paths`` that ``allowed(import)`` refuses,
    less the known exceptions (each of which must still occur)."""
    found = []
    for path in paths:
        for imp in _imports(path):
            if allowed(imp):  # type: ignore[operator]
                continue
            key = (str(path.relative_to(ROOT)), imp.target)
            if key in KNOWN_EXCEPTIONS:
                continue
            found.append(f"{key[0]}:{imp.line} -> {imp.target}")
    return found


def test_the_transport_imports_nothing_above_it() -> None:
    def allowed(imp: Import) -> bool:
        if not _within(imp.target, "grain_core"):
            return True
        return _within(imp.target, TRANSPORT) or _within(imp.target, "grain_core.config")

    assert _violations(_sources(CORE / "_ipc"), allowed) == []


def test_the_transport_names_no_grain_core_module_in_a_string() -> None:
    # A module named in a string (a preload list, an import by name) is an import too.
    named = []
    for path in _sources(CORE / "_ipc"):
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and "grain_core." in node.value
            ):
                named.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert named == []


def test_the_dataset_layer_knows_no_loader_checkpoint_handler_or_plugin_internals() -> None:
    refused = ("grain_core.checkpoint", "grain_core.data_loader", "grain_core.plugins._")

    def allowed(imp: Import) -> bool:
        return not any(
            imp.target.startswith(r) if r.endswith("_") else _within(imp.target, r) for r in refused
        )

    assert _violations(_sources(CORE / "dataset"), allowed) == []


@pytest.mark.parametrize(("engine", "other"), [("rotation", "dispatch"), ("dispatch", "rotation")])
def test_the_two_engines_never_import_each_other(engine: str, other: str) -> None:
    path = CORE / "dataset" / "mp" / f"{engine}.py"
    forbidden = f"{ENGINES}.{other}"
    assert _violations([path], lambda imp: not _within(imp.target, forbidden)) == []


def test_only_the_engine_folder_imports_its_modules() -> None:
    outside = [p for p in _sources(CORE) if not p.is_relative_to(CORE / "dataset" / "mp")]
    for top in FORMAT_PLUGINS:
        outside += _sources(top)

    def allowed(imp: Import) -> bool:
        return not imp.target.startswith(ENGINES + ".")

    assert _violations(outside, allowed) == []


def _public(module: str) -> bool:
    """grain_core's public modules: the package and its top-level modules and subpackages
    without a leading underscore, but for ``grain_core.dataset`` (the implementation, reached
    through ``grain_core`` and ``grain_core.experimental``)."""
    parts = module.split(".")
    return not any(p.startswith("_") for p in parts) and (len(parts) < 2 or parts[1] != "dataset")


def test_format_plugins_import_only_public_core_modules() -> None:
    def allowed(imp: Import) -> bool:
        return not _within(imp.target, "grain_core") or _public(imp.target)

    paths = [p for top in FORMAT_PLUGINS for p in _sources(top)]
    assert _violations(paths, allowed) == []


def test_every_known_exception_still_occurs() -> None:
    # A fixed exception leaves the list, so that it cannot come back unnoticed.
    paths = [*_sources(CORE), *(p for top in FORMAT_PLUGINS for p in _sources(top))]
    occurring = {(str(i.path.relative_to(ROOT)), i.target) for p in paths for i in _imports(p)}
    assert set(KNOWN_EXCEPTIONS) <= occurring


def test_the_checker_sees_every_import() -> None:
    # A test of the test: submodules named in ``from`` imports, and imports inside functions.
    assert "grain_core._ipc.shm" in {imp.target for imp in _imports(CORE / "_ipc" / "pool.py")}
    base = {imp.target for imp in _imports(CORE / "dataset" / "base.py")}
    assert ENGINES in base  # IterDataset.mp_prefetch imports it in the method


def test_importing_the_transport_loads_no_dataset_module() -> None:
    code = (
        "import sys\n"
        "import grain_core._ipc.errors, grain_core._ipc.pool, grain_core._ipc.shm\n"
        "print(sorted(m for m in sys.modules if m.startswith('grain_core.dataset')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
