"""The ``grain-core`` command line (also ``python -m grain_core``).

Commands: ``plugins`` (what is installed and what failed), ``inspect PATH`` (a file through
its format plugin), ``convert IN OUT`` (records from one format to another), ``demo`` (the
end-to-end example with its throughput), ``profile`` (an HTML report of a pipeline's time,
see ``grain_core.observe.profile``), ``bench`` (the repository's benchmark suite).
``--version`` lists the loaded plugins too.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grain_core import __version__, plugins, shard_names, storage
from grain_core._progress import progress

__all__ = ["main"]


_SAMPLE_CHARS = 200
_COMPRESSIONS = ("GZIP", "ZLIB", "NONE")
# The Python API's keyword arguments that the CLI offers as options: library messages that
# suggest one are shown with the option instead.
_OPTION_SPELLINGS = {
    "verify_crc=False": "--no-verify-crc",
    "compression='GZIP'": "--compression GZIP",
    "compression='ZLIB'": "--compression ZLIB",
}
# 128 + SIGPIPE: how a command that writes into a closed pipe ends (`grain-core ... | head`).
_EXIT_CLOSED_PIPE = 141
# The loggers of the fsspec file systems for object stores and of their HTTP clients.
_STORE_LOGGERS = ("fsspec", "s3fs", "gcsfs", "aiobotocore", "botocore", "google")
_SHARDED_NAME = re.compile(r"^(?P<base>.+?)(?:@(?P<at>\d+)|-(?:\d+|\*|\?+)-of-(?P<of>\d+))$")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the process exit code."""
    parser = _parser()
    # Unknown arguments are the benchmark runner's own (grain-core bench --only x --json).
    args, runner_args = parser.parse_known_args(argv)
    if runner_args and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(runner_args)}")
    args.runner_args = runner_args
    if args.version:
        print(_version_text())
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with _store_logs_quiet():
            code = int(args.run(args))
        sys.stdout.flush()  # a closed pipe shows here at the latest, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly; stdout goes to /dev/null so that the
        # interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _EXIT_CLOSED_PIPE
    except (plugins.PluginError, OSError, ValueError) as err:
        print(f"grain-core {args.command}: error: {_cli_spelling(str(err))}", file=sys.stderr)
        return 1
    except ImportError as err:  # an optional dependency: one line naming what to install
        print(f"grain-core {args.command}: error: {_install_hint(err)}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _store_logs_quiet() -> Iterator[None]:
    """Keeps the object-store clients' log records off the terminal during a command where
    no logging is configured: their failures reach the user as the command's one-line error
    (gcsfs logs a traceback for the retries that a lookup gives up after)."""
    if logging.getLogger().handlers:
        yield
        return
    loggers = [logging.getLogger(name) for name in _STORE_LOGGERS]
    kept = [(logger.propagate, logger.handlers[:]) for logger in loggers]
    for logger in loggers:
        logger.propagate = False
        logger.handlers = [logging.NullHandler()]
    try:
        yield
    finally:
        for logger, (propagate, handlers) in zip(loggers, kept, strict=True):
            logger.propagate, logger.handlers = propagate, handlers


def _install_hint(err: ImportError) -> str:
    """``err``'s message, with the ``pip install`` of the missing module where it names none
    (fsspec's own errors: "Install huggingface_hub to access HfFileSystem")."""
    message = str(err)
    if "pip install" in message:
        return message
    cause: BaseException | None = err
    while cause is not None and not (isinstance(cause, ImportError) and cause.name):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return message
    missing = str(cause.name).split(".")[0]  # type: ignore[attr-defined]
    return f"{message}: pip install {missing}"


def _cli_spelling(message: str) -> str:
    for keyword, option in _OPTION_SPELLINGS.items():
        message = message.replace(keyword, option)
    return message


def _add_read_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compression",
        type=str.upper,
        choices=_COMPRESSIONS,
        help="compression of the input (TFRecord; default: from its suffix, .gz is GZIP)",
    )
    parser.add_argument(
        "--no-verify-crc",
        dest="verify_crc",
        action="store_false",
        help="do not check record checksums (TFRecord; unsafe: damaged records pass)",
    )


