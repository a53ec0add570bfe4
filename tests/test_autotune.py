"""``grain.experimental.pick_performance_config`` (grain_core.dataset.autotune)."""

from __future__ import annotations

import grain_core as grain


def test_the_config_fits_the_budget_and_leaves_the_in_process_choice_to_measurement() -> None:
    ds = grain.MapDataset.range(100).to_iter_dataset()
    config = grain.experimental.pick_performance_config(
        ds, ram_budget_mb=1, max_workers=3, max_buffer_size=50
    )
    assert config.multiprocessing_options.num_workers == 3
    assert config.multiprocessing_options.in_process == "auto"
    assert config.read_options.prefetch_buffer_size == 50
