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


def test_workers_compute_unless_the_environment_opts_into_the_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GRAIN_PY_MP_PREFETCH_IN_PROCESS", raising=False)
    assert Config().py_mp_prefetch_in_process == "never"
    monkeypatch.setenv("GRAIN_PY_MP_PREFETCH_IN_PROCESS", "auto")
    assert Config().py_mp_prefetch_in_process == "auto"
    monkeypatch.setenv("GRAIN_PY_MP_PREFETCH_IN_PROCESS", "sometimes")
    with pytest.raises(ValueError, match="py_mp_prefetch_in_process must be one of"):
        Config()


# Every option grain_core accepts, with how its effect is checked: an option accepted and
# ignored would make users believe something is on that is not.
def _check_debug_mode(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    import grain_core as grain
    from grain_core.observe import stages

    monkeypatch.setattr("grain_core.dataset.options.config", cfg)
    cfg.update("py_debug_mode", True)
    assert stages.is_tracking(iter(grain.MapDataset.range(3).to_iter_dataset()))
    cfg.update("py_debug_mode", False)
    assert not stages.is_tracking(iter(grain.MapDataset.range(3).to_iter_dataset()))
    with pytest.raises(ValueError, match="py_debug_mode must be a bool"):
        cfg.update("py_debug_mode", "yes")


def _check_summary_interval(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    from grain_core.observe import graph

    monkeypatch.setattr(graph, "config", cfg)
    monkeypatch.setattr(graph, "_monotonic", lambda: 100.0)
    cfg.update("py_debug_summary_interval", 2.5)
    assert graph._Reporter().next_due == 102.5
    for bad in (0, -1, float("nan"), True, "60"):
        with pytest.raises(ValueError, match="positive number of seconds"):
            cfg.update("py_debug_summary_interval", bad)


def _check_visualization_dir(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    import grain_core as grain
    from grain_core.observe import graph

    monkeypatch.setattr("grain_core.dataset.options.config", cfg)
    monkeypatch.setattr(graph, "config", cfg)
    cfg.update("py_dataset_visualization_output_dir", "")
    it = iter(grain.MapDataset.range(3).to_iter_dataset())
    next(it)
    assert "0 | Prefetch" in str(graph.dataset_graph(it))  # tracked, so the graph is known
    assert "_debug_reporter" in vars(it)


def _check_traceback_filtering(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    import traceback

    import grain_core as grain

    def fails(x: int) -> int:
        raise KeyError(x)

    # Grain's modes are all accepted; every one keeps every frame, grain_core's among them.
    for mode in ("auto", "off", "tracebackhide", "quiet_remove_frames", "remove_frames"):
        cfg.update("py_traceback_filtering", mode)
        with pytest.raises(KeyError) as info:
            next(iter(grain.MapDataset.range(3).map(fails).to_iter_dataset()))
        files = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
        assert any("grain_core" in f for f in files) and files[-1] == __file__


def _check_relay_sigterm(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg.update("py_relay_sigterm_to_main", False)
    with pytest.raises(ValueError, match="py_relay_sigterm_to_main=True is not supported"):
        cfg.update("py_relay_sigterm_to_main", True)
    monkeypatch.setenv("GRAIN_PY_RELAY_SIGTERM_TO_MAIN", "1")
    with pytest.raises(ValueError, match="not supported"):
        Config()


def _check_dispatch(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    import grain_core as grain
    from grain_core.dataset.mp import dispatch as mp_dispatch

    monkeypatch.setattr(mp_dispatch, "config", cfg)  # the engine reads the config object
    ds = grain.MapDataset.range(8).to_iter_dataset()
    assert mp_dispatch.dispatchable(ds, 2, False)
    cfg.update("py_mp_prefetch_dispatch", False)
    assert not mp_dispatch.dispatchable(ds, 2, False)


def _check_in_process(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg.update("py_mp_prefetch_in_process", "always")
    assert cfg.py_mp_prefetch_in_process == "always"
    with pytest.raises(ValueError, match="py_mp_prefetch_in_process"):
        cfg.update("py_mp_prefetch_in_process", True)


def _check_streaming_copy(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    from grain_core._ipc import pool

    cfg.update("py_mp_worker_streaming_copy_bytes", 1 << 20)
    streaming = "glibc.cpu.x86_non_temporal_threshold=0x100000"
    assert pool.worker_glibc_tunables(None, 1 << 20).endswith(f":{streaming}")  # type: ignore[union-attr]
    assert streaming not in (pool.worker_glibc_tunables(None, 0) or "")


_OPTION_CHECKS = {
    "py_debug_mode": _check_debug_mode,
    "py_debug_summary_interval": _check_summary_interval,
    "py_dataset_visualization_output_dir": _check_visualization_dir,
    "py_traceback_filtering": _check_traceback_filtering,
    "py_relay_sigterm_to_main": _check_relay_sigterm,
    "py_mp_prefetch_dispatch": _check_dispatch,
    "py_mp_prefetch_in_process": _check_in_process,
    "py_mp_worker_streaming_copy_bytes": _check_streaming_copy,
}


def test_every_option_has_an_effect_or_is_refused() -> None:
    assert sorted(Config()._values) == sorted(_OPTION_CHECKS)


@pytest.mark.parametrize("name", sorted(_OPTION_CHECKS))
def test_option_works_or_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _OPTION_CHECKS[name](Config(), monkeypatch)


def test_unknown_and_tensorflow_options_are_refused() -> None:
    cfg = Config()
    with pytest.raises(ValueError, match="Unrecognized config option: py_no_such"):
        cfg.update("py_no_such", 1)
    with pytest.raises(ValueError, match="TensorFlow backend, which grain_core does not have"):
        cfg.update("tf_interleaved_shuffle", True)


_FLAGS_SCRIPT = """
import sys
{first}
{second}
from absl import flags
from absl.testing import flagsaver
from grain_core import config

flags.FLAGS(["trainer", "--grain_py_debug_mode", "--grain_py_mp_prefetch_in_process=never"])
assert config.py_debug_mode is True and config.py_mp_prefetch_in_process == "never"
with flagsaver.flagsaver(grain_py_debug_mode=False, grain_py_dataset_visualization_output_dir=""):
    assert config.py_debug_mode is False and config.py_dataset_visualization_output_dir == ""
assert config.py_debug_mode is True and config.py_dataset_visualization_output_dir is None
config.update("py_debug_summary_interval", 5.0)
assert flags.FLAGS.grain_py_debug_summary_interval == 5.0
try:
    flags.FLAGS.grain_py_traceback_filtering = "sometimes"
except flags.IllegalFlagValueError as e:
    assert "py_traceback_filtering must be one of" in str(e)
else:
    sys.exit("an invalid flag value was accepted")
"""


@pytest.mark.parametrize("absl_first", [True, False])
def test_options_are_absl_flags_when_absl_is_imported(absl_first: bool) -> None:
    import subprocess
    import sys

    pytest.importorskip("absl")
    imports = ["import absl.flags", "import grain_core"]
    first, second = imports if absl_first else imports[::-1]
    script = _FLAGS_SCRIPT.format(first=first, second=second)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


_SECOND_DEFINITION_SCRIPT = """
import grain_core
from absl import flags
from grain_core import config

# What Google Grain's config module does at import, in a process that has grain_core too.
flags.DEFINE_bool("grain_py_debug_mode", False, "Grain's own definition.")
flags.DEFINE_string("grain_py_traceback_filtering", "auto", "Grain's own.")
flags.FLAGS(["trainer", "--grain_py_debug_mode"])
assert config.py_debug_mode is True
"""


def test_grain_defining_the_same_flags_after_grain_core_is_not_an_error() -> None:
    import subprocess
    import sys

    pytest.importorskip("absl")
    done = subprocess.run(
        [sys.executable, "-c", _SECOND_DEFINITION_SCRIPT], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_grain_core_does_not_import_absl() -> None:
    import subprocess
    import sys

    script = "import sys, grain_core; assert 'absl' not in sys.modules, 'absl imported'"
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0
