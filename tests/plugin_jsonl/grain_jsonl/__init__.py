"""grain-jsonl: JSON Lines files for grain_core (one JSON value per line)."""

from __future__ import annotations

from grain_jsonl._jsonl import JsonlDataSource, JsonlWriter, inspect_jsonl

__all__ = ["JsonlDataSource", "JsonlWriter", "inspect_jsonl"]
