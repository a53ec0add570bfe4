"""Grain's tests that fail on grain_core, each with its reason: deliberate differences
(``docs/compatibility.md``, "Grain's own tests") and known gaps (with the issue that tracks
them). ``grain_paths`` marks them ``xfail(strict=True)``: a new failure, or a listed test that
passes, is red.

Keys are pytest node ids below the extracted ``suite/`` folder
(``python/dataset/transformations/batch_test.py::<Class>::<test>``).
"""

from __future__ import annotations

__all__ = ["EXPECTED_FAILURES"]

_T = "python/dataset/transformations"
_DOC = "docs/compatibility.md, Grain's own tests"


def _internal(name: str) -> str:
    return (
        f"deliberate: the test reaches Grain's internal {name}, which no public name of Grain "
        f"serves and grain_core does not copy ({_DOC})"
    )


ELASTIC_LAYOUT = (
    "deliberate: ElasticIterator over a MapDataset gives shard s the s-th block of each global "
    "batch (docs/compatibility.md, ElasticIterator over a MapDataset)"
)
SAMPLER_EPOCHS = (
    "deliberate: IndexSampler runs num_epochs whole epochs on every shard "
    "(docs/compatibility.md, Sharding with several epochs)"
)
PACKER_VALIDATES_WHEN_BUILT = (
    f"deliberate: a nested packed feature not marked as a meta feature is refused when the "
    f"packer is built, not at its first element ({_DOC})"
)
SOURCE_PATH = (
    "deliberate: the name expected holds the path of a file in Grain's tree (.../_src/core/); "
    "the runner runs Grain's tests from suite/ and the function is grain_core's"
)
TUNING_ESTIMATE = (
    "deliberate: pick_performance_config's buffer size is grain_core's own estimate "
    "(docs/compatibility.md, Not part of the contract)"
)

