"""The multi-package test matrix.

``nox`` runs every default session: ``tests-core`` (grainpipe alone, zero plugins),
``tests-<plugin>`` for each ``plugins/<dir>/pyproject.toml`` in this checkout (core + that
plugin), ``tests-all`` (every package, JAX, Orbax and the test plugin), ``lint`` and
``typecheck``. ``nox -s bench`` runs the benchmarks beside Google Grain; ``nox -s
tests-remote`` runs only the object-storage tests (against moto's S3 server, which they start).

Test selection is by installed packages, not by markers: tests of plugin ``x`` live in
``tests/test_<x>*.py`` and start with ``pytest.importorskip("grain_<x>")``, so
``tests-core`` runs the whole suite and they skip there. Extra arguments go to pytest:
``nox -s tests-core -- -k sharding``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"

ROOT = Path(__file__).resolve().parent
TEST_PLUGIN = ROOT / "tests" / "plugin_jsonl"
# Plugin distributions in this checkout, by short name: plugins/grain_parquet -> "parquet".
PLUGINS = {
    path.parent.name.removeprefix("grain_"): path.parent
    for path in sorted(ROOT.glob("plugins/*/pyproject.toml"))
}
# Tools whose output must not change under us; the versions of the dev environment.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"


def _pytest(session: nox.Session, *paths: str) -> None:
    # Exit status 5 (nothing collected) fails the session: every session selects at least
    # tests/test_plugins.py, so an empty run means the selection is broken.
    session.run("pytest", *(session.posargs or paths))


@nox.session(name="tests-core")
def tests_core(session: nox.Session) -> None:
    """grainpipe (the core) alone: imports and works with zero plugins; plugin names give install hints."""
    session.install(".[test]")
    _pytest(session, "tests")


def _plugin_session(name: str, directory: Path) -> None:
    @nox.session(name=f"tests-{name}")
    def tests_plugin(session: nox.Session) -> None:
        session.install(".[test]", str(directory))
        own_tests = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(f"tests/test_{name}*.py"))
        _pytest(session, "tests/test_plugins.py", *own_tests)

    tests_plugin.__doc__ = f"the core + {directory.name}: its tests and the registry's."


for _name, _directory in PLUGINS.items():
    _plugin_session(_name, _directory)


@nox.session(name="tests-all")
def tests_all(session: nox.Session) -> None:
    """Every package, JAX (CPU), Orbax and the third-party test plugin: the whole suite."""
    plugins = [str(d) for d in PLUGINS.values()]
    session.install(
        ".[test,jax,progress,report,remote]", *plugins, str(TEST_PLUGIN), "orbax-checkpoint"
    )
    _ensure_chromium(session)
    _pytest(session, "tests")


def _ensure_chromium(session: nox.Session) -> None:
    """Installs Debian's chromium, which tests/test_profiling.py opens the HTML report in,
    where it is missing and apt-get can run (as root); elsewhere that test skips, saying why."""
    if shutil.which("chromium") or not shutil.which("apt-get") or os.geteuid() != 0:
        return
    session.run("apt-get", "install", "-y", "-q", "chromium", external=True, success_codes=[0, 100])


@nox.session(name="tests-remote", default=False)
def tests_remote(session: nox.Session) -> None:
    """Object storage end to end: the tests start moto's S3 server on 127.0.0.1 themselves
    (``tests-all`` runs the same tests, so the default run does not repeat them)."""
    plugins = [str(d) for d in PLUGINS.values()]
    session.install(".[test,remote]", *plugins, "orbax-checkpoint")
    remote = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_remote*.py"))
    _pytest(session, "tests/test_storage.py", *remote)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over grain_core and the three format plugins, with only the core's own
    dependencies installed (array_record, pyarrow and crc32c have no type information)."""
    session.install(".", MYPY)
    session.run("mypy")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks with every package and Google's grain installed side by side."""
    plugins = [str(d) for d in PLUGINS.values()]
    session.install(".[jax,progress,remote]", *plugins, str(TEST_PLUGIN), "grain")
    session.install("moto[server]", "s3fs")  # bench_remote.py's loopback S3 server
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session(name="bench-tf", default=False)
def bench_tf(session: nox.Session) -> None:
    """The tf.train.Example workloads with tf.data as a peer (tensorflow-cpu in this session's
    virtualenv only, never a dependency of a package)."""
    session.install(".", str(PLUGINS["tfrecord"]), "protobuf>=4.21", "tensorflow-cpu")
    session.run(
        "python",
        "benchmarks/run.py",
        "--only",
        "example_parse_batch,example_decode_long_floats,example_decode_long_ints",
        *session.posargs,
    )
