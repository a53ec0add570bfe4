"""Tests for grain_core.plugins: loading, isolation of broken plugins, lookups, built-ins.

Fake plugins here are real distributions as far as importlib.metadata is concerned: a
``*.dist-info`` directory with an ``entry_points.txt`` next to the plugin module, put on
``sys.path``. They run in every nox session; ``test_jsonl.py`` covers an installed one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import grain_core
from grain_core import plugins
from grain_core.plugins import (
    AmbiguousFormatError,
    FormatSpec,
    MissingCapabilityError,
    MissingPluginError,
    NoFormatForPathError,
    PluginConflictError,
    PluginWarning,
    Registry,
    UnknownPluginObjectError,
)
from grain_core.sharding import NoSharding, ShardByJaxProcess, ShardOptions

MakePlugin = Callable[..., None]

FORMAT_PLUGIN = """
from grain_core import hookimpl
from grain_core.plugins import FormatSpec

class Source:
    def __init__(self, paths):
        self.paths = paths
    def __len__(self):
        return 3
    def __getitem__(self, i):
        return {{"path": self.paths, "i": i}}

@hookimpl
def register_formats(register):
    register(FormatSpec(name="{name}", suffixes=("{suffix}",), source=Source, exports={exports}))
"""

STRATEGY_AND_POLICY_PLUGIN = """
from grain_core import hookimpl

class Reverse:
    name = "reverse"
    description = "reverses the dataset"
    def apply(self, ds, *, seed=None, **options):
        return ds[::-1]

