"""The import directions between grain_core's layers, checked on the syntax tree of every
module, imports inside functions included. The layer of each module is the table of
``docs/architecture.md``, parsed here."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grain_core.plugins import DEFAULT_PLUGINS

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "grain_core"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
FORMAT_PLUGINS = [
    ROOT / "plugins" / "grain_arrayrecord" / "grain_arrayrecord",
    ROOT / "plugins" / "grain_parquet" / "grain_parquet",
    ROOT / "plugins" / "grain_tfrecord" / "grain_tfrecord",
    ROOT / "plugins" / "grain_ray" / "grain_ray",
    ROOT / "tests" / "plugin_jsonl" / "grain_jsonl",
]
TRANSPORT = "grain_core._ipc"
ENGINES = "grain_core.dataset.mp"

_FLUENT = "fluent API cycle: the method builds an operator whose module imports base"
#: Imports that point to a layer above their module's, each with its reason. An entry that
#: no longer matches anything fails too, so the list only shrinks.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("grain_core/dataset/base.py", "grain_core.dataset.mp"): (
        f"{_FLUENT} (IterDataset.mp_prefetch)"
    ),
}


def _load_circles_tool() -> Any:
    spec = importlib.util.spec_from_file_location(
        "import_circles", ROOT / "tools" / "import_circles.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: ``tools/import_circles.py``: the import statements of a module, and the circles.
CIRCLES = _load_circles_tool()
_import_statements = CIRCLES.import_statements

#: The reasons an import inside a function may give on its line.
FUNCTION_IMPORT_REASONS = ("# fluent API cycle", "# optional dependency", "# import cost")


@dataclasses.dataclass(frozen=True)
class Import:
    """One module an ``import`` statement reaches, and where.

    Attributes:
      path: The importing file.
      line: The statement's first line.
      target: The module reached.
      in_function: Whether the statement is inside a function.
      runs: False under ``if TYPE_CHECKING:``, which never runs.
      package_of_module: True for ``m`` in ``from m import a`` where ``m.a`` is a module: a
        parent package that Python runs on the way, not a module the statement names.
    """

    path: Path
    line: int
    target: str
    in_function: bool = False
    runs: bool = True
    package_of_module: bool = False


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
    for node, in_function, runs in _import_statements(tree):
        where = {"in_function": in_function, "runs": runs}
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, alias.name, **where)
            continue
        module = node.module or ""
        if node.level:
            base = (package or _module_name(path)).split(".")
            base = base[: len(base) - node.level + 1]
            module = ".".join([*base, module] if module else base)
        submodules = [f"{module}.{alias.name}" for alias in node.names]
        submodules = [s for s in submodules if s.startswith("grain_core.") and _is_core_module(s)]
        named_only_modules = len(submodules) == len(node.names)
        yield Import(path, node.lineno, module, **where, package_of_module=named_only_modules)
        for sub in submodules:
            yield Import(path, node.lineno, sub, **where)


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


def test_importing_the_profiler_loads_no_engine_module() -> None:
    # Its advice on worker processes comes from dataset/transfer_cost.py, not the engines.
    code = (
        "import sys\n"
        "import grain_core.observe.profile\n"
        f"print(sorted(m for m in sys.modules if m.startswith({ENGINES!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


# The layer table.


@dataclasses.dataclass(frozen=True)
class Layer:
    """One row of the layer table: its core modules (dotted names) and the layers it may
    import besides its own."""

    name: str
    modules: tuple[str, ...]
    may_import: frozenset[str]


def _core_module_of(relative: str) -> str:
    """``grain_core.dataset.mp`` for ``dataset/mp/__init__.py``."""
    parts = ["grain_core", *Path(relative).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _table_rows() -> list[tuple[str, str, str]]:
    """The cells (layer, modules, may import) of ``docs/architecture.md``'s layer table."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers, bottom to top", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    cells = []
    for row in rows:
        layer, modules, may_import = (cell.strip() for cell in row.strip("| ").split(" | "))
        cells.append((layer, modules, may_import))
    return cells


def _layer_table() -> list[Layer]:
    """The rows of ``docs/architecture.md``'s layer table that hold core modules (``*.py``
    paths relative to ``grain_core/``), bottom to top."""
    layers = []
    for name, modules, may_import in _table_rows():
        paths = [p for p in re.findall(r"`([^`]+)`", modules) if p.endswith(".py")]
        if paths:
            allowed = frozenset(n.strip() for n in may_import.split(","))
            layers.append(Layer(name, tuple(_core_module_of(p) for p in paths), allowed))
    return layers


