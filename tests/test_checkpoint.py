"""CheckpointHandler, atomic checkpoint files, Orbax v1 save/load and Orbax args."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import grain_core as grain
from grain_core import checkpoint
from grain_core.samplers import IndexSampler


def _dataset_iterator() -> Any:
    return iter(grain.MapDataset.range(10).map(lambda x: x * 2).to_iter_dataset())


def _loader_iterator(workers: int = 0) -> Any:
    loader = grain.DataLoader(
        data_source=list(range(10)), sampler=IndexSampler(10, num_epochs=1), worker_count=workers
    )
    return iter(loader)


def test_dataset_iterator_round_trip(tmp_path: Path) -> None:
    handler = checkpoint.CheckpointHandler()
    it = _dataset_iterator()
    for _ in range(3):
        next(it)
    handler.save(tmp_path, it)
    assert json.loads((tmp_path / "process_0-of-1.json").read_text()) == {"next_index": 3}
    fresh = _dataset_iterator()
    assert handler.restore(tmp_path, fresh) is fresh
    assert list(fresh) == [6, 8, 10, 12, 14, 16, 18]


@pytest.mark.parametrize("workers", [0, 2])
def test_data_loader_iterator_round_trip(tmp_path: Path, workers: int) -> None:
    handler = checkpoint.CheckpointHandler()
    with _loader_iterator(workers) as it:
        for _ in range(4):
            next(it)
        handler.save(tmp_path, args=type("Args", (), {"item": it})())
    assert json.loads((tmp_path / "process_0-of-1.json").read_text())["version"] == 2
    with _loader_iterator(workers) as fresh:
        handler.restore(tmp_path, fresh)
        assert list(fresh) == list(range(4, 10))


def test_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handler = checkpoint.CheckpointHandler()
    it = _dataset_iterator()
    handler.save(tmp_path, it)
    next(it)

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        handler.save(tmp_path, it)
    assert os.listdir(tmp_path) == ["process_0-of-1.json"]  # no temporary file left
    assert json.loads((tmp_path / "process_0-of-1.json").read_text()) == {"next_index": 0}


def test_bad_checkpoint_files(tmp_path: Path) -> None:
    handler = checkpoint.CheckpointHandler()
    with pytest.raises(ValueError, match="does not exist"):
        handler.restore(tmp_path, _dataset_iterator())
    (tmp_path / "process_0-of-1.json").write_text('{"next_ind')
    with pytest.raises(ValueError, match="not valid JSON"):
        handler.restore(tmp_path, _dataset_iterator())
    with pytest.raises(ValueError, match="not valid JSON"):
        handler.restore(tmp_path, _loader_iterator())
    (tmp_path / "process_0-of-1.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="process_0-of-1.json is not UTF-8 text"):
        handler.restore(tmp_path, _dataset_iterator())


@pytest.mark.parametrize(
    "text",
    ["null", "[1, 2]", '{"iterators_in_use_indices": [0]}', '{"version": 2, "x": 1}'],
    ids=["null", "list", "another_iterator", "a_dataloader_state"],
)
def test_a_checkpoint_of_another_iterator_is_a_clear_error(tmp_path: Path, text: str) -> None:
    (tmp_path / "process_0-of-1.json").write_text(text)
    with pytest.raises(ValueError, match="process_0-of-1.json does not hold a state of this"):
        checkpoint.CheckpointHandler().restore(tmp_path, _dataset_iterator())


def test_an_invalid_state_error_names_the_checkpoint_file(tmp_path: Path) -> None:
    (tmp_path / "process_0-of-1.json").write_text('{"version": 2, "last_seen_indices": null}')
    with _loader_iterator() as it, pytest.raises(ValueError, match="sampler None") as raised:
        checkpoint.CheckpointHandler().restore(tmp_path, it)
    assert "process_0-of-1.json" in "".join(raised.value.__notes__)


def test_orbax_v1_protocol(tmp_path: Path) -> None:
    async def save_and_load() -> list[int]:
        it = _loader_iterator()
        next(it)
        await (await it.save(tmp_path))
        fresh = _loader_iterator()
        await (await fresh.load(tmp_path))
        return list(fresh)

    assert asyncio.run(save_and_load()) == list(range(1, 10))


class _PathAwaitingCreation:
    """Orbax v1's ``PathAwaitingCreation`` protocol: not a path (no ``__fspath__``); the
    directory exists once ``await_creation()`` returns it."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def __truediv__(self, other: str) -> _PathAwaitingCreation:
        return _PathAwaitingCreation(self._path / other)

    @property
    def path(self) -> Path:
        return self._path

    async def await_creation(self) -> Path:
        self._path.mkdir(parents=True, exist_ok=True)
        return self._path


