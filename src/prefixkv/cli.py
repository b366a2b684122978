"""The ``prefixkv`` command line (also ``python -m prefixkv``). Subcommands: ``bench``.

Imports neither torch nor matplotlib at import time; ``bench`` loads them only for its
end-to-end run and its plots.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import __version__

WORKLOADS = ("all", "system-prompt", "chat", "document", "pressure", "trace")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="prefixkv", description="prefixkv: a KV-cache block manager with automatic "
        "prefix caching. Run `prefixkv bench` to see what the cache buys.")
    parser.add_argument("--version", action="version", version=f"prefixkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser(
        "bench", help="prefix caching against naive allocation, in numbers and plots",
        description="Replay workloads through three allocators (contiguous max-length "
        "reservation, paged without caching, prefixkv), sweep the pool size, and, where "
        "torch is installed, run a small model end to end with and without the cache. "
        "Prints a table and writes report.md, report.json and PNG plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench.add_argument("--workload", choices=WORKLOADS, default=None,
                       help="which workload to replay: the four built-in ones ('all'), one of "
                       "them, or your JSONL trace ('trace', needs --trace); default: all, or "
                       "trace when --trace is given")
    bench.add_argument("--trace", type=Path, metavar="FILE",
                       help="JSONL trace to replay, one request per line (token ids, or lengths "
                       "with shared segments; format in prefixkv.bench.trace)")
    bench.add_argument("--scale", type=_positive_float, default=1.0,
                       help="multiplier on the number of requests, sessions and questions of "
                       "the built-in workloads (prompt lengths stay)")
    bench.add_argument("--pool-blocks", type=_positive_int, metavar="N",
                       help="KV pool size in blocks for every workload (default: each "
                       "workload's own); the capacity sweep spans 1/16x to 2x of it")
    bench.add_argument("--block-size", type=_positive_int, default=16, metavar="N",
                       help="token slots per KV block")
    bench.add_argument("--seed", type=int, default=0,
                       help="seed of the synthetic token ids (same seed, same requests)")
    bench.add_argument("--no-e2e", dest="e2e", action="store_false",
                       help="skip the end-to-end model run (it is skipped anyway without torch)")
    bench.add_argument("--no-plots", dest="plots", action="store_false",
                       help="write no PNG plots, only report.md and report.json")
    bench.add_argument("--out", type=Path, default=Path("prefixkv-bench"), metavar="DIR",
                       help="folder for report.md, report.json and the plots (created)")
    bench.add_argument("--progress", action="store_true", default=None,
                       help="draw the progress bar on stderr even when it is not a terminal")
    bench.add_argument("--replicas", type=_int_list, metavar="N[,N...]",
                       help="simulate a fleet of N replicas behind the router instead (e.g. "
                       "1,2,4,8,16; system-prompt and chat unless --workload names one); "
                       "writes fleet.md, fleet.json, fleet.png")
    bench.add_argument("--route", choices=("all", "round-robin", "least-loaded", "prefix"),
                       default="all", help="routing policy of the fleet simulation")
    return parser


def _int_list(text: str) -> list[int]:
    return [_positive_int(part) for part in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage or input error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _bench(parser, args)
    parser.print_help()
    return 2


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .bench.replay import BenchError
    from .bench.report import terminal, write_all
    from .bench.suite import BenchConfig, run_bench
    from .bench.trace import TraceError
    from .bench.workloads import BUILTIN

    if args.replicas:
        from .bench.fleet_report import DEFAULT_WORKLOADS, run_fleet, table, write_fleet
        routes = ("round-robin", "least-loaded", "prefix") if args.route == "all" else (args.route,)
        names = DEFAULT_WORKLOADS if args.workload in (None, "all") else (args.workload,)
        if "trace" in names:
            parser.error("--replicas runs the built-in workloads, not a trace")
        data = run_fleet(args.replicas, routes, names, scale=args.scale, seed=args.seed,
                         block_size=args.block_size, pool_blocks=args.pool_blocks)
        for note in write_fleet(data, args.out, args.plots):
            print(f"note: {note}", file=sys.stderr)
        print(table(data) + f"\n\nreport: {args.out / 'fleet.md'}")
        return 0
    workload = args.workload or ("trace" if args.trace else "all")
    if workload == "trace" and args.trace is None:
        parser.error("--workload trace needs --trace FILE")
    if args.trace is not None and workload != "trace":
        parser.error(f"--trace replays a trace: drop --workload {workload} or use --workload trace")
    cfg = BenchConfig(workloads=BUILTIN if workload == "all" else (workload,), trace=args.trace,
                      scale=args.scale, pool_blocks=args.pool_blocks, block_size=args.block_size,
                      seed=args.seed, e2e=args.e2e, plots=args.plots, out=args.out,
                      progress=args.progress)
    try:
        data = run_bench(cfg)
    except (TraceError, BenchError) as exc:
        print(f"prefixkv bench: error: {exc}", file=sys.stderr)
        return 2
    notes = write_all(data, cfg.out, cfg.plots)
    print(terminal(data))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"\nreport: {cfg.out / 'report.md'} (+ report.json"
          f"{', plots' if cfg.plots and not notes else ''})")
    return 0
