"""The four distributions' metadata: names of our own, licence, long descriptions, supported
Python versions and the version bounds between the core and its plugins."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))
PROJECT_DIRS = [ROOT, *PLUGIN_DIRS]
# The package index's `grain-core` is an unrelated project; ours all start with this.
PREFIX = "grainpipe"


def _project(directory: Path) -> dict[str, Any]:
    return tomllib.loads((directory / "pyproject.toml").read_text())["project"]


def _python_versions(project: dict[str, Any]) -> list[str]:
    pattern = re.compile(r"Programming Language :: Python :: (3\.\d+)$")
    return [m[1] for c in project["classifiers"] if (m := pattern.match(c))]


def test_distribution_names_share_our_prefix_and_keep_the_import_names() -> None:
    assert _project(ROOT)["name"] == PREFIX
    assert PLUGIN_DIRS, "no plugin distributions found"
    for directory in PLUGIN_DIRS:
        package = directory.name  # grain_parquet
        assert _project(directory)["name"] == f"{PREFIX}-{package.removeprefix('grain_')}"
        assert (directory / package / "__init__.py").is_file()


@pytest.mark.parametrize("directory", PROJECT_DIRS, ids=lambda d: d.name)
def test_licence_and_long_description_ship_with_each_distribution(directory: Path) -> None:
    project = _project(directory)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert (directory / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    readme = directory / project["readme"]
    assert readme.read_text().startswith("# ")


def test_every_distribution_declares_the_same_python_versions() -> None:
    core = _project(ROOT)
    versions = _python_versions(core)
    assert versions == sorted(versions, key=Version) and len(versions) >= 2
    assert core["requires-python"] == f">={versions[0]}"
    for directory in PLUGIN_DIRS:
        project = _project(directory)
        assert _python_versions(project) == versions, directory.name
        assert project["requires-python"] == core["requires-python"], directory.name


@pytest.mark.parametrize("directory", PLUGIN_DIRS, ids=lambda d: d.name)
def test_plugins_require_a_bounded_range_of_the_core_that_holds_this_one(
    directory: Path,
) -> None:
    core_version = Version(_project(ROOT)["version"])
    requirements = [Requirement(r) for r in _project(directory)["dependencies"]]
    (core,) = [r for r in requirements if r.name == PREFIX]
    assert core_version in core.specifier
    assert any(s.operator == "<" for s in core.specifier), f"{core} has no upper bound"
    next_minor = Version(f"{core_version.major}.{core_version.minor + 1}")
    assert next_minor not in core.specifier
