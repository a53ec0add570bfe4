"""Advanced datasets and helpers (``grain.experimental``).

File-format datasets (``ParquetIterDataset``, ``TFRecordIterDataset``) come from format
plugins and resolve lazily through the plugin registry.
"""

from __future__ import annotations

from typing import Any

from grain_core.capabilities import SupportsNextBlock
from grain_core.dataset.autotune import PerformanceConfig, pick_performance_config
from grain_core.dataset.base import ElementBlock
from grain_core.dataset.debug import DatasetGraph, GraphNode, dataset_graph
from grain_core.dataset.elastic import ElasticIterator
from grain_core.dataset.element_spec import (
    ShapeDtypeStruct,
    ShapeDtypeStructProtocol,
    get_element_spec,
)
from grain_core.dataset.multithread import multithread_prefetch
from grain_core.dataset.next_index import get_next_index, set_next_index
from grain_core.dataset.ops.apply import apply_transformations
from grain_core.dataset.ops.cache import CacheIterDataset
from grain_core.dataset.ops.flatmap import FlatMapIterDataset, FlatMapMapDataset
from grain_core.dataset.ops.interleave import InterleaveIterDataset
from grain_core.dataset.ops.limit import LimitIterDataset
from grain_core.dataset.ops.packing import (
    BestFitPackIterDataset,
    FirstFitPackIterDataset,
    PackAndBatchOperation,
)
from grain_core.dataset.ops.packing_concat_split import BOSHandling, ConcatThenSplitIterDataset
from grain_core.dataset.ops.rebatch import RebatchIterDataset, batch_and_pad
from grain_core.dataset.ops.repeat import RepeatIterDataset
from grain_core.dataset.ops.window_shuffle import WindowShuffleIterDataset, WindowShuffleMapDataset
from grain_core.dataset.ops.zip import ZipIterDataset, ZipMapDataset
from grain_core.dataset.options import DatasetOptions, ExecutionTrackingMode
from grain_core.dataset.prefetch import ThreadPrefetchDatasetIterator, ThreadPrefetchIterDataset
from grain_core.dataset.stats import ExecutionSummary, StageSummary, get_execution_summary
from grain_core.dataset.trace import Trace
from grain_core.dataset.with_options import WithOptionsIterDataset
from grain_core.jax_utils import device_put, make_global_batch
from grain_core.plugins import resolve_public_name
from grain_core.random import RngPool, index_shuffle
from grain_core.testing import assert_equal_output_after_checkpoint
from grain_core.transforms import FlatMap as FlatMapTransform
from grain_core.transforms import MapWithIndex as MapWithIndexTransform

__all__ = [
    "BOSHandling",
    "BestFitPackIterDataset",
    "CacheIterDataset",
    "ConcatThenSplitIterDataset",
    "DatasetGraph",
    "DatasetOptions",
    "ElasticIterator",
    "ElementBlock",
    "ExecutionSummary",
    "ExecutionTrackingMode",
    "FirstFitPackIterDataset",
    "FlatMapIterDataset",
    "FlatMapMapDataset",
    "FlatMapTransform",
    "GraphNode",
    "InterleaveIterDataset",
    "LimitIterDataset",
    "MapWithIndexTransform",
    "PackAndBatchOperation",
    "PerformanceConfig",
    "RebatchIterDataset",
    "RepeatIterDataset",
    "RngPool",
    "ShapeDtypeStruct",
    "ShapeDtypeStructProtocol",
    "StageSummary",
    "SupportsNextBlock",
    "ThreadPrefetchDatasetIterator",
    "ThreadPrefetchIterDataset",
    "Trace",
    "WindowShuffleIterDataset",
    "WindowShuffleMapDataset",
    "WithOptionsIterDataset",
    "ZipIterDataset",
    "ZipMapDataset",
    "apply_transformations",
    "assert_equal_output_after_checkpoint",
    "batch_and_pad",
    "dataset_graph",
    "device_put",
    "get_element_spec",
    "get_execution_summary",
    "get_next_index",
    "index_shuffle",
    "make_global_batch",
    "multithread_prefetch",
    "pick_performance_config",
    "set_next_index",
]


def __getattr__(name: str) -> Any:
    return resolve_public_name(__name__, name)