def _layer_of() -> dict[str, Layer]:
    return {module: layer for layer in _layer_table() for module in layer.modules}


def _core_module_names() -> set[str]:
    return {_module_name(path) for path in _sources(CORE)}


def test_every_core_module_is_in_the_layer_table_once() -> None:
    listed = [module for layer in _layer_table() for module in layer.modules]
    assert sorted(m for m in set(listed) if listed.count(m) > 1) == []
    assert sorted(_core_module_names() - set(listed)) == [], "add it to docs/architecture.md"
    assert sorted(set(listed) - _core_module_names()) == [], "remove it from the table"


def test_the_table_names_every_first_party_plugin_package() -> None:
    named = {n for row in _table_rows() for n in re.findall(r"`(grain_[a-z_]+)`", row[1])}
    on_disk = {p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()}
    assert named == on_disk
    assert {p.name for p in FORMAT_PLUGINS if p.is_relative_to(ROOT / "plugins")} == on_disk


def test_the_default_plugins_belong_to_the_dataset_layer() -> None:
    # The plugin manager imports them by name; the table says where they sit.
    layer_of = _layer_of()
    assert {layer_of[module].name for module in DEFAULT_PLUGINS.values()} == {"Dataset"}


def test_observability_imports_of_the_dataset_only_its_base_types() -> None:
    # Neither an operator nor an engine: the dataset and the engines ask a PipelineObserver.
    # transfer_cost imports no dataset module: the profiler prices worker processes with the
    # model the engines' in-process decision uses, without loading the engines.
    base_types = {
        "grain_core.dataset.iterator",
        "grain_core.dataset.base",
        "grain_core.dataset.options",
        "grain_core.dataset.transfer_cost",
    }
    # Every module of observe/ sits in the Observability row and is checked.
    paths = _sources(CORE / "observe")
    observe = next(layer for layer in _layer_table() if layer.name == "Observability")
    assert {_module_name(p) for p in paths} <= set(observe.modules)

    def allowed(imp: Import) -> bool:
        if imp.package_of_module or not _within(imp.target, "grain_core.dataset"):
            return True
        return imp.target in base_types

    assert _violations(paths, allowed) == []
    cost_model = CORE / "dataset" / "transfer_cost.py"
    assert (
        _violations([cost_model], lambda imp: not _within(imp.target, "grain_core.dataset")) == []
    )


def test_every_layer_a_row_may_import_is_a_row_below_it() -> None:
    layers = _layer_table()
    for position, layer in enumerate(layers):
        assert layer.may_import <= {below.name for below in layers[: position + 1]}, layer.name


def _module_imported(imp: Import, modules: set[str]) -> str | None:
    """The core module ``imp`` reaches (``m`` for a name ``m.x`` that is not a module), or
    None outside grain_core."""
    target = imp.target
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def test_no_module_imports_a_layer_above_its_own() -> None:
    layer_of = _layer_of()
    modules = set(layer_of)

    def allowed(imp: Import) -> bool:
        if not imp.runs or imp.package_of_module:
            return True
        target = _module_imported(imp, modules)
        if target is None:
            return True
        own = layer_of[_module_name(imp.path)]
        return layer_of[target] is own or layer_of[target].name in own.may_import

    assert _violations(_sources(CORE), allowed) == []


def test_the_layer_check_sees_an_upward_import() -> None:
    # A test of the test: the engines' package is above the dataset layer, the import in
    # ``IterDataset.mp_prefetch`` is seen as one into it, and the exception is what lets it be.
    layer_of = _layer_of()
    assert layer_of[ENGINES].name != layer_of["grain_core.dataset.base"].name
    assert layer_of[ENGINES].name not in layer_of["grain_core.dataset.base"].may_import
    base = [i for i in _imports(CORE / "dataset" / "base.py") if i.target == ENGINES]
    assert base and all(i.in_function and i.runs for i in base)
    assert ("grain_core/dataset/base.py", ENGINES) in KNOWN_EXCEPTIONS


