"""``loom bench NAME``: reproducible experiments.

Every benchmark prints human-readable tables, compares against its baselines in the same run and reports
ratios; ``--json`` prints one JSON object as the last line of output, ``--quick`` runs a small version in
under a minute.
"""

from __future__ import annotations

import argparse
import json

from loom.bench import benchmarks


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` and one sub-command per benchmark; dispatch the parsed arguments with ``run``."""
    bench = subparsers.add_parser("bench", help="run a benchmark", description=__doc__)
    names = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    for b in benchmarks():
        p = names.add_parser(b.name, help=b.help, description=b.help)
        b.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
        p.add_argument("--quick", action="store_true", help="a small version that runs in under a minute")
        p.set_defaults(bench_run=b.run)


def run(args: argparse.Namespace) -> int:
    result = args.bench_run(args)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0
