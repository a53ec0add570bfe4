"""Keras 3 (JAX backend), unmodified, trains on grain_core: ``fit``, ``evaluate`` and
``predict`` on a MapDataset, an IterDataset with ``mp_prefetch`` (2 workers) and a
``DataLoader`` with 2 workers, which Keras rebuilds from its attributes; the losses are Google
Grain's where the session computed them (to 6 significant digits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("keras")

import scenarios  # noqa: E402

#: grain_core's DataLoader output does not depend on its worker count (docs/compatibility.md,
#: "DataLoader checkpoints survive a change of worker count"): with 2 workers it batches
#: records 0-15, 16-31, ... as Grain does without workers (Grain's MapDataset input here);
#: Grain's 2 workers batch their own strided records (0, 2, 4, ...).
GRAIN_EQUIVALENT = {"data_loader": "map_dataset"}


@pytest.mark.parametrize("kind", scenarios.KERAS_INPUTS)
def test_fit_evaluate_predict(
    data_dir: Path, grain_values: dict[str, Any] | None, kind: str
) -> None:
    values = scenarios.keras_values(kind)
    assert len(values["fit"]) == 2
    assert values["fit"][-1] < values["fit"][0]
    assert values["predict"].shape == (64, 1)
    if grain_values is None:
        return
    theirs = grain_values[f"keras/{GRAIN_EQUIVALENT.get(kind, kind)}"]
    np.testing.assert_allclose(values["fit"], theirs["fit"], rtol=1e-6)
    np.testing.assert_allclose(values["evaluate"], theirs["evaluate"], rtol=1e-6)
    np.testing.assert_allclose(values["predict"], theirs["predict"], rtol=1e-6)
