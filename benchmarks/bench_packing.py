"""First-fit packing of 100,000 sequences into bins of 2048 tokens (issue 6).

Sequence lengths: ``round(lognormal(mean=5.5, sigma=1.0))`` clipped to ``[1, 2048]`` with
``numpy.random.default_rng(0)`` (median ~245 tokens, mean ~400, ~1% at the 2048 cap): a typical
web-text document-length shape. Each sequence is a view of one shared int32 token array, so the
data costs no memory and both libraries copy exactly the same bytes into their bins.

Both implementations read the same in-memory list with ``to_iter_dataset`` (synchronous reads)
and pack with ``num_packing_bins=64`` and the default bin shuffle; elements/s counts input
sequences.

Run ``python benchmarks/bench_packing.py`` for the padding efficiency (fraction of non-padding
tokens) of first-fit vs best-fit on the same lengths, for several bin counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from _harness import import_google_grain, workload

SEQUENCES = 100_000
TARGET = 2048
BINS = 64


def sequence_lengths(n: int = SEQUENCES, seed: int = 0) -> np.ndarray:
    """The documented length distribution (see the module docstring)."""
    raw = np.random.default_rng(seed).lognormal(mean=5.5, sigma=1.0, size=n)
    return np.clip(np.rint(raw), 1, TARGET).astype(np.int64)


def _elements() -> list[dict[str, np.ndarray]]:
    tokens = np.arange(1, TARGET + 1, dtype=np.int32)
    return [{"tokens": tokens[:n]} for n in sequence_lengths()]


def _pass(ds: Any) -> Callable[[], None]:
    total = int(sequence_lengths().sum())

    def run() -> None:
        packed = 0
        for row in ds:
            packed += int(np.count_nonzero(row["tokens_segment_ids"]))
        if packed != total:
            raise AssertionError(f"packed {packed} tokens, expected {total}")

    return run


@workload(
    "pack_first_fit_100k",
    elements=SEQUENCES,
    description="first-fit pack 100k lognormal-length sequences into 64 bins of 2048",
)
def pack_first_fit_100k() -> Callable[[], None]:
    import grain_core as grain
    from grain_core.experimental import FirstFitPackIterDataset

    source = grain.MapDataset.source(_elements()).to_iter_dataset(grain.ReadOptions(num_threads=0))
    return _pass(
        FirstFitPackIterDataset(source, length_struct={"tokens": TARGET}, num_packing_bins=BINS)
    )


@pack_first_fit_100k.baseline("grain", requires="grain")
def _() -> Callable[[], None]:
    grain: Any = import_google_grain()
    source = grain.MapDataset.source(_elements()).to_iter_dataset(grain.ReadOptions(num_threads=0))
    return _pass(
        grain.experimental.FirstFitPackIterDataset(
            source, length_struct={"tokens": TARGET}, num_packing_bins=BINS
        )
    )


def padding_efficiency(packer: type, lengths: np.ndarray, bins: int) -> tuple[float, int]:
    """Fraction of non-padding cells over all emitted bins, and the number of bins."""
    import grain_core as grain

    tokens = np.ones(TARGET, dtype=np.int8)
    source = grain.MapDataset.source([{"t": tokens[:n]} for n in lengths]).to_iter_dataset(
        grain.ReadOptions(num_threads=0)
    )
    rows = sum(
        1
        for _ in packer(
            source, length_struct={"t": TARGET}, num_packing_bins=bins, shuffle_bins=False
        )
    )
    return float(lengths.sum()) / (rows * TARGET), rows


def main() -> None:
    from grain_core.experimental import BestFitPackIterDataset, FirstFitPackIterDataset

    lengths = sequence_lengths()
    print(
        f"{len(lengths)} sequences, lognormal(5.5, 1.0) clipped to [1, {TARGET}]: "
        f"median {int(np.median(lengths))}, mean {lengths.mean():.0f}, "
        f"{np.mean(lengths == TARGET):.2%} at the cap"
    )
    print(f"{'bins':>6} {'first-fit':>12} {'best-fit':>12}   (fraction of non-pad tokens; rows)")
    for bins in (1, 8, 64, 256):
        ff, ff_rows = padding_efficiency(FirstFitPackIterDataset, lengths, bins)
        bf, bf_rows = padding_efficiency(BestFitPackIterDataset, lengths, bins)
        print(f"{bins:>6} {ff:>12.4f} {bf:>12.4f}   ({ff_rows} vs {bf_rows} rows)")


if __name__ == "__main__":
    main()
