"""Keras 3 and MaxText run unchanged on ``import grain``: the scenarios ``tests/clients``
checks, written once and run under two implementations of ``grain``.

Under grain_core (the test session) :func:`use_grain_core` runs first; under Google Grain (a
separate virtualenv that ``nox -s tests-clients`` makes, never a dependency of a package)
``python scenarios.py DATA OUT`` writes every scenario's values to ``OUT`` (a pickle), which
the tests compare with their own. The data files are written once, by :func:`write_data` in
the grain_core session (array_record, pyarrow, and grain_tfrecord's writer), and read by both.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: Text documents of varied lengths: packing and chunking have work to do.
DOCUMENTS = [
    f"document {i} " + " ".join(f"word{j % 7}" for j in range(3 + (i * 5) % 17)) for i in range(48)
]
MAX_TARGET_LENGTH = 16
GLOBAL_BATCH = 4
#: Batches read before a checkpoint, and after it (by the first iterator and the restored one).
BEFORE, AFTER = 3, 3


def use_grain_core() -> None:
    """Serves ``import grain`` from grain_core (before Keras or MaxText import it)."""
    import grain_core  # the implementation under test; Google Grain's run never calls this

    grain_core.install_as_grain()


# ----------------------------------------------------------------------------- the data
def _example(text: str) -> bytes:
    from maxtext.input_pipeline.protos import example_pb2  # imports grain: after the alias

    example = example_pb2.Example()
    example.features.feature["text"].bytes_list.value.append(text.encode())
    return example.SerializeToString()


def write_data(directory: Path) -> None:
    """ArrayRecord, Parquet and TFRecord shards of :data:`DOCUMENTS`, and a byte-level
    tiktoken vocabulary (every byte one token: nothing to download)."""
    import pyarrow as pa  # optional dependency: this session's
    import pyarrow.parquet as pq  # optional dependency: this session's
    from array_record.python.array_record_module import (  # optional dependency: this session's
        ArrayRecordWriter,
    )
    from grain_tfrecord import TFRecordWriter  # optional dependency: this session's

    directory.mkdir(parents=True, exist_ok=True)
    halves = [DOCUMENTS[k::2] for k in range(2)]
    for k, docs in enumerate(halves):
        writer = ArrayRecordWriter(str(directory / f"docs-{k}.array_record"), "group_size:1")
        for doc in docs:
            writer.write(_example(doc))
        writer.close()
        pq.write_table(pa.table({"text": docs}), directory / f"docs-{k}.parquet")
        with TFRecordWriter(str(directory / f"docs-{k}.tfrecord")) as tf_writer:
            for doc in docs:
                tf_writer.write(_example(doc))
    vocabulary = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    (directory / "bytes.tiktoken").write_text(vocabulary)
    mixture = {
        "first": {"path": str(directory / "docs-0.array_record"), "weight": 0.3},
        "second": {"path": str(directory / "docs-1.array_record"), "weight": 0.7},
    }
    (directory / "mixture.json").write_text(json.dumps(mixture))


# ----------------------------------------------------------------------------- MaxText
_ELASTIC = {"grain_use_elastic_iterator": True, "packing": False, "use_truncation": True}
#: MaxText configurations: (grain_file_type, files, overrides of the base configuration).
MAXTEXT_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "arrayrecord_first_fit": ("arrayrecord", "docs-0.array_record", {}),
    "arrayrecord_mixture_best_fit": (
        "arrayrecord",
        "docs-0.array_record,0.3;docs-1.array_record,0.7",
        {"grain_packing_type": "best_fit"},
    ),
    "arrayrecord_mixture_config": (
        "arrayrecord",
        "",
        {"grain_train_mixture_config_path": "mixture.json"},
    ),
    "parquet_interleave_concat_split_mp": (
        "parquet",
        "docs-*.parquet",
        {"grain_packing_type": "concat_then_split", "grain_worker_count": 2},
    ),
    "tfrecord_padded_mp": (
        "tfrecord",
        "docs-*.tfrecord",
        {"packing": False, "grain_worker_count": 2},
    ),
    # ElasticIterator takes a MapDataset (as in Grain): truncation, no packing.
    "arrayrecord_elastic": ("arrayrecord", "docs-0.array_record", _ELASTIC),
    "arrayrecord_elastic_mp": (
        "arrayrecord",
        "docs-0.array_record",
        {**_ELASTIC, "grain_worker_count": 2},
    ),
}


def _maxtext_config(data: Path, file_type: str, files: str, overrides: dict[str, Any]) -> Any:
    import ml_collections  # MaxText's configuration type; this session's only

    files = ";".join(
        ",".join([str(data / part.split(",")[0]), *part.split(",")[1:]])
        for part in files.split(";")
        if part
    )
    config = {
        "global_batch_size_to_load": GLOBAL_BATCH,
        "steps": 0,
        "grain_file_type": file_type,
        "data_shuffle_seed": 7,
        "mmap_npy_split": None,
        "grain_train_files": files,
        "grain_train_mixture_config_path": None,
        "hf_path": "",
        "dataset_path": "",
        "dataset_name": "",
        "train_split": "train",
        "enable_data_shuffling": True,
        "grain_shuffle_buffer_size": 8,
        "num_epoch": 2,
        "grain_worker_count": 0,
        "grain_num_threads": 2,
        "grain_prefetch_buffer_size": 4,
        "grain_data_source_max_workers": 2,
        "grain_use_elastic_iterator": False,
        "train_data_columns": ["text"],
        "tokenize_train_data": True,
        "grain_per_worker_buffer_size": 1,
        "use_sft": False,
        "use_multimodal": False,
        "use_dpo": False,
        "colocated_python_data_input": False,
        "expansion_factor_real_data": -1,
        "generate_padding_batch_train": False,
        "max_target_length": MAX_TARGET_LENGTH,
        "use_truncation": False,
        "add_bos": True,
        "add_eos": True,
        "tokenizer_path": str(data / "bytes.tiktoken"),
        "tokenizer_type": "tiktoken",
        "hf_access_token": None,
        "elastic_enabled": False,
        "packing": True,
        "max_segments_per_seq": 4,
        "grain_packing_type": "first_fit",
        "grain_ram_budget_mb": 512,
        "checkpoint_dir": "",
    }
    config.update(overrides)
    if config["grain_train_mixture_config_path"]:
        config["grain_train_mixture_config_path"] = str(
            data / config["grain_train_mixture_config_path"]
        )
    return ml_collections.ConfigDict(config)


def _numpy(batch: Any) -> dict[str, np.ndarray]:
    return {key: np.asarray(value) for key, value in batch.items()}


def _maxtext_iterator(data: Path, name: str) -> Any:
    """MaxText's training iterator (``MultiHostDataLoadIterator``) on this host's one device."""
    import jax  # import cost: only the client scenarios need it
    from maxtext.input_pipeline.grain_data_processing import (  # imports grain: after the alias
        make_grain_train_iterator,
    )

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    config = _maxtext_config(data, *MAXTEXT_CONFIGS[name])
    return make_grain_train_iterator(config, mesh, [jax.process_index()])


def _close(it: Any) -> None:
    # The Grain iterator, not MaxText's close(): Google Grain's own close fails there
    # (MaxText asks hasattr(node, "_parent") of a source, where Grain's property asserts).
    it.local_iterator.close()


def maxtext_batches(data: Path, name: str) -> dict[str, Any]:
    """Batches of MaxText's ``make_grain_train_iterator`` for configuration ``name``: the
    first ``BEFORE + AFTER``, and the ``AFTER`` a new iterator gives after restoring the state
    taken at ``BEFORE``."""
    it = _maxtext_iterator(data, name)
    first = [_numpy(next(it)) for _ in range(BEFORE)]
    state = it.local_iterator.get_state()
    state = json.loads(json.dumps(state))  # as a checkpoint file holds it
    rest = [_numpy(next(it)) for _ in range(AFTER)]
    _close(it)
    return {"batches": first + rest, "resumed": maxtext_resume(data, name, state), "state": state}


def maxtext_resume(data: Path, name: str, state: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """The ``AFTER`` batches of a new iterator for configuration ``name`` restored to
    ``state`` (a checkpoint of this implementation or of the other)."""
    restored = _maxtext_iterator(data, name)
    restored.local_iterator.set_state(state)
    resumed = [_numpy(next(restored)) for _ in range(AFTER)]
    _close(restored)
    return resumed


# ----------------------------------------------------------------------------- Keras
KERAS_INPUTS = ("map_dataset", "iter_dataset_mp", "data_loader")


def _keras_arrays() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)
    return x, y[:, None]


class _Pairs:
    """A random-access source of ``(x, y)`` rows (picklable for worker processes)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]


