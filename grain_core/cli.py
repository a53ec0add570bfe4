"""The ``grain-core`` command line (also ``python -m grain_core``).

Commands: ``plugins`` (what is installed and what failed), ``inspect PATH`` (a file through
its format plugin), ``convert IN OUT`` (records from one format to another), ``demo`` (the
end-to-end example with its throughput), ``profile`` (an HTML report of a pipeline's time,
see ``grain_core.profiling``), ``bench`` (the repository's benchmark suite).
``--version`` lists the loaded plugins too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from grain_core import plugins, storage

__all__ = ["main"]

_T = TypeVar("_T")

_SAMPLE_CHARS = 200


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
        return int(args.run(args))
    except (plugins.PluginError, OSError, ValueError) as err:
        print(f"grain-core {args.command}: error: {err}", file=sys.stderr)
        return 1


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

    inspect = commands.add_parser("inspect", help="describe a data file through its format")
    inspect.add_argument("path", help="file to inspect (sharded names like x-00000-of-00004 work)")
    inspect.add_argument("--format", help="format name; by default chosen from the path")
    inspect.add_argument("--sample", type=int, default=3, help="records to show (default 3)")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(run=_cmd_inspect)

    convert = commands.add_parser(
        "convert", help="copy the records of a file into another format, with a progress bar"
    )
    convert.add_argument("input", help="file (or sharded pattern) to read")
    convert.add_argument("output", help="file to write; replaced only once it is complete")
    convert.add_argument("--from", dest="from_format", help="input format (default: from path)")
    convert.add_argument("--to", dest="to_format", help="output format (default: from path)")
    convert.set_defaults(run=_cmd_convert)

    demo = commands.add_parser(
        "demo",
        help="train a small JAX model from a data file, preempt it and resume it bit-exactly",
    )
    from grain_core import demo as demo_module

    demo_module.add_arguments(demo)
    demo.set_defaults(run=demo_module.run)

    profile = commands.add_parser(
        "profile",
        help="run a pipeline for N batches and write an HTML report of where its time goes",
    )
    from grain_core import profiling

    profiling.add_arguments(profile)
    profile.set_defaults(run=profiling.run)

    bench = commands.add_parser(
        "bench",
        help="run benchmarks/run.py of the source checkout in the current directory (arguments go to the runner)",
        add_help=False,
    )
    bench.set_defaults(run=_cmd_bench)
    return parser


def _version_text() -> str:
    from grain_core import __version__

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
        "exports": "exports",
    }
    return "; ".join(
        f"{labels[kind]}: {', '.join(names)}" for kind, names in report.provides.items()
    )


def _plugins_json(registry: plugins.Registry) -> dict[str, Any]:
    from grain_core import __version__

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
    fmt = plugins.get_format(args.format) if args.format else plugins.format_for_path(args.path)
    info = fmt.get("inspector")(args.path, args.sample)
    if args.json:
        summary = {
            "path": args.path,
            "format": fmt.name,
            "num_records": info.num_records,
            "schema": info.schema,
            "sample": list(info.sample),
            "details": dict(info.details),
        }
        print(json.dumps(summary, indent=2, default=_json_default))
        return 0
    print(f"path:    {args.path}")
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


def _cmd_convert(args: argparse.Namespace) -> int:
    source_format = (
        plugins.get_format(args.from_format)
        if args.from_format
        else plugins.format_for_path(args.input)
    )
    target_format = (
        plugins.get_format(args.to_format)
        if args.to_format
        else plugins.format_for_path(args.output)
    )
    make_writer = target_format.get("writer")
    records, total = _records_of(source_format, args.input)
    started = time.perf_counter()
    count = 0
    # The output (a path or URL) appears complete or not at all, whatever the format's writer
    # does: it writes a local temporary file whose name ends with the output's (so its suffix
    # chooses the compression), moved or uploaded into place at the end.
    with storage.AtomicWriter(args.output) as output:
        output.file.close()
        with make_writer(output.temp_path) as writer:
            for record in progress(records, total, "rec"):
                try:
                    writer.write(record)
                except TypeError as err:
                    raise ValueError(
                        f"Record {count} of {args.input} ({source_format.name}, a "
                        f"{type(record).__name__}) cannot be written as {target_format.name}: "
                        f"{err}. Convert between formats that store the same kind of record."
                    ) from None
                count += 1
    seconds = time.perf_counter() - started
    print(
        f"{count} records: {args.input} ({source_format.name}) -> {args.output} "
        f"({target_format.name}) in {seconds:.2f} s"
    )
    return 0


def _records_of(fmt: plugins.FormatSpec, path: str) -> tuple[Iterable[Any], int | None]:
    """The records of ``path`` in file order, streamed when the format can, and their number
    when it is known up front."""
    if fmt.iter_dataset is not None:
        return fmt.iter_dataset(path), None
    from grain_core.dataset.base import MapDataset

    source = fmt.get("source")(path)
    return MapDataset.source(source).to_iter_dataset(), len(source)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value[:_SAMPLE_CHARS].decode("utf-8", errors="replace")
    return repr(value)


def progress(iterable: Iterable[_T], total: int | None, unit: str) -> Iterable[_T]:
    """Wraps ``iterable`` in a tqdm progress bar when stderr is a terminal and tqdm exists
    (``total=None``: a count without an end).

    tqdm is optional (``pip install 'grainpipe[progress]'``): without it, or when output is
    redirected, the iterable is returned unchanged so logs stay clean.
    """
    if not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, unit=unit, file=sys.stderr, leave=False)


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
