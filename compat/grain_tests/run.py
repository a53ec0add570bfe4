"""Runs the unit tests shipped in Google Grain's wheel on grain_core (or, with
``--reference``, on Grain itself, installed in the running interpreter).

    python compat/grain_tests/run.py [--wheel PATH] [--reference] [--only NAME ...] [-- pytest args]

Without ``--wheel`` the wheel is fetched with ``pip download grain==0.2.18`` into
``~/.cache/grain_core/grain-wheel``. The test modules of the Dataset API, its
transformations, the DataLoader, samplers and sources are extracted into a temporary
directory and run by pytest with the ``grain_paths`` plugin (Grain's module paths onto
grain_core, the expected failures of ``expected_failures.py`` marked ``xfail(strict=True)``):
the run is green when every other test passes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["GRAIN_VERSION", "TEST_MODULES", "main"]

GRAIN_VERSION = "0.2.18"
HERE = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "grain_core" / "grain-wheel"

_PY = "grain/_src/python"
#: The test modules run: the Dataset API, transformations, DataLoader, samplers, sources.
TEST_MODULES = (
    f"{_PY}/dataset/base_test.py",
    f"{_PY}/dataset/dataset_test.py",
    f"{_PY}/dataset/elastic_iterator_test.py",
    f"{_PY}/dataset/sources/parquet_dataset_test.py",
    f"{_PY}/dataset/sources/tfrecord_dataset_test.py",
    *(
        f"{_PY}/dataset/transformations/{name}_test.py"
        for name in (
            "autotune",
            "batch",
            "cache",
            "filter",
            "flatmap",
            "interleave",
            "limit",
            "map",
            "mix",
            "packing_concat_then_split",
            "packing",
            "prefetch_autotune",
            "prefetch",
            "process_prefetch",
            "rebatch",
            "repeat",
            "shuffle",
            "slice",
            "source",
            "zip",
        )
    ),
    f"{_PY}/data_loader_test.py",
    f"{_PY}/data_sources_test.py",
    f"{_PY}/load_test.py",
    f"{_PY}/operations_test.py",
    f"{_PY}/options_test.py",
    f"{_PY}/record_test.py",
    f"{_PY}/samplers_test.py",
    "grain/_src/core/sharding_test.py",
    "grain/_src/core/transforms_test.py",
)


def fetch_wheel() -> Path:
    """Returns Grain's wheel for this interpreter, downloading it once into ``CACHE``.

    Raises:
      subprocess.CalledProcessError: if pip cannot download it.
    """
    found = sorted(CACHE.glob(f"grain-{GRAIN_VERSION}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "-d", str(CACHE), f"grain=={GRAIN_VERSION}"],
            check=True,
        )  # fmt: skip
        found = sorted(CACHE.glob(f"grain-{GRAIN_VERSION}-*.whl"))
    return found[-1]


def extract(wheel: Path, root: Path, only: Sequence[str] = ()) -> list[Path]:
    """Extracts Grain's test helpers and test data, and the test modules under
    ``root/suite`` (outside the ``grain`` namespace, which is grain_core's); returns them.

    Args:
      wheel: Grain's wheel.
      root: the folder to extract into.
      only: if given, the test modules whose path contains one of these strings.

    Raises:
      SystemExit: if the wheel lacks a test module, or ``only`` selects none.
    """
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        wanted = [
            n
            for n in names
            if n in TEST_MODULES
            or n.endswith(("testing_util.py", "core/pytest.py", "execution_summary_pb2.py"))
            or "/testdata/" in n
        ]
        archive.extractall(root, wanted)
    missing = sorted(set(TEST_MODULES) - set(names))
    if missing:
        raise SystemExit(f"grain {GRAIN_VERSION}'s wheel lacks {missing}")
    selected = [n for n in TEST_MODULES if not only or any(part in n for part in only)]
    if not selected:
        raise SystemExit(f"no test module of {TEST_MODULES} contains any of {list(only)}")
    modules = []
    for name in selected:
        module = root / "suite" / name.removeprefix("grain/_src/")
        module.parent.mkdir(parents=True, exist_ok=True)
        modules.append((root / name).rename(module))
    return modules


def main() -> int:
    """Runs the suite; returns pytest's exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="Grain's wheel (default: download it)")
    parser.add_argument(
        "--reference", action="store_true", help="run on the installed Google Grain"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only the test modules whose path contains NAME (repeatable), e.g. packing_test",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    wheel = args.wheel or fetch_wheel()
    with tempfile.TemporaryDirectory(prefix="grain-tests-") as tmp:
        root = Path(tmp)
        modules = extract(wheel, root, args.only)
        env = dict(os.environ, GRAIN_TESTS_WHEEL_ROOT=str(root))
        if args.reference:
            env["GRAIN_TESTS_REFERENCE"] = "1"
        # HERE: the plugins and sitecustomize; root: the test modules, for processes that
        # unpickle their functions (``suite.python.data_sources_test``).
        path = [str(HERE), tmp, env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        plugin = ["-p", "reference_flags" if args.reference else "grain_paths"]
        command = [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--import-mode=importlib",
            "--rootdir", tmp, "-c", os.devnull, "-W", "ignore::pytest.PytestAssertRewriteWarning", *plugin, *map(str, modules), *args.pytest_args,
        ]  # fmt: skip
        return subprocess.run(command, env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
