"""The top-level ``grain_core`` namespace: Grain's names, imported on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import grain_core


def test_every_public_name_resolves_and_is_listed() -> None:
    # The lazy tables and __all__ name the same things (a name in one only is a mistake).
    lazy = {*grain_core._SUBMODULES, *grain_core._DEFINED_IN, "config"}
    assert set(grain_core.__all__) == lazy
    for name in grain_core.__all__:
        assert getattr(grain_core, name) is not None
    assert set(grain_core.__all__) <= set(dir(grain_core))
    namespace: dict[str, object] = {}
    exec("from grain_core import *", namespace)
    assert set(grain_core.__all__) <= set(namespace)


def test_config_is_the_config_object_not_its_module() -> None:
    import grain_core.config  # noqa: F401 - importing the submodule must not rebind the name

    assert grain_core.config is sys.modules["grain_core.config"].config


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        grain_core.NoSuchThing  # noqa: B018


def test_import_loads_only_what_is_used() -> None:
    # Every worker's forkserver imports grain_core: the DataLoader, checkpointing and the
    # experimental datasets load when a name from them is first used.
    code = (
        "import sys, grain_core\n"
        "unused = ['grain_core.data_loader', 'grain_core.checkpoint', 'grain_core.experimental']\n"
        "assert not [m for m in unused if m in sys.modules], unused\n"
        "grain_core.DataLoader\n"
        "assert 'grain_core.data_loader' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
