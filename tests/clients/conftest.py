"""Fixtures of the client tests (``nox -s tests-clients``): the data files and, where the
session made one, Google Grain's values of the same scenarios."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

#: The data directory ``scenarios.py write-data`` filled (the session sets it; else a tmp dir).
DATA_ENV = "GRAIN_CLIENTS_DATA"
#: The pickle of Google Grain's values (``scenarios.py reference``); unset: no comparison.
REFERENCE_ENV = "GRAIN_CLIENTS_REFERENCE"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import scenarios

    scenarios.use_grain_core()
    given = os.environ.get(DATA_ENV)
    if given:
        return Path(given)
    directory = tmp_path_factory.mktemp("clients")
    scenarios.write_data(directory)
    return directory


@pytest.fixture(scope="session")
def grain_values() -> dict[str, Any] | None:
    """Google Grain's values by scenario name, or None where the session has none."""
    path = os.environ.get(REFERENCE_ENV)
    return pickle.loads(Path(path).read_bytes()) if path else None
