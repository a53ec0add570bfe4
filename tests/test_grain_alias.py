"""``install_as_grain()``: ``import grain`` and the module paths clients import resolve to
grain_core. Import state is per process, so every test runs a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import grain_core as grain
from grain_core import plugins
from grain_core.grain_alias import ALIAS_ENV


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (without the alias variable unless given)."""
    environment = {k: v for k, v in os.environ.items() if k != ALIAS_ENV}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
    )


def _ok(code: str, cwd: Path, **env: str) -> str:
    result = _python(code, cwd, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _fake_google_grain(root: Path) -> Path:
    """A package named ``grain`` on a path of its own, standing for an installed Google Grain."""
    package = root / "site" / "grain"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("IS_GOOGLE_GRAIN = True\n")
    return package.parent


def test_public_modules_are_grain_cores(tmp_path: Path) -> None:
    _ok(
        """
        import sys
        import grain_core
        grain_core.install_as_grain()
        import grain
        import grain.python
        import grain.python.experimental
        from grain import (checkpoint, constants, experimental, multiprocessing, samplers,
                           sharding, sources, transforms)
        assert grain is grain_core
        assert grain.python is sys.modules["grain_core.python"]
        assert grain.python.experimental is sys.modules["grain_core.python.experimental"]
        for module in (checkpoint, constants, experimental, multiprocessing, samplers,
                       sharding, sources, transforms):
            assert module is sys.modules["grain_core." + module.__name__.split(".")[-1]]
        import grain.experimental as ge
        assert ge is experimental
        assert isinstance(grain.MapDataset.range(3), grain_core.MapDataset)
        """,
        tmp_path,
    )


def test_the_alias_is_found_before_an_installed_grain(tmp_path: Path) -> None:
    site = _fake_google_grain(tmp_path)
    _ok(
        """
        import grain_core
        grain_core.install_as_grain()
        import grain
        assert grain is grain_core, grain
        """,
        tmp_path,
        PYTHONPATH=str(site),
    )


def test_installing_imports_nothing_it_serves(tmp_path: Path) -> None:
    _ok(
        """
        import sys
        import grain_core
        before = set(sys.modules)
        grain_core.install_as_grain()
        new = {m for m in set(sys.modules) - before if m.startswith(("grain", "jax"))}
        assert new == {"grain_core.grain_alias"}, new
        """,
        tmp_path,
    )


def test_keras_shared_memory_paths(tmp_path: Path) -> None:
    _ok(
        """
        import grain_core
        grain_core.install_as_grain()
        from grain._src.python.shared_memory_array import SharedMemoryArrayMetadata as old
        from grain._src.python.ipc.shared_memory_array import SharedMemoryArrayMetadata as new
        from grain_core.multiprocessing import SharedMemoryArrayMetadata
        assert old is new is SharedMemoryArrayMetadata
        """,
        tmp_path,
    )


def test_maxtext_subclasses_of_the_tfrecord_reader_work(tmp_path: Path) -> None:
    """MaxText's gs:// reader skips the base ``__init__`` and hands over a stream it opened;
    the subclasses read, checkpoint and resume."""
    pytest.importorskip("grain_tfrecord")
    out = _ok(
        """
        import grain_core
        grain_core.install_as_grain()
        import grain.python as grain
        from grain._src.python.dataset.sources.tfrecord_dataset import (
            _TFRecordDatasetIterator, _TFRecordReader)
        from grain.experimental import TFRecordIterDataset
        from grain_tfrecord import TFRecordWriter

        with TFRecordWriter("x.tfrecord") as writer:
            for i in range(5):
                writer.write(b"record %d" % i)

        class StreamReader(_TFRecordReader):
            def __init__(self, path):
                self._reader = open(path, "rb")

        class StreamIterator(_TFRecordDatasetIterator):
            def __init__(self, path):
                grain.DatasetIterator.__init__(self)
                self._reader = StreamReader(path)

        class StreamDataset(TFRecordIterDataset):
            def __iter__(self):
                return StreamIterator(self._path)

        it = iter(StreamDataset("x.tfrecord"))
        first = [next(it), next(it)]
        state = it.get_state()
        rest = list(it)
        resumed = iter(StreamDataset("x.tfrecord"))
        resumed.set_state(state)
        assert list(resumed) == rest
        print(first + rest)
        """,
        tmp_path,
    )
    assert out.strip() == str([b"record %d" % i for i in range(5)])


def test_tfrecord_path_without_the_plugin_says_what_to_install(tmp_path: Path) -> None:
    out = _ok(
        """
        import sys
        import grain_core
        grain_core.install_as_grain()
        sys.modules["grain_tfrecord"] = None  # as if not installed
        try:
            from grain._src.python.dataset.sources.tfrecord_dataset import _TFRecordReader
        except ImportError as err:
            print(err)
        """,
        tmp_path,
    )
    assert "grain._src.python.dataset.sources.tfrecord_dataset" in out
    assert f"not installed: {plugins.plugin_install_command('grain_tfrecord')}" in out


def test_unknown_private_path_names_itself_and_the_docs(tmp_path: Path) -> None:
    out = _ok(
        """
        import grain_core
        grain_core.install_as_grain()
        for statement in ("import grain._src.python.dataset.dataset",
                          "from grain._src.python import data_loader"):
            try:
                exec(statement)
            except ImportError as err:
                print(err)
        """,
        tmp_path,
    )
    lines = out.splitlines()
    assert len(lines) == 2
    assert "'grain._src.python.dataset.dataset'" in lines[0]
    assert "'grain._src.python.data_loader'" in lines[1]
    assert all("docs/compatibility.md" in line for line in lines)


def test_refuses_when_grain_is_already_imported(tmp_path: Path) -> None:
    site = _fake_google_grain(tmp_path)
    result = _python(
        """
        import grain
        import grain_core
        grain_core.install_as_grain()
        """,
        tmp_path,
        PYTHONPATH=str(site),
    )
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("RuntimeError:"), error
    assert f"'grain' ({site / 'grain' / '__init__.py'})" in error
    assert "before anything imports grain" in error


def test_is_idempotent(tmp_path: Path) -> None:
    _ok(
        """
        import sys
        import grain_core
        grain_core.install_as_grain()
        import grain.python
        grain_core.install_as_grain()
        finders = [f for f in sys.meta_path if type(f).__name__ == "_GrainAliasFinder"]
        assert len(finders) == 1, sys.meta_path
        """,
        tmp_path,
    )


def test_processes_started_afterwards_have_it(tmp_path: Path) -> None:
    """grain_core's worker processes unpickle a pipeline whose function lives in a module that
    imports ``grain``; a subprocess that imports grain_core can import ``grain``."""
    (tmp_path / "client.py").write_text(
        "import grain.python as grain\n\ndef double(x):\n    return 2 * x\n"
    )
    out = _ok(
        """
        import subprocess, sys
        import grain_core
        grain_core.install_as_grain()
        import client
        import grain
        ds = (grain.MapDataset.range(8).map(client.double).to_iter_dataset()
              .mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
        print(list(ds))
        subprocess.run([sys.executable, "-c", "import grain_core, grain; assert grain is grain_core"],
                       check=True)
        """,
        tmp_path,
        PYTHONPATH=str(tmp_path),
    )
    assert out.strip() == str([2 * i for i in range(8)])


def test_without_the_call_a_subprocess_has_no_alias(tmp_path: Path) -> None:
    result = _python("import grain_core\nimport grain", tmp_path)
    assert result.returncode != 0
    assert "No module named 'grain'" in result.stderr


def test_keras_rebuilds_a_data_loader_from_its_attributes() -> None:
    """Keras's adapter builds a new ``DataLoader`` from these attributes, adding a map."""
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 10, 1),
        sampler=grain.samplers.IndexSampler(
            10, grain.sharding.NoSharding(), seed=3, shuffle=True, num_epochs=1
        ),
        operations=[grain.transforms.Batch(4)],
        worker_count=0,
        worker_buffer_size=3,
        read_options=grain.ReadOptions(num_threads=2),
    )
    options = loader._multiprocessing_options
    assert (options.num_workers, options.per_worker_buffer_size) == (0, 3)
    assert loader._read_options == grain.ReadOptions(num_threads=2)

    class Negate(grain.transforms.Map):
        def map(self, element: np.ndarray) -> np.ndarray:
            return -element

    rebuilt = grain.DataLoader(
        data_source=loader._data_source,
        sampler=loader._sampler,
        operations=[*loader._operations, Negate()],
        worker_count=options.num_workers,
        worker_buffer_size=options.per_worker_buffer_size,
        shard_options=loader._shard_options,
        read_options=loader._read_options,
        enable_profiling=options.enable_profiling,
    )
    expected = [-batch for batch in loader]
    got = list(rebuilt)
    assert len(got) == len(expected) == 3
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def _client_module(root: Path) -> None:
    """A module written for Grain: it imports ``grain`` itself, as a framework's would."""
    (root / "client.py").write_text(
        "import grain\n\n"
        "def double(x):\n"
        "    return 2 * x\n\n"
        "def alias_in_force():\n"
        "    import grain_core\n"
        "    return grain is grain_core\n"
    )


