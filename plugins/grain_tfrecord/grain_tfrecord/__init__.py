"""grainpipe-tfrecord: TFRecord files and ``tf.train.Example`` for grain_core, without TensorFlow.

* :class:`TFRecordIterDataset` streams records, verifying both CRCs of every frame.
* :class:`TFRecordDataSource` reads any record by index through a cached offset index.
* :class:`TFRecordReader` / :class:`TFRecordReaderIterator` read one record at a time from
  an open file (what code subclassing Grain's private TFRecord reader needs).
* :class:`TFRecordWriter` writes files TensorFlow reads (optionally GZIP/ZLIB).
* :func:`decode_example` / :func:`encode_example` (and the SequenceExample pair) convert
  ``tf.train.Example`` records to and from dicts of NumPy arrays.
* :func:`parse_example_batch` / :class:`ParseExamples` parse a whole batch of Examples into
  one array per feature, as ``tf.io.parse_example`` does.
"""

from __future__ import annotations

# The package index's `grain-core` is an unrelated project that also installs a top-level
# grain_core package; this plugin extends the grain_core of the `grainpipe` distribution.
try:
    import grain_core.plugins  # noqa: F401
except ModuleNotFoundError as err:
    if err.name not in ("grain_core", "grain_core.plugins"):
        raise
    raise ImportError(
        "grain_tfrecord needs grain_core from the `grainpipe` distribution, "
        + (
            "which is not installed: pip install . (in a clone of grain_core)"
            if err.name == "grain_core"
            else "but the grain_core installed here has no grain_core.plugins: it is another "
            "project's (the package index's `grain-core`). Replace it: "
            "pip uninstall grain-core && pip install . (in a clone of grain_core)"
        ),
        name="grain_core",
    ) from err

from grain_tfrecord._dataset import TFRecordIterDataset
from grain_tfrecord._example import (
    ExampleDecodeError,
    FeatureSpec,
    decode_example,
    decode_sequence_example,
    encode_example,
    encode_sequence_example,
)
from grain_tfrecord._example_batch import (
    FixedLenFeature,
    FixedLenSequenceFeature,
    ParseExamples,
    RaggedValues,
    VarLenFeature,
    parse_example_batch,
)
from grain_tfrecord._framing import CorruptRecordError
from grain_tfrecord._inspect import inspect_tfrecord
from grain_tfrecord._proto import example_message_classes
from grain_tfrecord._record_reader import TFRecordReader, TFRecordReaderIterator
from grain_tfrecord._source import TFRecordDataSource
from grain_tfrecord._writer import TFRecordWriter

__all__ = [
    "CorruptRecordError",
    "ExampleDecodeError",
    "FeatureSpec",
    "FixedLenFeature",
    "FixedLenSequenceFeature",
    "ParseExamples",
    "RaggedValues",
    "TFRecordDataSource",
    "TFRecordIterDataset",
    "TFRecordReader",
    "TFRecordReaderIterator",
    "TFRecordWriter",
    "VarLenFeature",
    "decode_example",
    "decode_sequence_example",
    "encode_example",
    "encode_sequence_example",
    "example_message_classes",
    "inspect_tfrecord",
    "parse_example_batch",
]