def _read_options(args: argparse.Namespace) -> dict[str, Any]:
    """The input options given on the command line, as the format's keyword arguments."""
    options: dict[str, Any] = {}
    if args.compression is not None:
        options["compression"] = args.compression
    if not args.verify_crc:
        options["verify_crc"] = False
    return options


_OPTION_NAMES = {
    "compression": "--compression",
    "verify_crc": "--no-verify-crc",
    "output_compression": "--output-compression",
}


def _call(
    factory: Any, fmt: plugins.FormatSpec, what: str, *args: Any, options: dict[str, Any]
) -> Any:
    """``factory(*args, **options)``, refusing options the format's factory does not take
    (by the CLI option's name) instead of failing somewhere inside it."""
    parameters = inspect.signature(factory).parameters
    named = {
        n for n, p in parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    unknown = [name for name in options if name not in named]
    if unknown:
        spelled = ", ".join(_OPTION_NAMES.get(n, n) for n in unknown)
        raise ValueError(f"The {fmt.name} format's {what} takes no {spelled}.")
    return factory(*args, **options)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grain-core",
        description="Deterministic, resumable, pluggable data loading for JAX.",
    )
    parser.add_argument(
        "--version", action="store_true", help="print the version and the loaded plugins"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    listing = commands.add_parser("plugins", help="list installed plugins and load errors")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.add_argument(
        "-v", "--verbose", action="store_true", help="print the traceback of each failed plugin"
    )
    listing.set_defaults(run=_cmd_plugins)

    inspecting = commands.add_parser("inspect", help="describe a data file through its format")
    inspecting.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="files or shard patterns, read together: a file, x@4 (x-00000-of-00004 ... "
        "x-00003-of-00004), x-*-of-00004, x-*, a glob (quoted, or expanded by the shell into "
        "several paths)",
    )
    inspecting.add_argument("--format", help="format name; by default chosen from the path")
    inspecting.add_argument("--sample", type=int, default=3, help="records to show (default 3)")
    inspecting.add_argument(
        "--schema-sample",
        type=int,
        default=100,
        metavar="N",
        help="records the schema is read from, where the format infers it (default 100)",
    )
    inspecting.add_argument("--json", action="store_true", help="print JSON")
    _add_read_options(inspecting)
    inspecting.set_defaults(run=_cmd_inspect)

    convert = commands.add_parser(
        "convert", help="copy the records of a file into another format, with a progress bar"
    )
    convert.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files or shard patterns to read, in order (the forms inspect takes)",
    )
    convert.add_argument(
        "output",
        help="file to write, or N shards: x@N, x-?????-of-0000N (each file appears complete)",
    )
    convert.add_argument("--from", dest="from_format", help="input format (default: from path)")
    convert.add_argument("--to", dest="to_format", help="output format (default: from path)")
    convert.add_argument(
        "--shards",
        type=int,
        metavar="N",
        help="write N files OUTPUT-0000i-of-0000N, record k into file k %% N",
    )
    convert.add_argument(
        "--overwrite", action="store_true", help="replace output files that already exist"
    )
    _add_read_options(convert)
    convert.add_argument(
        "--output-compression",
        type=str.upper,
        choices=_COMPRESSIONS,
        help="compression of the output (TFRecord; default: from its suffix, .gz is GZIP)",
    )
    convert.set_defaults(run=_cmd_convert)

    demo = commands.add_parser(
        "demo",
        help="train a small JAX model from a data file, preempt it and resume it bit-exactly",
    )
    from grain_core import demo as demo_module  # import cost

    demo_module.add_arguments(demo)
    demo.set_defaults(run=demo_module.run)

    profile = commands.add_parser(
        "profile",
        help="run a pipeline for N batches and write an HTML report of where its time goes",
    )
    from grain_core.observe import profile as profile_module  # import cost

    profile_module.add_arguments(profile)
    profile.set_defaults(run=profile_module.run)

    bench = commands.add_parser(
        "bench",
        help="run benchmarks/run.py of the source checkout in the current directory (arguments go to the runner)",
        add_help=False,
    )
    bench.set_defaults(run=_cmd_bench)
    return parser


def _version_text() -> str:
    loaded = [r for r in plugins.registry().reports if r.status == "loaded"]
    names = ", ".join(
        f"{r.name} ({r.distribution} {r.version})" if r.name != plugins.BUILTIN_PLUGIN else r.name
        for r in loaded
    )
    return f"grain-core {__version__}\nplugins: {names}"