@pytest.mark.parametrize("make", [_dataset_iterator, _loader_iterator])
def test_orbax_v1_save_writes_where_the_awaited_directory_is(tmp_path: Path, make: Any) -> None:
    async def save_and_load() -> list[int]:
        it = make()
        next(it)
        await (await it.save(_PathAwaitingCreation(tmp_path) / "data"))
        fresh = make()
        await (await fresh.load(tmp_path / "data"))
        return list(fresh)

    assert asyncio.run(save_and_load()) == list(make())[1:]
    assert (tmp_path / "data" / "process_0-of-1.json").is_file()


def test_orbax_v1_save_checkpointables_with_model_params(tmp_path: Path) -> None:
    ocp_v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")
    np = pytest.importorskip("numpy")

    loader_it, dataset_it = _loader_iterator(), _dataset_iterator()
    for _ in range(3):
        next(loader_it)
        next(dataset_it)
    params = {"w": np.arange(6.0).reshape(2, 3)}
    directory = tmp_path / "step_3"
    ocp_v1.save_checkpointables(
        directory, {"params": params, "loader": loader_it, "dataset": dataset_it}
    )
    fresh_loader, fresh_dataset = _loader_iterator(), _dataset_iterator()
    restored = ocp_v1.load_checkpointables(
        directory, {"params": params, "loader": fresh_loader, "dataset": fresh_dataset}
    )
    np.testing.assert_array_equal(restored["params"]["w"], params["w"])
    assert list(fresh_loader) == list(range(3, 10))
    assert list(fresh_dataset) == [6, 8, 10, 12, 14, 16, 18]


def test_orbax_args_absent_without_orbax() -> None:
    try:
        import orbax.checkpoint  # noqa: F401
    except ImportError:
        assert not hasattr(checkpoint, "CheckpointSave")
    else:
        assert hasattr(checkpoint, "CheckpointSave")


def test_orbax_checkpoint_manager_with_model_params(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    np = pytest.importorskip("numpy")
    it = _loader_iterator()
    next(it)
    next(it)
    params = {"w": np.arange(6.0).reshape(2, 3)}
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(
            1,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), data=checkpoint.CheckpointSave(it)
            ),
        )
        manager.wait_until_finished()
        fresh = _loader_iterator()
        restored = manager.restore(
            1,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(params), data=checkpoint.CheckpointRestore(fresh)
            ),
        )
    np.testing.assert_array_equal(restored["params"]["w"], params["w"])
    assert list(fresh) == list(range(2, 10))


def test_restore_with_another_process_count_says_so(tmp_path: Path) -> None:
    for i in range(2):
        (tmp_path / f"process_{i}-of-2.json").write_text('{"next_index": 1}')
    with pytest.raises(
        ValueError, match=r"written by 2 processes, and this run has 1.*ElasticIterator"
    ):
        checkpoint.CheckpointHandler().restore(tmp_path, _dataset_iterator())


def test_elastic_iterator_restores_under_another_process_count(tmp_path: Path) -> None:
    from grain_core.experimental import ElasticIterator
    from grain_core.sharding import ShardOptions

    ds = grain.MapDataset.range(40)
    two_hosts = [ElasticIterator(ds, 4, ShardOptions(i, 2)) for i in range(2)]
    for i, it in enumerate(two_hosts):
        assert [b.tolist() for b in (next(it), next(it))] == [
            [2 * i, 2 * i + 1],
            [4 + 2 * i, 5 + 2 * i],
        ]
        (tmp_path / f"process_{i}-of-2.json").write_text(json.dumps(it.get_state()))
    one_host = ElasticIterator(ds, 4, ShardOptions(0, 1))
    checkpoint.CheckpointHandler().restore(tmp_path, one_host)
    assert next(one_host).tolist() == [8, 9, 10, 11]


def test_elastic_process_files_of_different_steps_are_refused(tmp_path: Path) -> None:
    # A MapDataset ElasticIterator's state is the same on every process of one save; here
    # process 1's save of step 3 did not finish and its file is of step 2.
    from grain_core.experimental import ElasticIterator
    from grain_core.sharding import ShardOptions

    ds = grain.MapDataset.range(40)
    two_hosts = [ElasticIterator(ds, 4, ShardOptions(i, 2)) for i in range(2)]
    for it in two_hosts:
        next(it)
        next(it)
    next(two_hosts[0])
    for i, it in enumerate(two_hosts):
        (tmp_path / f"process_{i}-of-2.json").write_text(json.dumps(it.get_state()))
    with pytest.raises(
        ValueError,
        match=f"checkpoint in {re.escape(str(tmp_path))} mixes saves of different steps: "
        "process_0-of-2.json and process_1-of-2.json hold different states",
    ):
        checkpoint.CheckpointHandler().restore(tmp_path, ElasticIterator(ds, 4, ShardOptions(0, 1)))


