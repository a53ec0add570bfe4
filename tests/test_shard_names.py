"""grain_core.shard_names: every shard pattern the formats, the CLI and the sources accept,
on real files, and the errors for missing shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from grain_core import shard_names


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    names = shard_names.shard_names(str(tmp_path / "x.rec"), 3)
    for name in names:
        Path(name).write_bytes(b"")
    (tmp_path / "other.rec").write_bytes(b"")
    return names


@pytest.mark.parametrize(
    "pattern",
    ["x.rec@3", "x.rec-*-of-00003", "x.rec-?????-of-00003", "x.rec-*", "x.rec-0000[0-2]-*"],
)
def test_each_pattern_names_the_shards_in_order(
    tmp_path: Path, shards: list[str], pattern: str
) -> None:
    assert shard_names.expand(str(tmp_path / pattern)) == shards


def test_several_paths_files_and_names_that_exist_as_such(
    tmp_path: Path, shards: list[str]
) -> None:
    odd = tmp_path / "odd@2"  # a file whose name looks like a pattern is itself
    odd.write_bytes(b"")
    assert shard_names.expand([odd, str(tmp_path / "other.rec"), shards[0]]) == [
        str(odd),
        str(tmp_path / "other.rec"),
        shards[0],
    ]
    assert shard_names.expand(str(tmp_path / "absent.rec")) == [str(tmp_path / "absent.rec")]
    assert shard_names.shard_names("s3://b/x", 2) == [
        "s3://b/x-00000-of-00002",
        "s3://b/x-00001-of-00002",
    ]


def test_missing_shards_and_empty_patterns_are_named(tmp_path: Path, shards: list[str]) -> None:
    with pytest.raises(
        FileNotFoundError,
        match=r"'.*x\.rec@4' names 4 shards, but '.*x\.rec-00000-of-00004' and 3 more are missing",
    ):
        shard_names.expand(str(tmp_path / "x.rec@4"))
    Path(shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=r"names 00003 shards, but 2 files match"):
        shard_names.expand(str(tmp_path / "x.rec-*-of-00003"))
    with pytest.raises(FileNotFoundError, match=r"'.*y\.rec-\*' matches no file"):
        shard_names.expand(str(tmp_path / "y.rec-*"))
    with pytest.raises(ValueError, match="TFRecordDataSource needs at least one path"):
        shard_names.expand([], what="TFRecordDataSource")