def _cmd_plugins(args: argparse.Namespace) -> int:
    registry = plugins.registry()
    if args.json:
        print(json.dumps(_plugins_json(registry), indent=2))
        return 0
    rows = [("NAME", "DISTRIBUTION", "VERSION", "STATUS", "PROVIDES")]
    for report in registry.reports:
        detail = report.error if report.status == "failed" else _provides_text(report)
        rows.append(
            (
                report.name,
                report.distribution or "?",
                report.version or "?",
                report.status,
                detail or "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[4]
        )
    for problem in registry.problems:
        print(f"problem: {problem}")
    failed = [r for r in registry.reports if r.status == "failed"]
    if failed and not args.verbose:
        print("(grain-core plugins --verbose shows the tracebacks)")
    if args.verbose:
        for report in failed:
            print(f"\n{report.label}:\n{report.traceback or report.error}")
    return 0


def _provides_text(report: plugins.PluginReport) -> str:
    labels = {
        "formats": "formats",
        "shuffle_strategies": "shuffle",
        "sharding_policies": "sharding",
        "worker_backends": "workers",
        "exports": "exports",
    }
    return "; ".join(
        f"{labels[kind]}: {', '.join(names)}" for kind, names in report.provides.items()
    )


def _plugins_json(registry: plugins.Registry) -> dict[str, Any]:
    return {
        "grain_core": __version__,
        "plugins": [report.to_json() for report in registry.reports],
        "formats": [
            {
                "name": fmt.name,
                "suffixes": list(fmt.suffixes),
                "url_patterns": list(fmt.url_patterns),
                "provides": list(fmt.provides),
                "description": fmt.description,
            }
            for fmt in registry.objects("formats")
        ],
        "problems": registry.problems,
    }


def _cmd_inspect(args: argparse.Namespace) -> int:
    if args.sample < 0:
        raise ValueError(f"--sample must be non-negative, got {args.sample}.")
    if args.schema_sample < 1:
        raise ValueError(f"--schema-sample must be at least 1, got {args.schema_sample}.")
    shown = " ".join(args.paths)
    fmt = _format_of(args.paths, args.format)
    options = _read_options(args)
    inspector = fmt.get("inspector")
    if "schema_sample" in inspect.signature(inspector).parameters:
        options["schema_sample"] = args.schema_sample
    paths = args.paths[0] if len(args.paths) == 1 else list(args.paths)
    info = _call(inspector, fmt, "inspector", paths, args.sample, options=options)
    if args.json:
        summary = {
            "path": shown,
            "format": fmt.name,
            "num_records": info.num_records,
            "schema": info.schema,
            "sample": list(info.sample),
            "details": dict(info.details),
        }
        print(json.dumps(summary, indent=2, default=_json_default))
        return 0
    print(f"path:    {shown}")
    print(f"format:  {fmt.name}")
    print(f"records: {'unknown' if info.num_records is None else info.num_records}")
    print(f"schema:  {json.dumps(info.schema, default=_json_default)}")
    for key, value in info.details.items():
        print(f"{key}: {value}")
    for i, record in enumerate(info.sample):
        text = repr(record)
        if len(text) > _SAMPLE_CHARS:
            text = text[: _SAMPLE_CHARS - 3] + "..."
        print(f"sample[{i}]: {text}")
    return 0


def _format_of(paths: Sequence[str], name: str | None) -> plugins.FormatSpec:
    """The format named ``name``, else the one claiming every path.

    Raises:
      ValueError: If the paths are claimed by different formats.
    """
    if name:
        return plugins.get_format(name)
    formats = [plugins.format_for_path(path) for path in paths]
    if len({fmt.name for fmt in formats}) > 1:
        named = ", ".join(f"{p} ({f.name})" for p, f in zip(paths, formats, strict=True))
        raise ValueError(f"The paths are of different formats: {named}. Inspect them one by one.")
    return formats[0]


def _cmd_convert(args: argparse.Namespace) -> int:
    source_format = _format_of(args.inputs, args.from_format)
    shown = " ".join(args.inputs)
    inputs = args.inputs[0] if len(args.inputs) == 1 else list(args.inputs)
    target_format = (
        plugins.get_format(args.to_format)
        if args.to_format
        else plugins.format_for_path(args.output)
    )
    make_writer = target_format.get("writer")
    records, total = _records_of(source_format, inputs, _read_options(args))
    outputs = _output_paths(args.output, args.shards)
    existing = [path for path in outputs if storage.exists(path)]
    if existing and not args.overwrite:
        raise FileExistsError(
            f"{existing[0]} already exists"
            + (f" (and {len(existing) - 1} more of the outputs)" if len(existing) > 1 else "")
            + "; grain-core convert replaces files only with --overwrite."
        )
    write_options = {}
    if args.output_compression is not None:
        write_options["compression"] = args.output_compression
    rows = _RowsOf(source_format, shown)
    started = time.perf_counter()
    count = 0
    # Each output (a path or URL) appears complete or not at all, whatever the format's
    # writer does: it writes a local temporary file whose name ends with the output's (so its
    # suffix chooses the compression), moved or uploaded into place at the end; on an error
    # every output stays as it was.
    with contextlib.ExitStack() as stack:
        writers, temps = [], []
        for path in outputs:
            output = stack.enter_context(storage.AtomicWriter(path))
            output.file.close()
            temps.append(output.temp_path)
            stack.enter_context(_named_as(path, output.temp_path))
            with _named_as(path, output.temp_path):
                writer = _call(
                    make_writer, target_format, "writer", output.temp_path, options=write_options
                )
            writers.append(stack.enter_context(writer))
        for record in progress(records, total, "rec"):
            shard = count % len(outputs)
            try:
                with _named_as(outputs[shard], temps[shard]):
                    rows.write(writers[shard], record, count)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    _as_user_path(
                        f"Record {count} of {shown} ({source_format.name}, a "
                        f"{type(record).__name__}) cannot be written as {target_format.name} to "
                        f"{outputs[shard]}: {err}",
                        outputs[shard],
                        temps[shard],
                    )
                ) from None
            count += 1
    seconds = time.perf_counter() - started
    written = args.output if len(outputs) == 1 else f"{len(outputs)} files {outputs[0]} ..."
    print(
        f"{count} records: {shown} ({source_format.name}) -> {written} "
        f"({target_format.name}) in {seconds:.2f} s"
    )
    if isinstance(rows.first, dict):  # rows: a format of records (bytes) has no columns
        changed = _schema_changes(rows.first, _first_row(target_format, outputs[0]))
        if changed:
            print(
                f"note: {target_format.name} stores these columns with other types than "
                f"{source_format.name} did: {changed}"
            )
    return 0


