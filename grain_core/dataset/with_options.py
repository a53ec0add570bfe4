"""``WithOptionsIterDataset``: attach ``DatasetOptions`` to a whole pipeline."""

from __future__ import annotations

from typing import Any

from grain_core.dataset.base import DatasetIterator, IterDataset
from grain_core.dataset.element_spec import parent_spec
from grain_core.dataset.options import DatasetOptions

__all__ = ["WithOptionsIterDataset"]


class WithOptionsIterDataset(IterDataset[Any]):
    """Merges ``options`` into the iterator context shared by the whole pipeline.

    Upstream and downstream iterators share one context, so the options apply to every node.
    Explicitly set fields of the most downstream ``WithOptionsIterDataset`` win; fields it leaves
    unset keep the values set upstream. Adds no iterator of its own.

    Raises:
      TypeError: if ``options`` is not a ``DatasetOptions``.
    """

    element_spec_rule = parent_spec

    def __init__(self, parent: IterDataset[Any], options: DatasetOptions) -> None:
        super().__init__(parent)
        if not isinstance(options, DatasetOptions):
            raise TypeError(f"options must be a DatasetOptions, got {type(options).__name__}.")
        self.options = options

    def __iter__(self) -> DatasetIterator[Any]:
        it = iter(self._parents[0])
        it._merge_dataset_options(self.options)
        return it

    def __repr__(self) -> str:
        return f"WithOptionsIterDataset(options={self.options!r})"
