"""The whole ``prefixkv bench`` run: workloads x allocators, capacity, sweep, host tiers,
replicas sharing a store, layer groups, cascade attention's KV bytes, e2e, report."""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .. import __version__
from . import limits
from .capacity import (
    ALLOCATORS,
    default_pool_blocks,
    make_allocator,
    requests_that_fit,
    sweep,
    sweep_sizes,
)
from .cascade_bytes import CASCADE_WORKLOADS, run_cascade
from .cost import PrefillCost, allocator_share
from .errors import BenchError, shorten
from .hosttier import HOST_FACTORS, HOST_WORKLOADS, TransferCost, host_tier_sweep
from .layer_groups import MIXES, run_groups
from .progress import Progress
from .replay import replay
from .store_replicas import REPLICA_WORKLOADS, run_replicas
from .trace import load_trace
from .workloads import BUILTIN, Workload, builtin, check_scale


@dataclass
class BenchConfig:
    """What to run; the CLI flags, one field each (see ``prefixkv bench --help``)."""

    workloads: tuple[str, ...] = BUILTIN
    trace: Path | None = None
    scale: float = 1.0
    pool_blocks: int | None = None
    block_size: int = 16
    seed: int = 0
    e2e: bool = True
    host_tiers: bool = True
    store_replicas: bool = True
    cascade: bool = True
    groups: tuple[str, ...] = tuple(MIXES)
    plots: bool = True
    out: Path = field(default_factory=lambda: Path("prefixkv-bench"))
    progress: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["trace"] = str(self.trace) if self.trace else None
        d["out"] = str(self.out)
        d["workloads"] = list(self.workloads)
        d["groups"] = list(self.groups)
        return d


def machine() -> dict[str, Any]:
    """A description of this machine, for the report."""
    cores: int | None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count()
    return {"platform": platform.platform(), "processor": platform.machine(),
            "cpu_cores": cores, "python": sys.version.split()[0], "prefixkv": __version__}


def check_config(cfg: BenchConfig) -> None:
    """Refuse, before any work, what would not fit the caps of ``limits``: a scale that is
    not a finite number > 0 or makes a built-in workload too big, a ``pool_blocks`` over
    ``MAX_POOL_FLAG``; a layer mix not in ``layer_groups.MIXES``; and what the command
    line's parser refuses, for a config built in code: a workload name not in ``BUILTIN``
    (or ``"trace"``), a block size or seed that is not an int, a switch that is not a
    bool. Raises BenchError."""
    _check_fields(cfg)
    check_scale(cfg.scale, cfg.workloads)
    if cfg.cascade:
        check_scale(cfg.scale, CASCADE_WORKLOADS)
    unknown = [name for name in cfg.groups if name not in MIXES]
    if unknown:
        raise BenchError(f"--groups: unknown layer mix {unknown[0]!r}; choose from "
                         f"{', '.join(MIXES)} or none")
    if cfg.pool_blocks is not None and not 1 <= cfg.pool_blocks <= limits.MAX_POOL_FLAG:
        raise BenchError(f"--pool-blocks must be 1..{limits.MAX_POOL_FLAG:,}, got {cfg.pool_blocks:,}")


def _check_fields(cfg: BenchConfig) -> None:
    names = cfg.workloads
    if (not isinstance(names, (tuple, list)) or not names
            or any(name not in (*BUILTIN, "trace") for name in names)):
        raise BenchError(f"BenchConfig.workloads must be a non-empty tuple of "
                         f"{', '.join((*BUILTIN, 'trace'))}, got {shorten(names)}")
    for name in ("block_size", "seed"):
        value = getattr(cfg, name)
        bounded = name == "block_size"
        if type(value) is not int or (bounded and not 1 <= value <= limits.MAX_BLOCK_SIZE):
            raise BenchError(f"BenchConfig.{name} must be an int"
                             f"{f' in 1..{limits.MAX_BLOCK_SIZE:,}' * bounded}, got {shorten(value)}")
    if cfg.pool_blocks is not None and type(cfg.pool_blocks) is not int:
        raise BenchError(f"BenchConfig.pool_blocks must be None or an int, got {shorten(cfg.pool_blocks)}")
    for name in ("e2e", "host_tiers", "store_replicas", "plots", "progress"):
        value = getattr(cfg, name)
        if type(value) is not bool and not (name == "progress" and value is None):
            raise BenchError(f"BenchConfig.{name} must be True or False, got {shorten(value)}")
    if not isinstance(cfg.groups, (tuple, list)):
        raise BenchError(f"BenchConfig.groups must be a tuple of layer mixes, got {shorten(cfg.groups)}")


def check_pools(workloads: list[Workload], cfg: BenchConfig) -> None:
    """Refuse a workload whose pools (its own, or the sweep's largest) exceed
    ``MAX_POOL_BLOCKS``, before any of them is created. Raises BenchError."""
    for wl in workloads:
        top = max(sweep_sizes(wl, cfg.block_size, pool_of(wl, cfg)))
        if top > limits.MAX_POOL_BLOCKS:
            raise BenchError(f"{wl.name}: pools up to {top:,} blocks, over the cap of "
                             f"{limits.MAX_POOL_BLOCKS:,} (limits.MAX_POOL_BLOCKS): use a larger "
                             f"--block-size, a smaller --pool-blocks or shorter requests")