def _first_row(fmt: plugins.FormatSpec, path: str) -> Any:
    """The first record of ``path`` as its format reads it back (decoded into a row where the
    format has a decoder); None if it has none."""
    records, _ = _records_of(fmt, path, {})
    record = next(iter(records), None)
    if isinstance(record, bytes) and fmt.record_decoder is not None:
        return fmt.record_decoder(record)
    return record


def _column_type(value: Any) -> str:
    """A column value's type as ``convert`` compares them: dtype (``string`` / ``bytes`` for
    text) and shape, e.g. ``int32``, ``int64[1]``."""
    array = np.asarray(value)
    if array.dtype.kind in "USO":
        first = array.flat[0] if array.size else value
        kind = "string" if isinstance(first, str) else "bytes"
    else:
        kind = str(array.dtype)
    return kind + (str(list(array.shape)) if array.shape else "")


def _schema_changes(written: Any, read_back: Any) -> str:
    """The columns whose type differs between the first row written and the first read back
    (``x: int32 -> int64[1]``); empty when they agree or the records are not rows."""
    if not isinstance(written, dict) or not isinstance(read_back, dict):
        return ""
    changes = []
    for name, value in written.items():
        if name in read_back:
            before, after = _column_type(value), _column_type(read_back[name])
            if before != after:
                changes.append(f"{name}: {before} -> {after}")
    return "; ".join(changes)


@contextlib.contextmanager
def _named_as(output: str, temp_path: str) -> Iterator[None]:
    """Reports an ``OSError`` about the temporary file ``output`` is written through (or a
    writer's own temporary file beside it) as one about ``output``, the name the user gave."""
    try:
        yield
    except OSError as err:
        if err.errno is None or not str(err.filename or "").startswith(temp_path):
            raise
        raise OSError(err.errno, err.strerror, output) from None


