"""``python -m grain_core``: the grain-core command line."""

from __future__ import annotations

from grain_core.cli import main

raise SystemExit(main())