def test_importing_grain_core_leaves_asyncio_out() -> None:
    # Every worker's forkserver and every training script imports grain_core: asyncio alone
    # costs ~50 ms there, and only Orbax's coroutines need it.
    code = "import sys, grain_core; assert 'asyncio' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_round_trip_through_an_fsspec_url() -> None:
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://grain-core-checkpoint-{os.getpid()}/step_3"
    handler = checkpoint.CheckpointHandler()
    it = _dataset_iterator()
    for _ in range(3):
        next(it)
    handler.save(url, it)
    fs = fsspec.filesystem("memory")
    assert json.loads(fs.cat_file(f"{url}/process_0-of-1.json")) == {"next_index": 3}
    fresh = _dataset_iterator()
    handler.restore(url, fresh)
    assert list(fresh) == [6, 8, 10, 12, 14, 16, 18]
    with pytest.raises(ValueError, match=f"{url}_missing/process_0-of-1.json does not exist"):
        handler.restore(f"{url}_missing", _dataset_iterator())
    fs.rm(url.removesuffix("/step_3"), recursive=True)


def test_killed_saves_leave_no_temporary_files_behind(tmp_path: Path) -> None:
    # Each child is killed in the middle of a save (after writing its temporary file).
    code = (
        "import os, signal, grain_core as grain\n"
        "from grain_core import checkpoint, storage\n"
        "def die(*args, **kwargs): os.kill(os.getpid(), signal.SIGKILL)\n"
        "storage.os.replace = die\n"
        "it = iter(grain.MapDataset.range(4).to_iter_dataset())\n"
        f"checkpoint.CheckpointHandler().save({str(tmp_path)!r}, it)\n"
    )
    for _ in range(3):
        killed = subprocess.run([sys.executable, "-c", code], check=False)
        assert killed.returncode == -9
    assert len(os.listdir(tmp_path)) == 3
    checkpoint.CheckpointHandler().save(tmp_path, _dataset_iterator())
    assert os.listdir(tmp_path) == ["process_0-of-1.json"]


class _VisitCountingIterator(grain.DatasetIterator[int]):
    """Passes its parent's elements and state through, recording each call a restore makes."""

    def __init__(self, parent: grain.DatasetIterator[int], visits: list[str]) -> None:
        super().__init__(parent)
        self._visits = visits

    def __next__(self) -> int:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._visits.append("set_state")
        self._parent.set_state(state)

    def start_prefetch(self) -> None:
        self._visits.append("start_prefetch")
        super().start_prefetch()


class _VisitCounting(grain.IterDataset[int]):
    def __init__(self, parent: grain.IterDataset[int], visits: list[str]) -> None:
        super().__init__(parent)
        self._visits = visits

    def __iter__(self) -> grain.DatasetIterator[int]:
        return _VisitCountingIterator(iter(self._parent), self._visits)


class _SignallingSource:
    """Ten records; reading record ``signal_at`` sets ``read``."""

    def __init__(self, signal_at: int) -> None:
        self.read = threading.Event()
        self._signal_at = signal_at

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        if index == self._signal_at:
            self.read.set()
        return index


def test_restore_walks_the_iterator_tree_once_and_starts_the_read_ahead(tmp_path: Path) -> None:
    handler = checkpoint.CheckpointHandler()
    source = _SignallingSource(signal_at=4)
    visits: list[str] = []

    def make() -> Any:
        read = grain.MapDataset.source(source).to_iter_dataset()
        read_ahead = grain.experimental.ThreadPrefetchIterDataset(read, prefetch_buffer_size=2)
        return iter(_VisitCounting(read_ahead, visits).map(lambda x: x * 2))

    with make() as it:
        for _ in range(3):
            next(it)
        handler.save(tmp_path, it)
    source.read.clear()
    with make() as fresh:
        visits.clear()
        handler.restore(tmp_path, fresh)
        assert visits == ["set_state"]
        # The restore started the read-ahead thread: record 4 is read before any next().
        assert source.read.wait(timeout=120)
        assert list(fresh) == [6, 8, 10, 12, 14, 16, 18]


def test_restore_creates_and_starts_an_interleaves_inputs_in_one_walk(tmp_path: Path) -> None:
    handler = checkpoint.CheckpointHandler()
    visits: list[str] = []

    def make() -> Any:
        inputs = [
            _VisitCounting(grain.MapDataset.range(start, 40, 4).to_iter_dataset(), visits)
            for start in range(4)
        ]
        return iter(
            grain.experimental.InterleaveIterDataset(inputs, cycle_length=2, iter_buffer_size=0)
        )

    with make() as it:
        expected = list(it)
    with make() as it:
        for _ in range(5):
            next(it)
        handler.save(tmp_path, it)
    with make() as fresh:
        visits.clear()
        handler.restore(tmp_path, fresh)
        # The two inputs in the cycle are created with their states and started: one visit each.
        assert visits == ["set_state", "set_state"]
        assert list(fresh) == expected[5:]
