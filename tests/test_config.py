from __future__ import annotations

import pytest

from grain_core.config import Config


def test_config_reads_updates_and_rejects_assignment(monkeypatch):
    monkeypatch.setenv("GRAIN_PY_DEBUG_MODE", "true")
    cfg = Config()
    assert cfg.py_debug_mode is True
    assert cfg.get_or_default("py_traceback_filtering") == "auto"
    cfg.update("py_traceback_filtering", "off")
    assert cfg.py_traceback_filtering == "off"
    with pytest.raises(ValueError, match="update"):
        cfg.py_debug_mode = False
    with pytest.raises(ValueError, match="Unrecognized config option"):
        _ = cfg.no_such_option
    with pytest.raises(ValueError, match="py_traceback_filtering"):
        cfg.update("py_traceback_filtering", "sometimes")


def test_constants():
    from grain_core import constants

    assert constants.EPOCH == "_epoch"
    assert constants.INDEX in constants.META_FEATURES and len(constants.META_FEATURES) == 6


def test_protocol_lookups_get_attribute_error() -> None:
    from grain_core import config

    assert getattr(config, "__name__", None) is None
    assert not hasattr(config, "__wrapped__")
    with pytest.raises(ValueError, match="Unrecognized config option"):
        config.not_an_option  # noqa: B018


def test_streaming_copy_threshold_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAIN_PY_MP_WORKER_STREAMING_COPY_BYTES", "0")
    cfg = Config()
    assert cfg.py_mp_worker_streaming_copy_bytes == 0
    cfg.update("py_mp_worker_streaming_copy_bytes", 4 << 20)
    for bad in (100, -1, 2.5, True, "2MiB"):
        with pytest.raises(ValueError, match="py_mp_worker_streaming_copy_bytes must be 0"):
            cfg.update("py_mp_worker_streaming_copy_bytes", bad)
    monkeypatch.setenv("GRAIN_PY_MP_WORKER_STREAMING_COPY_BYTES", "12")
    with pytest.raises(ValueError, match="at least 16448 bytes, got 12"):
        Config()
    monkeypatch.setenv("GRAIN_PY_MP_WORKER_STREAMING_COPY_BYTES", "2MiB")
    with pytest.raises(ValueError, match="GRAIN_PY_MP_WORKER_STREAMING_COPY_BYTES='2MiB' must"):
        Config()