def _run_main(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` as the main module of a fresh interpreter (a file, as ``spawn`` needs)."""
    (root / "main.py").write_text(textwrap.dedent(code))
    environment = {k: v for k, v in os.environ.items() if k != ALIAS_ENV}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), *sys.path]))
    return subprocess.run(
        [sys.executable, str(root / "main.py")],
        cwd=root,
        env=environment,
        capture_output=True,
        text=True,
    )


_SPAWN_MAIN = """
    {top}
    import multiprocessing

    import client


    def child(answers):
        import grain_core

        import grain

        answers.put((grain is grain_core, client.alias_in_force(), client.double(21)))


    if __name__ == "__main__":
        {guarded}
        spawn = multiprocessing.get_context("spawn")
        answers = spawn.Queue()
        process = spawn.Process(target=child, args=(answers,))
        process.start()
        print(answers.get())
        process.join()
        with spawn.Pool(2) as pool:
            print(pool.map(client.double, range(4)))
"""


def test_spawned_processes_have_it_when_the_main_module_calls_it_first(tmp_path: Path) -> None:
    """The recipe of docs/compatibility.md for ``spawn``: the call at the top of the main
    module, which every spawned child imports again before it unpickles its target."""
    _client_module(tmp_path)
    install = "import grain_core; grain_core.install_as_grain()  # first"
    done = _run_main(tmp_path, _SPAWN_MAIN.format(top=install, guarded="pass"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["(True, True, 42)", "[0, 2, 4, 6]"]


def test_spawned_processes_lack_it_when_the_call_is_under_the_main_guard(tmp_path: Path) -> None:
    """Why the recipe says "at the top": a child that unpickles a function of a module that
    imports ``grain`` imports that module before anything of the parent's ``__main__`` block."""
    _client_module(tmp_path)
    guarded = "import grain_core; grain_core.install_as_grain()"
    done = _run_main(tmp_path, _SPAWN_MAIN.format(top="", guarded=guarded))
    assert done.returncode != 0
    assert "No module named 'grain'" in done.stderr


def test_workers_of_a_forkserver_started_before_the_call_have_it(tmp_path: Path) -> None:
    """A pipeline with workers ran before ``install_as_grain()`` (its forkserver imported
    grain_core without the alias): later workers still unpickle functions of modules that
    import ``grain``, for ``mp_prefetch`` and a ``DataLoader``."""
    _client_module(tmp_path)
    done = _run_main(
        tmp_path,
        """
        import grain_core

        two = grain_core.MultiprocessingOptions(num_workers=2)
        print(list(grain_core.MapDataset.range(4).to_iter_dataset().mp_prefetch(two)))
        grain_core.install_as_grain()

        import client
        import grain

        print(list(grain.MapDataset.range(6).map(client.double).to_iter_dataset().mp_prefetch(two)))


        class Double(grain.transforms.Map):
            def map(self, x):
                return client.double(x)


        loader = grain.DataLoader(
            data_source=grain.sources.RangeDataSource(0, 6, 1),
            sampler=grain.samplers.IndexSampler(6, grain.sharding.NoSharding(), num_epochs=1),
            operations=[Double()],
            worker_count=2,
        )
        print(sorted(int(x) for x in loader))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == [
        "[0, 1, 2, 3]",
        "[0, 2, 4, 6, 8, 10]",
        "[0, 2, 4, 6, 8, 10]",
    ]