def _keras_input(kind: str) -> Any:
    import grain  # grain_core or Google Grain, whichever this process serves

    source = _Pairs(*_keras_arrays())
    if kind == "map_dataset":
        return grain.MapDataset.source(source).batch(16)
    if kind == "iter_dataset_mp":
        return (
            grain.MapDataset.source(source)
            .to_iter_dataset()
            .batch(16)
            .mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
        )
    return grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(
            len(source), grain.sharding.NoSharding(), shuffle=False, num_epochs=1
        ),
        operations=[grain.transforms.Batch(16)],
        worker_count=2,
    )


def keras_values(kind: str) -> dict[str, Any]:
    """Losses of ``fit`` (2 epochs) and ``evaluate`` and the ``predict`` output of a small
    model trained by Keras 3 (JAX backend) on the input ``kind``."""
    import keras  # imports grain lazily: after the alias

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(_keras_input(kind), epochs=2, verbose=0)
    loss = model.evaluate(_keras_input(kind), verbose=0)
    predicted = model.predict(_keras_input(kind), verbose=0)
    return {"fit": history.history["loss"], "evaluate": loss, "predict": predicted}


def all_values(data: Path) -> dict[str, Any]:
    """Every scenario's values, by name."""
    values = {f"keras/{kind}": keras_values(kind) for kind in KERAS_INPUTS}
    values.update({f"maxtext/{name}": maxtext_batches(data, name) for name in MAXTEXT_CONFIGS})
    return values


if __name__ == "__main__":
    # write-data DIR (grain_core's session) | reference DIR OUT (Google Grain's virtualenv)
    if sys.argv[1] == "write-data":
        write_data(Path(sys.argv[2]))
    else:
        from absl import flags  # Google Grain reads its options from absl flags

        flags.FLAGS.mark_as_parsed()
        Path(sys.argv[3]).write_bytes(pickle.dumps(all_values(Path(sys.argv[2]))))
