"""MaxText 0.2.5's ``make_grain_train_iterator``, unmodified, on grain_core: ArrayRecord,
Parquet and TFRecord files, mixtures, the three packing styles, interleave with a window
shuffle, ``mp_prefetch`` with 2 workers and ``ElasticIterator``; checkpoint and resume, and
the batches and checkpoints of Google Grain where the session computed them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("maxtext")

import scenarios  # noqa: E402

CONFIGS = sorted(scenarios.MAXTEXT_CONFIGS)


def _assert_batches_equal(
    got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]
) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert sorted(a) == sorted(b), step
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"batch {step}, {key!r}")


@pytest.fixture(scope="module")
def core_values(data_dir: Path) -> dict[str, dict[str, Any]]:
    return {name: scenarios.maxtext_batches(data_dir, name) for name in CONFIGS}


@pytest.mark.parametrize("name", CONFIGS)
def test_resumes_from_its_checkpoint(core_values: dict[str, dict[str, Any]], name: str) -> None:
    values = core_values[name]
    assert len(values["batches"]) == scenarios.BEFORE + scenarios.AFTER
    _assert_batches_equal(values["resumed"], values["batches"][scenarios.BEFORE :])


@pytest.mark.parametrize("name", CONFIGS)
def test_batches_are_google_grains(
    core_values: dict[str, dict[str, Any]], grain_values: dict[str, Any] | None, name: str
) -> None:
    if grain_values is None:
        pytest.skip("no Google Grain values in this session (nox -s tests-clients makes them)")
    _assert_batches_equal(core_values[name]["batches"], grain_values[f"maxtext/{name}"]["batches"])


@pytest.mark.parametrize("name", CONFIGS)
def test_restores_google_grains_checkpoint(
    data_dir: Path, grain_values: dict[str, Any] | None, name: str
) -> None:
    if grain_values is None:
        pytest.skip("no Google Grain values in this session (nox -s tests-clients makes them)")
    theirs = grain_values[f"maxtext/{name}"]
    resumed = scenarios.maxtext_resume(data_dir, name, theirs["state"])
    _assert_batches_equal(resumed, theirs["batches"][scenarios.BEFORE :])
