"""The entry point module: registers the ``tfrecord`` format with grain_core."""

from __future__ import annotations

from collections.abc import Callable

from grain_core import hookimpl
from grain_core.plugins import FormatSpec
from grain_tfrecord._dataset import TFRecordIterDataset
from grain_tfrecord._example import decode_example
from grain_tfrecord._inspect import inspect_tfrecord
from grain_tfrecord._source import TFRecordDataSource
from grain_tfrecord._writer import TFRecordWriter

__all__ = ["register_formats"]


@hookimpl
def register_formats(register: Callable[[FormatSpec], None]) -> None:
    """Registers the TFRecord format."""
    register(
        FormatSpec(
            name="tfrecord",
            suffixes=(".tfrecord", ".tfrecords", ".tfrecord.gz", ".tfrecords.gz"),
            source=TFRecordDataSource,
            iter_dataset=TFRecordIterDataset,
            writer=TFRecordWriter,
            inspector=inspect_tfrecord,
            record_decoder=decode_example,
            exports={
                "grain_core.experimental": {
                    "TFRecordIterDataset": TFRecordIterDataset,
                    "TFRecordWriter": TFRecordWriter,
                },
                "grain_core.sources": {"TFRecordDataSource": TFRecordDataSource},
            },
            description="TFRecord (tf.train.Example) without TensorFlow: CRC-verified, indexed",
        )
    )