class FirstHalf:
    name = "first_half"
    description = "keeps the first half"
    def apply(self, ds, options=None):
        return ds[: len(ds) // 2]

@hookimpl
def register_shuffle_strategies(register):
    register(Reverse())

@hookimpl
def register_sharding_policies(register):
    register(FirstHalf())
"""


@pytest.fixture(autouse=True)
def _fresh_global_registry() -> Iterator[None]:
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture
def make_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakePlugin]:
    """Returns ``make(dist, entry_points, modules)`` that installs a fake distribution."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    created: list[str] = []

    def make(dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text("[grain_core]\n" + lines)
        for module, code in modules.items():
            (site / f"{module}.py").write_text(textwrap.dedent(code))
            created.append(module)
        importlib.invalidate_caches()

    yield make
    for module in created:
        sys.modules.pop(module, None)


def _load(**env: str) -> Registry:
    """Builds a registry, failing the test on any plugin warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        return Registry(env)


def _report(registry: Registry, name: str) -> plugins.PluginReport:
    return next(r for r in registry.reports if r.name == name)


def _fmt(name: str, suffix: str, export: str | None = None) -> str:
    """Source of a plugin module registering one format, optionally exporting its source."""
    exports = f'{{"grain_core.sources": {{"{export}": Source}}}}' if export else "{}"
    return FORMAT_PLUGIN.format(name=name, suffix=suffix, exports=exports)


# Built-ins.


def test_builtins_load_with_zero_plugins() -> None:
    registry = _load(GRAIN_CORE_PLUGINS="")
    assert [r.name for r in registry.reports if r.status == "loaded"] == ["builtins"]
    builtin = _report(registry, "builtins")
    assert (builtin.distribution, builtin.version) == ("grainpipe", grain_core.__version__)
    assert builtin.provides == {
        "shuffle_strategies": ["global", "window"],
        "sharding_policies": ["none", "even_split", "strided", "jax_process"],
    }
    assert registry.objects("formats") == []


def test_builtins_are_the_dataset_layers_default_plugin_loaded_by_name() -> None:
    builtin = _report(_load(GRAIN_CORE_PLUGINS=""), plugins.BUILTIN_PLUGIN)
    assert builtin.module == plugins.DEFAULT_PLUGINS[plugins.BUILTIN_PLUGIN]
    assert not builtin.module.startswith("grain_core.plugins")
    assert builtin.hooks == ("register_sharding_policies", "register_shuffle_strategies")


def test_a_default_plugin_that_fails_is_reported_like_any_other() -> None:
    with pytest.warns(PluginWarning, match=r"plugin 'builtins' \(grainpipe [^)]*\) failed"):
        registry = Registry({"GRAIN_CORE_PLUGINS": ""}, {"builtins": "no_such_default_plugin"})
    builtin = _report(registry, "builtins")
    assert builtin.status == "failed"
    assert builtin.error is not None and "no_such_default_plugin" in builtin.error
    assert builtin.traceback is not None and "ModuleNotFoundError" in builtin.traceback
    assert registry.objects("shuffle_strategies") == []


def test_the_plugin_manager_loads_no_dataset_module_until_it_loads_plugins() -> None:
    code = (
        "import sys\n"
        "import grain_core.plugins\n"
        "print(sorted(m for m in sys.modules if m.startswith('grain_core.dataset')))\n"
        "grain_core.plugins.registry()\n"
        "print('grain_core._builtin_plugin' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def test_builtin_names_are_listed() -> None:
    assert {s.name for s in plugins.list_shuffle_strategies()} >= {"global", "window"}
    assert {p.name for p in plugins.list_sharding_policies()} >= {
        "none",
        "even_split",
        "strided",
        "jax_process",
    }


def _shards(policy: str, n: int, count: int, drop: bool = False) -> list[list[int]]:
    ds = grain_core.MapDataset.range(n)
    apply = plugins.get_sharding_policy(policy).apply
    return [list(apply(ds, ShardOptions(i, count, drop))) for i in range(count)]


def test_even_split_policy_gives_contiguous_blocks() -> None:
    assert _shards("even_split", 10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert _shards("even_split", 10, 3, drop=True) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_strided_policy_interleaves() -> None:
    assert _shards("strided", 10, 3) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert _shards("strided", 10, 3, drop=True) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_none_policy_keeps_everything_and_rejects_real_shards() -> None:
    policy = plugins.get_sharding_policy("none")
    ds = grain_core.MapDataset.range(5)
    assert list(policy.apply(ds)) == list(policy.apply(ds, NoSharding())) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="'none' sharding policy cannot apply"):
        policy.apply(ds, ShardOptions(0, 2))


@pytest.mark.parametrize("policy", ["even_split", "strided"])
def test_splitting_policies_need_options(policy: str) -> None:
    with pytest.raises(ValueError, match="needs ShardOptions"):
        plugins.get_sharding_policy(policy).apply(grain_core.MapDataset.range(4))


def test_jax_process_policy_uses_jax() -> None:
    jax = pytest.importorskip("jax")
    policy = plugins.get_sharding_policy("jax_process")
    ds = grain_core.MapDataset.range(8)
    expected = _shards("even_split", 8, jax.process_count())[jax.process_index()]
    assert list(policy.apply(ds)) == list(policy.apply(ds, ShardByJaxProcess())) == expected
    with pytest.raises(ValueError, match="takes its shard from JAX"):
        policy.apply(ds, ShardOptions(0, 2))


def test_jax_process_policy_without_jax_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)
    policy = plugins.get_sharding_policy("jax_process")
    with pytest.raises(ImportError, match=r"pip install jax"):
        policy.apply(grain_core.MapDataset.range(4))


def test_global_shuffle_strategy_is_map_dataset_shuffle() -> None:
    ds = grain_core.MapDataset.range(50)
    strategy = plugins.get_shuffle_strategy("global")
    assert list(strategy.apply(ds, seed=7)) == list(ds.shuffle(seed=7))
    assert list(strategy.apply(ds.seed(3))) == list(ds.seed(3).shuffle())
    assert sorted(strategy.apply(ds, seed=7)) == list(range(50))
    with pytest.raises(TypeError, match="unknown options: window_size"):
        strategy.apply(ds, seed=1, window_size=4)


def test_window_shuffle_strategy_needs_window_size() -> None:
    strategy = plugins.get_shuffle_strategy("window")
    with pytest.raises(TypeError, match="needs window_size"):
        strategy.apply(grain_core.MapDataset.range(8), seed=1)


def test_window_shuffle_strategy_shuffles_within_windows() -> None:
    if not hasattr(grain_core.experimental, "WindowShuffleMapDataset"):
        pytest.skip("WindowShuffleMapDataset is not in grain_core.experimental yet")
    shuffled = list(
        plugins.get_shuffle_strategy("window").apply(
            grain_core.MapDataset.range(12), seed=5, window_size=4
        )
    )
    assert [sorted(shuffled[i : i + 4]) for i in (0, 4, 8)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]


# Third-party plugins through entry points.


def test_fake_plugin_objects_are_found_by_every_lookup(make_plugin: MakePlugin) -> None:
    make_plugin(
        "fake-fmt",
        {"fakefmt": "fake_fmt_plugin"},
        {"fake_fmt_plugin": _fmt("fakefmt", ".fake", "FakeSource")},
    )
    make_plugin(
        "fake-more",
        {"fakemore": "fake_more_plugin"},
        {"fake_more_plugin": STRATEGY_AND_POLICY_PLUGIN},
    )
    registry = _load(GRAIN_CORE_PLUGINS="fakefmt,fakemore")

    report = _report(registry, "fakefmt")
    assert (report.status, report.distribution, report.version) == ("loaded", "fake-fmt", "1.2.3")
    assert report.hooks == ("register_formats",)
    assert report.provides == {"formats": ["fakefmt"], "exports": ["grain_core.sources.FakeSource"]}

    fmt = registry.get("formats", "fakefmt")
    for path in (
        "a.fake",
        "dir/A.FAKE",
        "a.fake-00003-of-00016",
        "a.fake@8",
        "gs://b/a.fake-*-of-*",
    ):
        assert registry.format_for_path(path) is fmt
    assert fmt.get("source")("a.fake")[2] == {"path": "a.fake", "i": 2}
    with pytest.raises(MissingCapabilityError, match="'fakefmt' has no writer; it offers: source"):
        fmt.get("writer")
    assert registry.resolve_public_name("grain_core.sources", "FakeSource") is fmt.source

    ds = grain_core.MapDataset.range(6)
    assert list(registry.get("shuffle_strategies", "reverse").apply(ds)) == [5, 4, 3, 2, 1, 0]
    assert list(registry.get("sharding_policies", "first_half").apply(ds)) == [0, 1, 2]


def test_global_lookups_load_entry_points_lazily_once(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_plugin(
        "fake-fmt",
        {"fakefmt": "fake_fmt_plugin"},
        {"fake_fmt_plugin": _fmt("fakefmt", ".fake", "FakeSource")},
    )
    monkeypatch.setenv("GRAIN_CORE_PLUGINS", "fakefmt")
    assert "fake_fmt_plugin" not in sys.modules
    assert plugins.get_format("fakefmt").name == "fakefmt"
    assert "fake_fmt_plugin" in sys.modules
    assert plugins.registry() is plugins.registry()
    assert plugins.format_for_path(Path("x.fake")).name == "fakefmt"
    # The public-name hook of grain_core.sources goes through the same registry.
    assert grain_core.sources.FakeSource is plugins.get_format("fakefmt").source  # type: ignore[attr-defined]
    from grain_core.sources import FakeSource  # type: ignore[attr-defined]

    assert FakeSource is plugins.get_format("fakefmt").source


def test_importing_grain_core_loads_no_plugin(tmp_path: Path) -> None:
    code = (
        "import grain_core, grain_core.plugins._manager as m\n"
        "from grain_core.sources import RangeDataSource\n"
        "assert not hasattr(grain_core.experimental, '__wrapped__')\n"
        "assert m._registry is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tmp_path)


def test_missing_module_is_recorded_and_the_rest_keeps_working(make_plugin: MakePlugin) -> None:
    make_plugin("fake-ghost", {"ghost": "no_such_module_for_grain_core_tests"}, {})
    make_plugin(
        "fake-fmt", {"fakefmt": "fake_fmt_plugin"}, {"fake_fmt_plugin": _fmt("fakefmt", ".fake")}
    )
    with pytest.warns(PluginWarning, match=r"plugin 'ghost' \(fake-ghost 1.2.3\) failed") as caught:
        registry = Registry({"GRAIN_CORE_PLUGINS": "ghost,fakefmt"})
    assert len(caught) == 1
    ghost = _report(registry, "ghost")
    assert ghost.status == "failed"
    assert ghost.error is not None and "no_such_module_for_grain_core_tests" in ghost.error
    assert ghost.traceback is not None and "ModuleNotFoundError" in ghost.traceback
    assert registry.get("formats", "fakefmt").name == "fakefmt"
    assert {s.name for s in registry.objects("shuffle_strategies")} >= {"global", "window"}


def test_raising_hook_drops_everything_from_that_plugin(make_plugin: MakePlugin) -> None:
    raising = """
    from grain_core import hookimpl
    from grain_core.plugins import FormatSpec

    class Reverse:
        name = "reverse"
        description = ""
        def apply(self, ds, *, seed=None, **options):
            return ds

    @hookimpl
    def register_shuffle_strategies(register):
        register(Reverse())

    @hookimpl
    def register_sharding_policies(register):
        raise RuntimeError("boom in hook")
    """
    make_plugin("fake-boom", {"boom": "fake_boom_plugin"}, {"fake_boom_plugin": raising})
    make_plugin(
        "fake-fmt", {"fakefmt": "fake_fmt_plugin"}, {"fake_fmt_plugin": _fmt("fakefmt", ".fake")}
    )
    with pytest.warns(PluginWarning, match="boom in hook"):
        registry = Registry({"GRAIN_CORE_PLUGINS": "boom,fakefmt"})
    boom = _report(registry, "boom")
    assert (boom.status, boom.error) == ("failed", "RuntimeError: boom in hook")
    assert boom.traceback is not None and "register_sharding_policies" in boom.traceback
    assert boom.provides == {}
    with pytest.raises(UnknownPluginObjectError, match="No shuffle strategy named 'reverse'"):
        registry.get("shuffle_strategies", "reverse")
    assert registry.format_for_path("a.fake").name == "fakefmt"


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (
            "from grain_core import hookimpl\n@hookimpl\ndef register_format(register):\n    pass\n",
            "unknown hook 'register_format'",
        ),
        (
            "from grain_core import hookimpl\n@hookimpl\ndef register_formats(register):\n"
            "    register('jsonl')\n",
            "register_formats expects FormatSpec objects, got str",
        ),
        (
            "from grain_core import hookimpl\nfrom grain_core.plugins import FormatSpec\n"
            "@hookimpl\ndef register_formats(register):\n"
            "    register(FormatSpec(name='Bad Name', suffixes=('.x',), source=list))\n",
            "format name 'Bad Name' is invalid",
        ),
        (
            "import grain_core.plugins\ngrain_core.plugins.list_formats()\n",
            "while plugins were being loaded",
        ),
    ],
    ids=["misspelled-hook", "wrong-type", "bad-name", "lookup-at-import"],
)
def test_invalid_plugin_is_recorded_with_reason(
    make_plugin: MakePlugin, monkeypatch: pytest.MonkeyPatch, code: str, error: str
) -> None:
    make_plugin("fake-bad", {"bad": "fake_bad_plugin"}, {"fake_bad_plugin": code})
    monkeypatch.setenv("GRAIN_CORE_PLUGINS", "bad")
    with pytest.warns(PluginWarning, match="plugin 'bad'"):
        registry = plugins.registry()
    bad = _report(registry, "bad")
    assert bad.status == "failed"
    assert bad.error is not None and error in bad.error
    assert plugins.get_shuffle_strategy("global").name == "global"


def test_duplicate_format_names_name_both_distributions(make_plugin: MakePlugin) -> None:
    make_plugin("fake-one", {"one": "fake_one_plugin"}, {"fake_one_plugin": _fmt("same", ".one")})
    make_plugin("fake-two", {"two": "fake_two_plugin"}, {"fake_two_plugin": _fmt("same", ".two")})
    make_plugin(
        "fake-fmt", {"fakefmt": "fake_fmt_plugin"}, {"fake_fmt_plugin": _fmt("fakefmt", ".fake")}
    )
    with pytest.warns(PluginWarning, match="format 'same' is registered by both"):
        registry = Registry({"GRAIN_CORE_PLUGINS": "one,two,fakefmt"})
    both = r"plugin 'one' \(fake-one 1.2.3\) and plugin 'two' \(fake-two 1.2.3\)"
    with pytest.raises(PluginConflictError, match=both):
        registry.get("formats", "same")
    with pytest.raises(PluginConflictError, match=both):
        registry.format_for_path("x.one")
    assert [f.name for f in registry.objects("formats")] == ["fakefmt"]
    assert any("GRAIN_CORE_DISABLE_PLUGINS" in p for p in registry.problems)
    # Blocking one of the two resolves the conflict.
    assert _load(GRAIN_CORE_PLUGINS="one,two", GRAIN_CORE_DISABLE_PLUGINS="two").get(
        "formats", "same"
    )


def test_two_formats_claiming_one_suffix_are_ambiguous(make_plugin: MakePlugin) -> None:
    make_plugin("fake-one", {"one": "fake_one_plugin"}, {"fake_one_plugin": _fmt("first", ".dup")})
    make_plugin("fake-two", {"two": "fake_two_plugin"}, {"fake_two_plugin": _fmt("second", ".dup")})
    registry = _load(GRAIN_CORE_PLUGINS="one,two")
    with pytest.raises(
        AmbiguousFormatError, match="'first' of plugin 'one'.*'second' of plugin 'two'"
    ):
        registry.format_for_path("x.dup")


def test_plugin_selection_and_blocking(make_plugin: MakePlugin) -> None:
    make_plugin("fake-one", {"one": "fake_one_plugin"}, {"fake_one_plugin": _fmt("first", ".one")})
    make_plugin("fake-two", {"two": "fake_two_plugin"}, {"fake_two_plugin": _fmt("second", ".two")})

    def loaded(registry: Registry) -> set[str]:
        return {r.name for r in registry.reports if r.status == "loaded"} & {"one", "two"}

    assert loaded(_load()) == {"one", "two"}
    assert loaded(_load(GRAIN_CORE_PLUGINS="one")) == {"one"}
    assert loaded(_load(GRAIN_CORE_PLUGINS=" fake-two ,")) == {"two"}  # distribution names work
    assert loaded(_load(GRAIN_CORE_DISABLE_PLUGINS="one")) == {"two"}
    nothing = _load(GRAIN_CORE_PLUGINS="")
    assert loaded(nothing) == set()
    assert {_report(nothing, n).status for n in ("one", "two")} == {"not selected"}
    assert _report(_load(GRAIN_CORE_DISABLE_PLUGINS="two"), "two").status == "disabled"
    with pytest.raises(NoFormatForPathError):
        _load(GRAIN_CORE_DISABLE_PLUGINS="two").format_for_path("x.two")


@pytest.mark.parametrize("variable", ["GRAIN_CORE_PLUGINS", "GRAIN_CORE_DISABLE_PLUGINS"])
def test_unknown_names_in_environment_are_reported(make_plugin: MakePlugin, variable: str) -> None:
    make_plugin("fake-one", {"one": "fake_one_plugin"}, {"fake_one_plugin": _fmt("first", ".one")})
    with pytest.warns(
        PluginWarning, match=f"{variable} names 'typo', which is not an installed plugin"
    ):
        registry = Registry({variable: "typo,one"})
    assert len(registry.problems) == 1
    assert "one" in registry.problems[0]  # lists what is installed


def test_path_no_format_claims_lists_installed_formats(make_plugin: MakePlugin) -> None:
    make_plugin("fake-one", {"one": "fake_one_plugin"}, {"fake_one_plugin": _fmt("first", ".one")})
    registry = _load(GRAIN_CORE_PLUGINS="one")
    with pytest.raises(
        NoFormatForPathError,
        match=r"No installed format claims 'data.csv'. Installed formats: first \(.one\)",
    ):
        registry.format_for_path("data.csv")
    with pytest.raises(
        NoFormatForPathError,
        match=r"pip install \. \./plugins/grain_arrayrecord \(in a clone of grain_core\)",
    ):
        registry.format_for_path("/data/x.array_record-00001-of-00008")


def test_unknown_names_list_what_is_installed() -> None:
    with pytest.raises(
        UnknownPluginObjectError, match="No sharding policy named 'nope'.*even_split"
    ):
        plugins.get_sharding_policy("nope")
    with pytest.raises(KeyError):
        plugins.get_format("nope")


@pytest.mark.parametrize(
    ("module", "name", "distribution"),
    [
        ("sources", "ArrayRecordDataSource", "grainpipe-arrayrecord"),
        ("experimental", "ParquetIterDataset", "grainpipe-parquet"),
        ("experimental", "TFRecordIterDataset", "grainpipe-tfrecord"),
    ],
)
def test_first_party_names_without_plugin_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, name: str, distribution: str
) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    package = "grain_" + distribution.removeprefix("grainpipe-")
    hint = (
        rf"grain_core.{module}.{name} is provided by the {distribution} plugin, which is not "
        rf"installed: pip install \. \./plugins/{package} \(in a clone of grain_core\)"
    )
    with pytest.raises(MissingPluginError, match=hint):
        getattr(getattr(grain_core, module), name)
    with pytest.raises(ImportError, match=hint):
        exec(f"from grain_core.{module} import {name}", {})


@pytest.mark.parametrize("package", ["grain_arrayrecord", "grain_parquet", "grain_tfrecord"])
@pytest.mark.parametrize(
    ("core", "hint"),
    [
        (None, r"which is not installed: pip install \. \(in a clone of grain_core\)"),
        (
            "other",
            r"is another project's .*pip uninstall grain-core && pip install \. \(in a clone",
        ),
    ],
)
def test_first_party_plugin_without_our_core_names_the_distribution(
    tmp_path: Path, package: str, core: str | None, hint: str
) -> None:
    # The package index's `grain-core` installs a grain_core package without .plugins.
    if core is not None:
        (tmp_path / "grain_core").mkdir()
        (tmp_path / "grain_core" / "__init__.py").write_text("ENGINE = 'workflows'\n")
    plugin_dir = Path(__file__).parents[1] / "plugins" / package
    result = subprocess.run(
        [sys.executable, "-S", "-c", f"import {package}"],
        env={"PYTHONPATH": f"{tmp_path}:{plugin_dir}"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"ImportError: {package} needs grain_core from the `grainpipe`")
    assert re.search(hint, last_line), last_line


def test_first_party_plugin_that_failed_says_why(make_plugin: MakePlugin) -> None:
    make_plugin(
        "grainpipe-arrayrecord",
        {"arrayrecord": "broken_arrayrecord_plugin"},
        {"broken_arrayrecord_plugin": "raise ImportError('array_record missing')"},
    )
    with pytest.warns(PluginWarning):
        registry = Registry({"GRAIN_CORE_PLUGINS": "arrayrecord"})
    with pytest.raises(
        MissingPluginError, match="installed but failed to load: .*array_record missing"
    ):
        registry.resolve_public_name("grain_core.sources", "ArrayRecordDataSource")
    disabled = _load(GRAIN_CORE_DISABLE_PLUGINS="arrayrecord")
    with pytest.raises(MissingPluginError, match="installed but disabled"):
        disabled.resolve_public_name("grain_core.sources", "ArrayRecordDataSource")


def test_unknown_public_name_is_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        grain_core.sources.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(grain_core.experimental, "NoSuchThing")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"suffixes": ("jsonl",), "source": list}, "must look like '.ext'"),
        ({"suffixes": ".jsonl", "source": list}, "suffixes must be a tuple of str"),
        ({"suffixes": (".x",)}, "offers none of source, iter_dataset, writer, inspector"),
        ({"suffixes": (".x",), "source": list, "record_decoder": 1}, "record_decoder must be"),
        ({"source": list}, "claims no suffixes and no URL patterns"),
        ({"url_patterns": ("(",), "source": list}, "not a valid regular expression"),
        ({"suffixes": (".x",), "writer": 3}, "writer must be callable"),
        (
            {
                "suffixes": (".x",),
                "source": list,
                "exports": {"grain_core.transforms": {"X": list}},
            },
            "only grain_core.sources, grain_core.experimental",
        ),
    ],
)
def test_format_spec_validation(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        FormatSpec(name="x", **kwargs)  # type: ignore[arg-type]


def test_url_pattern_beats_suffix_and_longest_suffix_wins() -> None:
    gz = FormatSpec(name="gz", suffixes=(".gz",), source=list)
    tfgz = FormatSpec(name="tfgz", suffixes=(".tfrecord.gz",), source=list)
    hub = FormatSpec(name="hub", url_patterns=(r"^hub://",), source=list)
    assert tfgz.match_strength("a.tfrecord.gz") > gz.match_strength("a.tfrecord.gz") > 0
    assert hub.match_strength("hub://x.tfrecord.gz") > tfgz.match_strength("hub://x.tfrecord.gz")
    assert gz.match_strength("a.gzip") == 0
    assert gz.match_strength("https://h/a.gz?token=1") > 0


def test_entry_point_name_declared_by_two_distributions(make_plugin: MakePlugin) -> None:
    make_plugin("fake-one", {"same": "fake_one_plugin"}, {"fake_one_plugin": _fmt("first", ".one")})
    make_plugin(
        "fake-two", {"same": "fake_two_plugin"}, {"fake_two_plugin": _fmt("second", ".two")}
    )
    with pytest.warns(PluginWarning, match=r"plugin name 'same' is also declared by plugin 'same'"):
        registry = Registry({"GRAIN_CORE_PLUGINS": "same"})
    first, second = [r for r in registry.reports if r.name == "same"]
    assert (first.distribution, first.status) == ("fake-one", "loaded")
    assert (second.distribution, second.status) == ("fake-two", "failed")
    assert registry.format_for_path("x.one").name == "first"


def test_entry_point_discovery_is_imported_only_when_plugins_load() -> None:
    # importlib.metadata costs ~20 ms in every process that imports grain_core (each worker's
    # forkserver included); only the first plugin lookup needs it.
    code = (
        "import sys, grain_core\n"
        "assert 'importlib.metadata' not in sys.modules\n"
        "from grain_core import plugins\n"
        "plugins.list_shuffle_strategies()\n"
        "assert 'importlib.metadata' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
