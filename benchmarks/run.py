"""Runs the benchmark workloads and prints elements/s with ratios against baselines.

Usage (normally through ``nox -s bench``, which installs Google ``grain`` alongside)::

    python benchmarks/run.py                       # every workload, table
    python benchmarks/run.py --only seed_pipeline  # a subset, comma-separated
    python benchmarks/run.py --json > bench-results.json
    python benchmarks/run.py --list

Adding a workload: create ``benchmarks/bench_<topic>.py`` (every ``bench_*.py`` here is
imported automatically) and register a setup function that returns one full pass::

    from _harness import workload

    @workload("my_read", elements=100_000, description="what one pass does")
    def my_read():
        ds = ...                      # untimed setup
        return lambda: list(ds)       # timed: one pass over `elements` elements

    @my_read.baseline("numpy loop")
    def _():
        ...
        return run

    @my_read.baseline("grain", requires="grain")   # skipped when grain is not installed
    def _():
        grain = import_google_grain()
        ...

A pass over a long-lived iterator (steady state) comes from ``steady_pass(make_iterator, n)``;
any other pass that leaves threads or processes running gets a ``close`` attribute, which the
harness calls once the implementation is timed so nothing it started runs into the next one.
``workload(..., alternate=True)`` times the implementations' passes in alternation (for passes
that open and close their own iterators, or leave only idle processes between passes).

The ratio column is grain_core's elements/s divided by the baseline's (> 1: grain_core is
faster), measured in the same run. Never time things in unit tests; measure here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import GRAIN_CORE, WORKLOADS, Measurement, Skipped, measure_all  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Runs the selected workloads; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated workload names")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes (median; 5)")
    parser.add_argument("--json", action="store_true", help="print JSON results")
    parser.add_argument("--list", action="store_true", help="list workloads and exit")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    results: list[Measurement | Skipped] = []
    for module in sorted(Path(__file__).resolve().parent.glob("bench_*.py")):
        try:
            importlib.import_module(module.stem)
        except ImportError as err:
            # A workload module for a plugin that is not installed here; say so and go on.
            results.append(Skipped(module.stem, "*", f"cannot import: {err}"))
            print(f"skipping {module.name}: {err}", file=sys.stderr)
    if args.list:
        for bench in WORKLOADS.values():
            print(f"{bench.name}: {bench.description} [{', '.join(bench.implementations)}]")
        return 0
    selected = list(WORKLOADS)
    if args.only:
        selected = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in selected if name not in WORKLOADS]
        if unknown:
            parser.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")

    for name in selected:
        bench = WORKLOADS[name]
        if not args.json:
            labels = ", ".join(bench.implementations)
            print(f"running {name} / {labels} ...", file=sys.stderr, flush=True)
        results.extend(measure_all(bench, args.repeats))

    if args.json:
        print(json.dumps(_as_json(results, args.repeats), indent=2))
    else:
        _print_table(results)
    return 0


def _speedup(result: Measurement, results: list[Measurement | Skipped]) -> float | None:
    ours = next(
        (
            r
            for r in results
            if isinstance(r, Measurement)
            and r.workload == result.workload
            and r.implementation == GRAIN_CORE
        ),
        None,
    )
    return None if ours is None else ours.elements_per_s / result.elements_per_s


def _print_table(results: list[Measurement | Skipped]) -> None:
    rows = [("workload", "implementation", "elements/s", "median s", "grain_core speed-up")]
    for result in results:
        if isinstance(result, Skipped):
            rows.append(
                (result.workload, result.implementation, "-", "-", f"skipped: {result.reason}")
            )
            continue
        speedup = _speedup(result, results)
        rows.append(
            (
                result.workload,
                result.implementation,
                f"{result.elements_per_s:,.0f}",
                f"{result.median_s:.4f}",
                "-" if speedup is None else f"{speedup:.2f}x",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(
                cell.rjust(w) if i in (2, 3) else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )


def _as_json(results: list[Measurement | Skipped], repeats: int) -> dict[str, object]:
    import grain_core

    try:
        from importlib.metadata import version

        grain_version: str | None = version("grain")
    except ImportError:
        grain_version = None
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "grain_core": grain_core.__version__,
        "grain": grain_version,
        "repeats": repeats,
        "results": [
            {
                "workload": r.workload,
                "implementation": r.implementation,
                "elements": r.elements,
                "seconds": list(r.seconds),
                "median_s": r.median_s,
                "elements_per_s": r.elements_per_s,
                "grain_core_speedup": _speedup(r, results),
            }
            for r in results
            if isinstance(r, Measurement)
        ],
        "skipped": [
            {"workload": r.workload, "implementation": r.implementation, "reason": r.reason}
            for r in results
            if isinstance(r, Skipped)
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
