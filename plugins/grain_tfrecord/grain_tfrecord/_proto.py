"""Protobuf message classes of the published ``tf.train.Example`` schema, without TensorFlow.

The descriptors are built in code in a private descriptor pool (so they never clash with
TensorFlow's own classes when it is installed too). Needs the optional ``protobuf`` extra.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

__all__ = ["example_message_classes"]

_PACKAGE = "tensorflow"


@functools.cache
def example_message_classes() -> SimpleNamespace:
    """Returns the message classes ``Example``, ``SequenceExample``, ``Features``, ``Feature``,
    ``FeatureList``, ``FeatureLists``, ``BytesList``, ``FloatList`` and ``Int64List``.

    Raises:
      ModuleNotFoundError: If ``protobuf`` is not installed (``pip install protobuf``).
    """
    try:
        from google.protobuf import (  # type: ignore[import-untyped]  # optional dependency
            descriptor_pb2,
            descriptor_pool,
            message_factory,
        )
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "example_message_classes() needs protobuf: pip install protobuf",
            name=err.name,
        ) from None
    field = descriptor_pb2.FieldDescriptorProto
    repeated, optional = field.LABEL_REPEATED, field.LABEL_OPTIONAL
    file = descriptor_pb2.FileDescriptorProto(
        name="grain_tfrecord/example.proto", package=_PACKAGE, syntax="proto3"
    )

    def message(
        name: str, *fields: tuple[str, int, int, int, str | None]
    ) -> descriptor_pb2.DescriptorProto:
        proto = file.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            entry = proto.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                entry.type_name = f".{_PACKAGE}.{type_name}"
        return proto

    def map_entry(parent: descriptor_pb2.DescriptorProto, entry: str, value: str) -> None:
        nested = parent.nested_type.add(name=entry)
        nested.options.map_entry = True
        nested.field.add(name="key", number=1, label=optional, type=field.TYPE_STRING)
        nested.field.add(
            name="value",
            number=2,
            label=optional,
            type=field.TYPE_MESSAGE,
            type_name=f".{_PACKAGE}.{value}",
        )

    message("BytesList", ("value", 1, repeated, field.TYPE_BYTES, None))
    message("FloatList", ("value", 1, repeated, field.TYPE_FLOAT, None))
    message("Int64List", ("value", 1, repeated, field.TYPE_INT64, None))
    feature = message(
        "Feature",
        ("bytes_list", 1, optional, field.TYPE_MESSAGE, "BytesList"),
        ("float_list", 2, optional, field.TYPE_MESSAGE, "FloatList"),
        ("int64_list", 3, optional, field.TYPE_MESSAGE, "Int64List"),
    )
    feature.oneof_decl.add(name="kind")
    for entry in feature.field:
        entry.oneof_index = 0
    features = message(
        "Features", ("feature", 1, repeated, field.TYPE_MESSAGE, "Features.FeatureEntry")
    )
    map_entry(features, "FeatureEntry", "Feature")
    message("FeatureList", ("feature", 1, repeated, field.TYPE_MESSAGE, "Feature"))
    feature_lists = message(
        "FeatureLists",
        ("feature_list", 1, repeated, field.TYPE_MESSAGE, "FeatureLists.FeatureListEntry"),
    )
    map_entry(feature_lists, "FeatureListEntry", "FeatureList")
    message("Example", ("features", 1, optional, field.TYPE_MESSAGE, "Features"))
    message(
        "SequenceExample",
        ("context", 1, optional, field.TYPE_MESSAGE, "Features"),
        ("feature_lists", 2, optional, field.TYPE_MESSAGE, "FeatureLists"),
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    names = [m.name for m in file.message_type]
    return SimpleNamespace(
        **{
            name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name in names
        }
    )