_TESTS_BY_REASON: dict[str, tuple[str, ...]] = {
    SOURCE_PATH: (
        "core/transforms_test.py::GetPrettyTransformNameTest::test_get_pretty_transform_name0",
        "core/transforms_test.py::GetPrettyTransformNameTest::test_get_pretty_transform_name1",
    ),
    _internal("`BatchIterDataset._batch_fn`, Grain's `functools.partial` of `make_batch`"): (
        f"{_T}/batch_test.py::BatchIterDatasetTest::test_batch_shared_memory_source_ds_jax",
        f"{_T}/batch_test.py::BatchIterDatasetTest::test_batch_shared_memory_source_ds_no_jax",
    ),
    _internal("`DataLoader._dataset`, the dataset graph Grain's DataLoader builds"): (
        f"{_T}/batch_test.py::BatchIterDatasetTest::test_dataloader_enables_shared_memory_on_batch_dataset",
    ),
    _internal("`FilterMapDataset._initialize_stats`, Grain's statistics hook"): (
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_stats_are_initialized_in_a_single_thread0",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_stats_are_initialized_in_a_single_thread1",
    ),
    _internal("`PrefetchIterDataset._read_options` and its iterator's buffer and thread fields"): (
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_prefetch_data_dense0",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_prefetch_data_dense1",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_prefetch_data_dense2",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_prefetch_data_sparse0",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_prefetch_data_sparse1",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_prefetch_data_sparse2",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_prefetch_does_not_buffer_unnecessary_elements",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_num_threads_decrease_threads",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_num_threads_decrease_to_zero",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_num_threads_increase_from_zero",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_num_threads_increase_threads",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_prefetch_buffer_size_0_to_positive",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_prefetch_buffer_size_decrease",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_prefetch_buffer_size_increase",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_set_prefetch_buffer_size_positive_to_0",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_start_prefetch1",
        f"{_T}/prefetch_test.py::PrefetchIterDatasetTest::test_start_prefetch3",
    ),
    _internal("`prefetch.PrefetchDatasetIterator.get_state`, patched on the class"): (
        f"{_T}/prefetch_test.py::ThreadPrefetchIterDatasetTest::test_set_next_index_get_state",
    ),
    _internal("`prefetch_autotune`'s helpers, patched to count their calls"): (
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_autotune_calculates_workers_correctly",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_autotune_passes_worker_init_fn",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_autotune_with_insufficient_samples_defaults_to_max_workers",
    ),
    _internal("`MixedIterDataset(parents=..., proportions=...)`'s signature"): (
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_checkpointing",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_element_spec",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_len",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_mix_infinite_datasets",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_mixing_equal_probability_with_float_proportions",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_mixing_equal_probability_with_integer_proportions",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_mixing_equal_probability_with_no_proportions_given",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_mixing_with_float_proportions",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_mixing_with_integer_proportions",
        f"{_T}/mix_test.py::MixedIterDatasetTest::test_mixing_zero_one_probability_fails_with_error",
    ),
    _internal("`batch._MakeBatchParallel`"): (
        f"{_T}/batch_test.py::MakeBatchParallelTest::test_batch_parallel_shared_memory_disabled",
        f"{_T}/batch_test.py::MakeBatchParallelTest::test_batch_parallel_shared_memory_enabled",
        f"{_T}/batch_test.py::MakeBatchParallelTest::test_batch_parallel_shared_memory_object_dtype",
        f"{_T}/batch_test.py::MakeBatchParallelTest::test_pickle_parallel_batch_preserves_flag",
        f"{_T}/batch_test.py::MakeBatchTest::test_batch_different_shapes_parallel_batch_enabled_error",
        f"{_T}/batch_test.py::MakeBatchTest::test_batch_different_structures_parallel_batch_enabled_error",
        f"{_T}/batch_test.py::MakeBatchTest::test_batch_non_numpy_values",
        f"{_T}/batch_test.py::MakeBatchTest::test_batch_single_value_parallel_batch_enabled_success",
        f"{_T}/batch_test.py::MakeBatchTest::test_batch_two_values_parallel_batch_enabled_success",
        f"{_T}/batch_test.py::StringTruncationTest::test_parallel_batch_parallel_path_no_shm_preserves_strings",
        f"{_T}/batch_test.py::StringTruncationTest::test_parallel_batch_parallel_path_shm_preserves_strings",
        f"{_T}/batch_test.py::StringTruncationTest::test_parallel_batch_stack_shm_numpy_strings",
        f"{_T}/batch_test.py::StringTruncationTest::test_parallel_batch_stack_shm_preserves_variable_length_strings",
    ),
    _internal("`data_loader.CopyNumPyArrayToSharedMemory`"): (
        "python/data_loader_test.py::CopyNumPyArrayToSharedMemoryTest::test_copy_nested_numpy_array_to_shared_memory",
        "python/data_loader_test.py::CopyNumPyArrayToSharedMemoryTest::test_copy_numpy_array_to_shared_memory",
        "python/data_loader_test.py::CopyNumPyArrayToSharedMemoryTest::test_copy_skipped_dtype_hasobject",
        "python/data_loader_test.py::CopyNumPyArrayToSharedMemoryTest::test_copy_skipped_flags_c_contiguous",
        "python/data_loader_test.py::CopyNumPyArrayToSharedMemoryTest::test_copy_skipped_non_numpy_array",
    ),
    _internal("`filter.FilterThresholdChecker`"): (
        f"{_T}/filter_test.py::FilterValidatorTest::test_raises",
        f"{_T}/filter_test.py::FilterValidatorTest::test_validates",
        f"{_T}/filter_test.py::FilterValidatorTest::test_warns",
    ),
    _internal("`make_batch(..., output_to_shared_memory=...)`'s signature"): (
        f"{_T}/batch_test.py::StringTruncationTest::test_make_batch_shm_equal_length_strings_ok",
        f"{_T}/batch_test.py::StringTruncationTest::test_make_batch_shm_preserves_variable_length_strings",
        f"{_T}/batch_test.py::StringTruncationTest::test_make_batch_shm_string_order_independence",
        f"{_T}/batch_test.py::StringTruncationTest::test_make_batch_without_shm_preserves_strings",
    ),
    _internal("`map._reset_rng_state`"): (f"{_T}/map_test.py::RngPoolTest::test_reset_rng_state",),
    _internal("`mix._ConcatSelectionMap`"): (
        f"{_T}/mix_test.py::ConcatenateLazyMapTest::test_cannot_concatenate_infinite_datasets",
        f"{_T}/mix_test.py::ConcatenateLazyMapTest::test_concat_selection_map",
    ),
    _internal("`packing.PackingDatasetIterator.get_packed_batch_size_bytes`"): (
        f"{_T}/packing_test.py::BestFitPackIterDatasetTest::test_get_packed_batch_size_bytes",
        f"{_T}/packing_test.py::BestFitPackIterDatasetTest::test_get_packed_batch_size_bytes_before_next",
        f"{_T}/packing_test.py::FirstFitPackIterDatasetTest::test_get_packed_batch_size_bytes",
        f"{_T}/packing_test.py::FirstFitPackIterDatasetTest::test_get_packed_batch_size_bytes_before_next",
    ),
    _internal("`prefetch_autotune._find_prefetch_iter_dataset_parents`"): (
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_find_prefetch_iter_dataset_parent_multiple_parents",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_find_prefetch_iter_dataset_parent_multiple_parents_with_empty",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_find_prefetch_iter_dataset_parent_no_prefetch_iter_dataset",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_find_prefetch_iter_dataset_parent_returns_parent",
    ),
    _internal("`prefetch_autotune._get_average_element_size_mb`"): (
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_average_element_size_mb",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_average_element_size_mb_returns_zero_for_empty_dataset",
    ),
    _internal("`prefetch_autotune._get_buffer_size`"): (
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_buffer_size",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_buffer_size_calculates_correctly",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_buffer_size_respects_max_threads_cap",
    ),
    _internal("`prefetch_autotune._get_element_size_bytes`"): (
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_element_size_dict",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_element_size_list",
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_element_size_numpy",
    ),
    _internal("`prefetch_autotune._get_num_workers`"): (
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_num_workers_calculates_from_mean_element_size",
    ),
    _internal("`process_prefetch.ProcessPrefetchIterDataset`"): (
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_alternate_set_next_index_and_get_state",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_alternate_set_state_and_get_next_index",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_checkpoint0",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_checkpoint1",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_does_not_hang_after_stop_iteration",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_doesnt_hang_on_process_kill",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_get_next_index",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_get_state_doesnt_start_prefetch",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_options_after_prefetch",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_options_before_prefetch",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_parent_dataset_modifies_state",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_prefetch_data_process",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_prefetch_data_process_huge_buffer",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_prefetch_data_process_large_buffer",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_prefetch_traceback_preserves_worker_frames0",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_prefetch_traceback_preserves_worker_frames1",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_prefetch_traceback_preserves_worker_frames2",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_propagates_transform_error",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_reports_unpicklable_transform",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_reports_worker_crash",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_set_next_index",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_set_state_after_stop_iteration",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_set_state_does_not_restart_process",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_set_state_on_fresh_iterator",
        f"{_T}/process_prefetch_test.py::ProcessPrefetchIterDatasetTest::test_worker_init_fn",
    ),
    _internal("`process_prefetch.multiprocess_prefetch`, patched to count its calls"): (
        "python/dataset/dataset_test.py::DatasetTest::test_mp_prefetch_switches_to_threads_for_free_threaded_python",
    ),
    _internal("the `_element_spec` property (public: `get_element_spec(ds)`)"): (
        f"{_T}/map_test.py::MapIterDatasetTest::test_map_element_spec_inference",
        f"{_T}/map_test.py::MapIterDatasetTest::test_map_element_spec_inference_raises_error",
        f"{_T}/map_test.py::MapMapDatasetTest::test_map_element_spec_inference",
        f"{_T}/map_test.py::MapMapDatasetTest::test_map_element_spec_inference_raises_error",
        f"{_T}/map_test.py::MapMapDatasetTest::test_map_element_spec_propagets_output_spec_error",
        f"{_T}/map_test.py::MapWithIndexIterDatasetTest::test_map_with_index_element_spec_inference",
        f"{_T}/map_test.py::MapWithIndexIterDatasetTest::test_map_with_index_element_spec_inference_raises_error",
        f"{_T}/map_test.py::MapWithIndexMapDatasetTest::test_map_with_index_element_spec_inference",
        f"{_T}/map_test.py::MapWithIndexMapDatasetTest::test_map_with_index_element_spec_inference_raises_error",
        f"{_T}/map_test.py::RandomMapIterDatasetTest::test_random_map_element_spec_inference",
        f"{_T}/map_test.py::RandomMapIterDatasetTest::test_random_map_element_spec_inference_raises_error",
        f"{_T}/map_test.py::RandomMapMapDatasetTest::test_random_map_element_spec_inference",
        f"{_T}/map_test.py::RandomMapMapDatasetTest::test_random_map_element_spec_inference_raises_error",
    ),
    ELASTIC_LAYOUT: (
        "python/dataset/elastic_iterator_test.py::ElasticIteratorTest::test_produces_correct_elements2",
    ),
    PACKER_VALIDATES_WHEN_BUILT: (
        f"{_T}/packing_test.py::BestFitPackIterDatasetTest::test_nested_feature1",
        f"{_T}/packing_test.py::FirstFitPackIterDatasetTest::test_nested_feature1",
    ),
    SAMPLER_EPOCHS: (
        "python/samplers_test.py::IndexSamplerTest::test_sharding_no_shuffle_no_drop_remainder_multi_epoch",
        "python/samplers_test.py::IndexSamplerTest::test_shuffle_and_sharding_no_drop_remainder_multi_epoch",
    ),
    TUNING_ESTIMATE: (
        f"{_T}/prefetch_autotune_test.py::PrefetchAutotuneTest::test_get_average_element_size_mixed_ds_mb",
    ),
}

EXPECTED_FAILURES: dict[str, str] = {
    test: reason for reason, tests in _TESTS_BY_REASON.items() for test in tests
}
