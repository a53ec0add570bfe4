"""grain_core._checkpoint_io: every way of saving an iterator writes the same bytes.

Each case saves an iterator after a few steps through one of the paths that write checkpoints
(``CheckpointHandler``, the Orbax v1 ``save`` of a dataset iterator and of a DataLoader
iterator, an ``ElasticIterator`` in both modes, ``device_put`` over a DataLoader, an Orbax
``CheckpointManager``) and compares every file, byte for byte, with the one that path wrote
before the codec was one module (``tests/data/checkpoints/<case>/``). Restoring those files
continues each stream where it stopped, so checkpoints written before still restore.
"""

from __future__ import annotations

import ast
import asyncio
import shutil
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import grain_core as grain
from grain_core import _checkpoint_io
from grain_core.checkpoint import CheckpointHandler
from grain_core.experimental import ElasticIterator, InterleaveIterDataset, device_put
from grain_core.samplers import IndexSampler
from grain_core.sharding import ShardOptions

GOLDEN = Path(__file__).parent / "data" / "checkpoints"
_STEPS = 3
_FILES = [list(range(100 * k, 100 * k + 3 + k)) for k in range(4)]


def _dataset_iterator() -> Any:
    return iter(grain.MapDataset.range(10).map(lambda x: x * 2).to_iter_dataset())


def _loader(workers: int = 0) -> grain.DataLoader:
    return grain.DataLoader(
        data_source=list(range(10)), sampler=IndexSampler(10, num_epochs=1), worker_count=workers
    )


def _elastic_map(index: int = 0) -> ElasticIterator:
    return ElasticIterator(grain.MapDataset.range(24), 4, ShardOptions(index, 2))


def _elastic_iter(index: int) -> ElasticIterator:
    ds = InterleaveIterDataset([grain.MapDataset.source(f) for f in _FILES], cycle_length=2)
    return ElasticIterator(ds, 2, ShardOptions(index, 2))


def _device_put_loader() -> Any:
    jax = pytest.importorskip("jax")
    return iter(device_put(_loader(), jax.devices()[0]))


def _advance(it: Any, steps: int = _STEPS) -> Any:
    for _ in range(steps):
        next(it)
    return it