def _as_user_path(message: str, output: str, temp_path: str) -> str:
    return re.sub(re.escape(temp_path) + r"[^\s'\"]*", output, message)


def _output_paths(output: str, shards: int | None) -> list[str]:
    """The files ``convert`` writes: ``output`` itself, or ``N`` shards named
    ``base-0000i-of-0000N`` for ``--shards N``, ``base@N`` or ``base-?????-of-0000N``."""
    match = _SHARDED_NAME.match(output)
    named = None if match is None else int(match["at"] or match["of"])
    if shards is not None and shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}.")
    if named is not None and shards is not None and named != shards:
        raise ValueError(f"The output {output} names {named} shards but --shards is {shards}.")
    count = shards if named is None else named
    if count is None:
        return [output]
    if count < 1:
        raise ValueError(f"The output {output} names {count} shards; give at least 1.")
    base = output if match is None else match["base"]
    return shard_names.shard_names(base, count)


class _RowsOf:
    """Writes one format's records into another's writer. A record the writer refuses
    (``TypeError``) is decoded with the input format's ``record_decoder`` if it has one
    (``tf.train.Example`` bytes to a row of features), and from then on every record is; rows
    made that way must keep the first row's features and their types, as a column store
    needs."""

    def __init__(self, fmt: plugins.FormatSpec, path: str) -> None:
        self._fmt = fmt
        self._path = path
        self._columns: dict[str, str] | None = None
        #: The first record as it was written (a decoded row where it was decoded).
        self.first: Any = None

    def write(self, writer: plugins.RecordWriter, record: Any, index: int) -> None:
        if self._columns is None:
            try:
                writer.write(record)
                if index == 0:
                    self.first = record
                return
            except TypeError:
                if index > 0 or self._fmt.record_decoder is None:
                    raise
                self._columns = {}
        row = self._decode(record, index)
        writer.write(row)
        if index == 0:
            self.first = row

    def _decode(self, record: Any, index: int) -> Any:
        decoder, columns = self._fmt.record_decoder, self._columns
        if decoder is None or columns is None:
            raise TypeError(f"{self._fmt.name} records are not decoded")
        row = decoder(record)
        kinds = {name: _kind(value) for name, value in row.items()}
        if not columns:
            self._columns = kinds
        elif kinds != columns:
            raise ValueError(_column_mismatch(columns, kinds))
        return row


def _kind(value: Any) -> str:
    return str(np.asarray(value).dtype)


def _column_mismatch(first: dict[str, str], here: dict[str, str]) -> str:
    missing = sorted(first.keys() - here.keys())
    extra = sorted(here.keys() - first.keys())
    if missing:
        return f"it lacks the feature(s) {missing} of record 0; every record must have the same features"
    if extra:
        return f"it has feature(s) {extra} that record 0 lacks; every record must have the same features"
    name = next(n for n in first if first[n] != here[n])
    return f"its feature {name!r} holds {here[name]} values, record 0's holds {first[name]}; a column has one type"


def _records_of(
    fmt: plugins.FormatSpec, path: str | list[str], options: dict[str, Any]
) -> tuple[Iterable[Any], int | None]:
    """The records of ``path`` (one or several) in file order, streamed when the format can, and their number
    when it is known up front."""
    if fmt.iter_dataset is not None:
        return _call(fmt.iter_dataset, fmt, "reader", path, options=options), None
    from grain_core.dataset.base import MapDataset  # import cost

    source = _call(fmt.get("source"), fmt, "source", path, options=options)
    return MapDataset.source(source).to_iter_dataset(), len(source)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value[:_SAMPLE_CHARS].decode("utf-8", errors="replace")
    return repr(value)


def _cmd_bench(args: argparse.Namespace) -> int:
    runner = _find_bench_runner()
    return subprocess.call([sys.executable, str(runner), *args.runner_args])


def _find_bench_runner() -> Path:
    runner = Path.cwd() / "benchmarks" / "run.py"
    if not runner.is_file():
        raise FileNotFoundError(
            "grain-core bench runs benchmarks/run.py of a grain_core source checkout, and "
            f"there is none in {Path.cwd()}. Run it from the checkout's root, or use "
            "`nox -s bench` there."
        )
    return runner
