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
