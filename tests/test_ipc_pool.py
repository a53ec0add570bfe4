"""Tests of grain_core._ipc.pool: how worker processes start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import grain_core

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver")

_SCRIPT = """
import grain_core as grain


def where(_):
    import grain_core

    return grain_core.__file__


if __name__ == "__main__":
    ds = grain.MapDataset.range(2).map(where).to_iter_dataset()
    options = grain.MultiprocessingOptions(num_workers=2)
    print(grain.__file__)
    for path in sorted(set(ds.mp_prefetch(options))):
        print(path)
"""


def test_workers_import_the_grain_core_the_parent_imported(tmp_path: Path) -> None:
    # Run from a source checkout whose grain_core is not the one the parent imports (the
    # script's directory comes first on its path, not the working directory): the workers'
    # forkserver must not import the checkout's from its working directory. The checkout's
    # package runs the real modules, so a worker that imported it still works and says where
    # its grain_core came from.
    checkout = tmp_path / "checkout" / "grain_core"
    checkout.mkdir(parents=True)
    real = Path(grain_core.__file__).parent
    (checkout / "__init__.py").write_text(f"__path__.append({str(real)!r})\n")
    script = tmp_path / "script" / "run.py"
    script.parent.mkdir()
    script.write_text(_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=checkout.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    parent, *workers = out.stdout.split()
    assert parent == grain_core.__file__
    assert workers == [parent]


_FORK_SCRIPT = """
import os
import sys

import numpy as np

import grain_core as grain


def big(i):
    return np.full(40_000, i, np.int32)  # 160 KB: travels in shared memory


def loader(n):
    ds = grain.MapDataset.range(n).map(big).to_iter_dataset()
    return iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))


def first_values(it, count):
    return [int(next(it)[0]) for _ in range(count)]


if __name__ == "__main__":
    grain.config.update("py_mp_prefetch_dispatch", sys.argv[1] == "dispatch")
    it = loader(40)
    print("parent", first_values(it, 3), flush=True)
    pid = os.fork()
    if pid == 0:
        if sys.argv[2] == "own-workers":
            try:
                next(it)
            except RuntimeError as e:
                print("child-uses-parents", type(e).__name__, e, flush=True)
            print("child", first_values(loader(6), 6), flush=True)
        sys.exit(0)  # the interpreter's whole exit: atexit hooks, finalizers
    _, status = os.waitpid(pid, 0)
    print("child-exit", os.waitstatus_to_exitcode(status), flush=True)
    print("parent", first_values(it, 37), flush=True)
"""


@pytest.mark.parametrize("engine", ["dispatch", "rotation"])
@pytest.mark.parametrize("child", ["exits", "own-workers"])
def test_a_forked_child_leaves_the_parents_workers_alone(
    tmp_path: Path, engine: str, child: str
) -> None:
    # The child exits normally (or first starts workers of its own) while the parent's
    # workers hold elements in shared memory: the parent's iterator reads on, every element.
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), engine, child],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"parent {list(range(3))}"
    assert lines[-2:] == ["child-exit 0", f"parent {list(range(3, 40))}"]
    if child == "own-workers":
        assert lines[1].startswith("child-uses-parents WorkerDiedError Worker process")
        assert "a forked process cannot use its parent's iterator" in lines[1]
        assert lines[2] == f"child {list(range(6))}"
    else:
        assert len(lines) == 3


def _read_variable(name: str) -> str:
    import os

    return os.environ.get(name, "unset")  # a None element would be dropped


def test_workers_see_variables_the_parent_set_after_the_forkserver_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first pool starts the forkserver; the variable is set after that, as a credential
    # or a storage emulator's endpoint may be.
    options = grain_core.MultiprocessingOptions(num_workers=1)
    first = grain_core.MapDataset.range(1).map(lambda _: _read_variable("GRAIN_TEST_LATE"))
    assert list(first.to_iter_dataset().mp_prefetch(options)) == ["unset"]
    monkeypatch.setenv("GRAIN_TEST_LATE", "set later")
    monkeypatch.delenv("HOME", raising=False)
    late = grain_core.MapDataset.range(2).map(
        lambda _: (_read_variable("GRAIN_TEST_LATE"), _read_variable("HOME"))
    )
    assert list(late.to_iter_dataset().mp_prefetch(options)) == [("set later", "unset")] * 2