def _run(make_coroutine: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    async def run() -> None:
        await (await make_coroutine())

    asyncio.run(run())


def _orbax_manager_save(directory: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    from grain_core import checkpoint

    with _loader().__iter__() as it, ocp.CheckpointManager(directory) as manager:
        _advance(it)
        manager.save(1, args=ocp.args.Composite(data=checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()


def _orbax_manager_restore(directory: Path) -> list[Any]:
    ocp = pytest.importorskip("orbax.checkpoint")
    from grain_core import checkpoint

    with _loader().__iter__() as fresh, ocp.CheckpointManager(directory) as manager:
        manager.restore(1, args=ocp.args.Composite(data=checkpoint.CheckpointRestore(fresh)))
        return list(fresh)


def _handler_save(make: Callable[[], Any]) -> Callable[[Path], None]:
    def save(directory: Path) -> None:
        it = _advance(make())
        CheckpointHandler().save(directory, it)
        it.close()

    return save


def _handler_restore(make: Callable[[], Any]) -> Callable[[Path], list[Any]]:
    def restore(directory: Path) -> list[Any]:
        with CheckpointHandler().restore(directory, make()) as it:
            return [np.asarray(x).tolist() for x in it]

    return restore


def _elastic_iter_save(directory: Path) -> None:
    for index in range(2):
        _handler_save(lambda index=index: _elastic_iter(index))(directory)


def _elastic_iter_restore(directory: Path) -> list[Any]:
    return [
        x
        for index in range(2)
        for x in _handler_restore(lambda index=index: _elastic_iter(index))(directory)
    ]


def _orbax_v1_save(make: Callable[[], Any]) -> Callable[[Path], None]:
    def save(directory: Path) -> None:
        it = _advance(make())
        _run(lambda: it.save(directory))
        it.close()

    return save


def _orbax_v1_restore(make: Callable[[], Any]) -> Callable[[Path], list[Any]]:
    def restore(directory: Path) -> list[Any]:
        fresh = make()
        _run(lambda: fresh.load(directory))
        with fresh:
            return [np.asarray(x).tolist() for x in fresh]

    return restore


def _rest(make: Callable[[], Any]) -> Callable[[], list[Any]]:
    def rest() -> list[Any]:
        with make() as it:
            _advance(it)
            return [np.asarray(x).tolist() for x in it]

    return rest


def _elastic_iter_rest() -> list[Any]:
    return [x for index in range(2) for x in _rest(lambda index=index: _elastic_iter(index))()]


# case -> (save into a directory, restore from it and drain, what an uninterrupted run gives)
CASES: dict[
    str, tuple[Callable[[Path], None], Callable[[Path], list[Any]], Callable[[], list[Any]]]
] = {
    "handler_dataset_iterator": (
        _handler_save(_dataset_iterator),
        _handler_restore(_dataset_iterator),
        _rest(_dataset_iterator),
    ),
    "handler_data_loader": (
        _handler_save(lambda: iter(_loader())),
        _handler_restore(lambda: iter(_loader())),
        _rest(lambda: iter(_loader())),
    ),
    "handler_data_loader_2_workers": (
        _handler_save(lambda: iter(_loader(2))),
        _handler_restore(lambda: iter(_loader(2))),
        _rest(lambda: iter(_loader(2))),
    ),
    "orbax_v1_dataset_iterator": (
        _orbax_v1_save(_dataset_iterator),
        _orbax_v1_restore(_dataset_iterator),
        _rest(_dataset_iterator),
    ),
    "orbax_v1_data_loader": (
        _orbax_v1_save(lambda: iter(_loader())),
        _orbax_v1_restore(lambda: iter(_loader())),
        _rest(lambda: iter(_loader())),
    ),
    "handler_elastic_map_dataset": (
        _handler_save(_elastic_map),
        _handler_restore(_elastic_map),
        _rest(_elastic_map),
    ),
    "handler_elastic_iter_dataset": (_elastic_iter_save, _elastic_iter_restore, _elastic_iter_rest),
    "handler_device_put_data_loader": (
        _handler_save(_device_put_loader),
        _handler_restore(_device_put_loader),
        _rest(_device_put_loader),
    ),
    "orbax_checkpoint_manager_data_loader": (
        _orbax_manager_save,
        _orbax_manager_restore,
        _rest(lambda: iter(_loader())),
    ),
}


def _files(directory: Path) -> Iterator[tuple[str, bytes]]:
    for path in sorted(directory.rglob("*.json")):
        if path.name.startswith("process_") or path.name.startswith("shard_state_"):
            yield str(path.relative_to(directory)), path.read_bytes()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_save_path_writes_the_golden_bytes(case: str, tmp_path: Path) -> None:
    save, _, _ = CASES[case]
    save(tmp_path)
    written = dict(_files(tmp_path))
    golden = dict(_files(GOLDEN / case))
    assert written and sorted(written) == sorted(golden)
    for name, data in written.items():
        assert data == golden[name], f"{case}: {name} differs from the golden file"


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_golden_checkpoint_restores_where_it_stopped(case: str, tmp_path: Path) -> None:
    _, restore, rest = CASES[case]
    shutil.copytree(GOLDEN / case, tmp_path / "ckpt")
    assert restore(tmp_path / "ckpt") == rest()


# The modules that save, restore or check iterator states; none of them spells the encoding.
_STATE_MODULES = [
    "checkpoint.py",
    "data_loader.py",
    "jax_utils.py",
    "testing.py",
    "dataset/base.py",
    "dataset/elastic.py",
]


@pytest.mark.parametrize("module", _STATE_MODULES)
def test_only_the_codec_module_imports_json(module: str) -> None:
    tree = ast.parse((Path(grain.__file__).parent / module).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert "json" not in imported, f"{module} encodes states itself; use grain_core._checkpoint_io"


class _Recorder:
    """An iterator of another library: a state, and the states it was given."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.given: list[Any] = []

    def get_state(self) -> Any:
        return self.state

    def set_state(self, state: Any) -> None:
        self.given.append(state)


class _BytesRecorder(_Recorder):
    state_is_bytes = True


class _EverywhereRecorder(_Recorder):
    state_same_on_every_process = True


def test_the_bytes_state_capability_chooses_what_set_state_gets(tmp_path: Path) -> None:
    text = b'{\n    "position": 3\n}'
    _checkpoint_io.save_item(tmp_path, _BytesRecorder(text))
    assert (tmp_path / "process_0-of-1.json").read_bytes() == text
    declared, undeclared = _BytesRecorder(b""), _Recorder({})
    _checkpoint_io.restore_item(tmp_path, declared)
    _checkpoint_io.restore_item(tmp_path, undeclared)
    assert declared.given == [text]
    assert undeclared.given == [{"position": 3}]


def test_the_same_state_capability_restores_from_another_process_file(tmp_path: Path) -> None:
    _checkpoint_io.write_process_file(tmp_path, '{"global_next_index": 8}', (1, 2))
    everywhere = _EverywhereRecorder({})
    _checkpoint_io.restore_item(tmp_path, everywhere)
    assert everywhere.given == [{"global_next_index": 8}]
    with pytest.raises(ValueError, match="process_0-of-1.json does not exist"):
        _checkpoint_io.restore_item(tmp_path, _Recorder({}))


@pytest.mark.parametrize("make", [_dataset_iterator, lambda: iter(_loader())])
def test_orbax_v1_load_names_a_corrupt_file(tmp_path: Path, make: Callable[[], Any]) -> None:
    (tmp_path / "process_0-of-1.json").write_text('{"next_index": ')
    with pytest.raises(ValueError, match=r"process_0-of-1.json is not valid JSON"):
        _run(lambda: make().load(tmp_path))


_JSON_STATES = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=12,
    ),
    max_size=6,
)


@given(_JSON_STATES)
def test_a_state_survives_the_codec_and_its_bytes_are_its_text(state: dict[str, Any]) -> None:
    text = _checkpoint_io.encode_state(state)
    assert _checkpoint_io.decode_state(text, "test") == state
    assert _checkpoint_io.decode_state(text.encode(), "test") == state
    assert _checkpoint_io.encode_state(text.encode()) == text


def test_undecodable_text_is_named() -> None:
    with pytest.raises(ValueError, match="DataLoader state is not valid JSON"):
        _checkpoint_io.decode_state(b"\xff{", "DataLoader state")
