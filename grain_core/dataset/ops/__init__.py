"""The operators: one module per transformation node, each with its dataset and iterator
classes, built on the runtime at the top of ``grain_core.dataset`` (``base``, ``source``,
``prefetch`` ...). Reached through the fluent API of ``MapDataset`` / ``IterDataset`` and
``grain_core.experimental``."""

from __future__ import annotations

__all__: list[str] = []
