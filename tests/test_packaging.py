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


def _pip_install_commands() -> list[tuple[str, str]]:
    """Every ``pip install ...`` that the code and the docs tell a user to run: (file, what
    follows ``pip install`` up to the end of the command)."""
    sources = [
        *ROOT.glob("grain_core/**/*.py"),
        *ROOT.glob("plugins/*/grain_*/**/*.py"),
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("plugins/*/README.md"),
        ROOT / "README.md",
    ]
    found = []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"pip install (?!-e\b|-U\b|nox\b)([^`\"\n)(;]+)", text):
            found.append((str(path.relative_to(ROOT)), match.group(1).strip().rstrip(".,:")))
    return found


def test_every_install_hint_names_what_a_clone_or_the_package_index_has() -> None:
    """The grainpipe distributions are on no package index: a hint installs them from a clone
    (``.`` and ``./plugins/<x>``, the core always beside a plugin, which alone fails on its
    ``grainpipe`` dependency); anything else it names is an index package we depend on."""
    plugin_dirs = {f"./plugins/{d.name}" for d in PLUGIN_DIRS}
    declared: set[str] = set()
    for directory in PROJECT_DIRS:
        project = _project(directory)
        requirements = [*project.get("dependencies", [])]
        for extra in project.get("optional-dependencies", {}).values():
            requirements.extend(extra)
        declared.update(Requirement(r).name.lower() for r in requirements)
    declared -= {PREFIX}
    # The stores' fsspec implementations, named where their scheme is used.
    declared |= {"gcsfs", "adlfs", "huggingface_hub", "tensorflow-cpu"}
    commands = _pip_install_commands()
    assert len(commands) > 10
    for where, command in commands:
        words = [w.strip("'\"") for w in command.split()]
        # Placeholders of f-strings name table entries (storage's packages per scheme).
        words = [w for w in words if w and not w.startswith("--") and "{" not in w]
        targets = [re.sub(r"\[.*\]$", "", w) for w in words]
        for target in targets:
            assert not target.startswith(PREFIX), f"{where}: 'pip install {command}'"
            if target.startswith("./plugins/"):
                assert target in plugin_dirs and "." in targets, f"{where}: {command!r}"
            elif target not in (".", "./"):
                assert target.lower() in declared | plugin_dirs, f"{where}: {command!r}"