def load_workloads(cfg: BenchConfig) -> list[Workload]:
    """The configured workloads, built (or parsed) in order. Raises TraceError."""
    out = []
    for name in cfg.workloads:
        if name == "trace":
            if cfg.trace is None:
                raise BenchError("the trace workload needs a trace file (--trace FILE)")
            out.append(load_trace(cfg.trace, cfg.seed))
        else:
            out.append(builtin(name, cfg.scale, cfg.seed))
    return out


def pool_of(wl: Workload, cfg: BenchConfig) -> int:
    """The pool in blocks for ``wl``: ``--pool-blocks`` or the workload's own."""
    return cfg.pool_blocks or default_pool_blocks(wl, cfg.block_size)


_DEFAULT_COST = PrefillCost()  # frozen: one instance serves every call


def run_workload(wl: Workload, cfg: BenchConfig, progress: Progress,
                 cost: PrefillCost = _DEFAULT_COST) -> dict[str, Any]:
    """Replay one workload with every allocator, count what fits, sweep the pool size;
    each result's ``alloc_share`` sets its allocator time against ``cost``."""
    bs = cfg.block_size
    pool = pool_of(wl, cfg)
    max_len = wl.max_tokens()
    results: dict[str, dict[str, Any]] = {}
    for name in ALLOCATORS:
        progress.tick(f"{wl.name} {name}")
        try:
            res = replay(make_allocator(name, pool, bs, max_len), wl, name).to_dict()
            res["alloc_share"] = allocator_share(res, cost)
        except BenchError as exc:
            res = {"error": str(exc)}
        res["fit"] = requests_that_fit(make_allocator(name, pool, bs, max_len), wl.requests)
        results[name] = res
    points = sweep(wl, bs, sweep_sizes(wl, bs, pool), progress.tick)
    return {"name": wl.name, "description": wl.description, "requests": len(wl.requests),
            "prompt_tokens": wl.total_prompt_tokens(), "pool_blocks": pool, "block_size": bs,
            "max_model_len": max_len, "results": results,
            "sweep": [p.to_dict() for p in points]}


def run_bench(cfg: BenchConfig, stream: TextIO | None = None) -> dict[str, Any]:
    """Run everything ``cfg`` asks for and return the report data (plain JSON types).
    Writes nothing; ``report.write_all`` does. Raises BenchError (TraceError is one),
    before any replay for what ``check_config`` and ``check_pools`` refuse."""
    t0 = time.perf_counter()
    check_config(cfg)
    workloads = load_workloads(cfg)
    check_pools(workloads, cfg)
    replays = sum(len(ALLOCATORS) + 2 * len(sweep_sizes(wl, cfg.block_size, pool_of(wl, cfg)))
                  for wl in workloads)
    tiered = [wl for wl in workloads if cfg.host_tiers and wl.name in HOST_WORKLOADS]
    replays += len(HOST_FACTORS) * len(tiered)
    shared = [wl for wl in workloads if cfg.store_replicas and wl.name in REPLICA_WORKLOADS]
    progress = Progress(replays + 2 * len(shared) + 2 * len(cfg.groups)
                        + len(CASCADE_WORKLOADS) * cfg.cascade
                        + int(cfg.e2e) * (1 + bool(tiered)), cfg.progress, stream)
    cost = PrefillCost()
    data: dict[str, Any] = {"machine": machine(), "config": cfg.to_dict(), "workloads": [],
                            "prefill_cost": cost.describe()}
    try:
        for wl in workloads:
            data["workloads"].append(run_workload(wl, cfg, progress, cost))
        if tiered:
            transfer = TransferCost(cost)
            data["host_transfer"] = transfer.describe(cfg.block_size)
            data["host_tiers"] = [host_tier_sweep(wl, cfg.block_size, transfer, progress.tick)
                                  for wl in tiered]
        if shared:
            data["replicas"] = run_replicas(shared, cfg.block_size, cfg.seed, progress.tick)
        if cfg.groups:
            data["groups"] = run_groups(cfg.groups, cfg.seed, progress.tick, cfg.scale)
        if cfg.cascade:
            data["cascade"] = run_cascade(cfg.scale, cfg.seed, cfg.block_size, progress.tick)
        if cfg.e2e:
            progress.tick("end to end (model + kernels)")
            from .e2e import run_e2e  # torch stays out of this module's imports
            data["e2e"] = run_e2e(cfg.seed)
            if tiered:
                progress.tick("end to end with a host tier")
                from .e2e_host import run_e2e_host
                data["e2e_host"] = run_e2e_host(cfg.seed)
    except BaseException:
        progress.end_line()  # an error message must not share the bar's line
        raise
    progress.close()
    data["wall_s"] = time.perf_counter() - t0
    return data