def test_upward_exceptions_are_base_fluent_api_or_name_the_issue_that_removes_them() -> None:
    for (path, _), reason in KNOWN_EXCEPTIONS.items():
        assert (
            reason.startswith(_FLUENT)
            if path == "grain_core/dataset/base.py"
            else "issue" in reason
        )


# Imports inside functions.


def test_every_import_inside_a_function_says_why_on_its_line() -> None:
    paths = [*_sources(CORE), *(p for top in FORMAT_PLUGINS for p in _sources(top))]
    unexplained = []
    for path in paths:
        lines = path.read_text().splitlines()
        for node, in_function, _ in _import_statements(ast.parse("\n".join(lines), str(path))):
            if not in_function:
                continue
            line = lines[node.lineno - 1]
            reasons = [r for r in FUNCTION_IMPORT_REASONS if r in line]
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if not reasons:
                unexplained.append(f"{where}: {line.strip()}")
            elif reasons == ["# fluent API cycle"] and path != CORE / "dataset" / "base.py":
                unexplained.append(f"{where}: a fluent API cycle is base.py's alone")
    assert unexplained == []


def test_the_checker_tells_function_and_type_checking_imports_apart() -> None:
    # A test of the test, on a module of each kind of import.
    source = (
        "import a\n"
        "if TYPE_CHECKING:\n"
        "    import b\n"
        "else:\n"
        "    import c\n"
        "def f():\n"
        "    import d\n"
        "    if TYPE_CHECKING:\n"
        "        import e\n"
        "class K:\n"
        "    def m(self):\n"
        "        g = lambda: __import__('x')\n"
        "        import h\n"
    )
    found = {
        node.names[0].name: (in_function, runs)
        for node, in_function, runs in _import_statements(ast.parse(source))
        if isinstance(node, ast.Import)
    }
    assert found == {
        "a": (False, True),
        "b": (False, False),
        "c": (False, True),
        "d": (True, True),
        "e": (True, False),
        "h": (True, True),
    }


# Circles.


def test_the_only_import_circle_is_inside_the_dataset_layer() -> None:
    # The plugin manager, the front ends and the command-line tools import one way.
    circles = CIRCLES.circles(CIRCLES.import_graph(CORE))
    assert len(circles) == 1
    assert [m for m in circles[0] if not _within(m, "grain_core.dataset")] == []


def _engine_modules() -> list[str]:
    return [m for m, layer in _layer_of().items() if layer.name == "Engines"]


def test_the_engines_import_no_dataset_node() -> None:
    # The engines build on the runtime's low types (dataset/iterator.py); the nodes they run
    # (worker shares, the dispatch view, the position reader) are built on the dataset side
    # and handed to them (EngineInput.nodes). So no engine imports base, an operator,
    # prefetch, worker_slicing, with_options or the engines' facade, but for annotations.
    layer_of = _layer_of()
    modules = set(layer_of)
    engines = _engine_modules()
    assert engines and all(m.startswith(ENGINES + ".") for m in engines)
    above = {"Dataset", "Parallel execution", "Front ends"}
    found = []
    for module in engines:
        path = ROOT / (module.replace(".", "/") + ".py")
        for imp in _imports(path):
            target = _module_imported(imp, modules)
            if not imp.runs or imp.package_of_module or target is None:
                continue
            key = (str(path.relative_to(ROOT)), target)
            if layer_of[target].name in above and key not in KNOWN_EXCEPTIONS:
                found.append(f"{key[0]}:{imp.line} -> {target}")
    assert found == []


def test_the_one_circle_holds_no_engine_and_not_the_runtime_types() -> None:
    # IterDataset.mp_prefetch reaches the engines' facade, which imports the engines; no
    # engine imports back into the fluent layer, so the circle is the fluent API's alone.
    circles = CIRCLES.circles(CIRCLES.import_graph(CORE))
    assert len(circles) == 1
    in_circle = set(circles[0])
    assert in_circle & {*_engine_modules(), "grain_core.dataset.iterator"} == set()
    assert {"grain_core.dataset.base", ENGINES} <= in_circle
    assert len(in_circle) <= 27


def test_the_circle_tool_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.c import x\n")
    (package / "c.py").write_text("import pkg.a\nif TYPE_CHECKING:\n    import pkg.d\n")
    (package / "d.py").write_text("import pkg.c\n")
    assert CIRCLES.circles(CIRCLES.import_graph(package)) == [["pkg.a", "pkg.b", "pkg.c"]]
