"""The host tier (L2) in the bench: prefixkv with host tiers of 0, 1, 4 and 16 times the
device pool, on the workloads where eviction happens, with what the plans move.

Per tier size: the hit rate by source (device blocks, host slots), the prefill computed,
blocks offloaded and loaded per request, the bytes those copies move for a stated model
shape, and an estimated prefill time per request on a stated GPU: the prefill
FLOPs of the computed tokens at a stated throughput plus every offload and load at a
stated PCIe bandwidth (counted serially, as ``kernels.run_kv_ops`` queues them before
the forward pass). Nothing here runs a model or a GPU: the time is an estimate.

Device pools: the pressure workload runs in its own pool (a sixth of its working set);
chat and document run in an eighth of theirs (never below one request), because their
own pools hold the whole working set and a host tier would have nothing to keep.

The hit rate is the first admissions' (``ReplayResult.hit_rate``): a preempted
request's re-admission (its prompt and the tokens decoded so far, nearly all still
cached) is shown beside it, its tokens and their hit rate, because counting it in would
let a tier that keeps more requests running hit less than one that preempts them. Where
the hits came from (device blocks, host slots) is counted over every admission: a load
serves a re-admission as well as a first one. Two bounds close the sweep: a host tier
that never evicts (as many slots as the workload has blocks; the same device pool, so
the same preemptions) and a device pool that holds the whole workload (no eviction, no
preemption, no tier). A first admission can hit only blocks some earlier request
computed; its first-time prefixes and fresh suffixes are misses under any cache, so no
row's hit rate passes the second bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.block import blocks_for
from ..core.manager import KVCacheManager
from .capacity import blocks_needed, default_pool_blocks
from .cost import PrefillCost
from .replay import replay
from .workloads import Workload

HOST_FACTORS = (0, 1, 4, 16)
"""Host tier sizes, in multiples of the device pool."""
HOST_WORKLOADS = ("pressure", "chat", "document")
"""The workloads the host-tier sweep runs (when they are part of the bench)."""
DEVICE_POOL_SHARE = {"pressure": 1, "chat": 8, "document": 8}
"""The device pool of the sweep: the workload's own pool divided by this."""


@dataclass(frozen=True, slots=True)
class TransferCost:
    """Bytes of one KV block of ``model`` (K and V, every layer, ``dtype_bytes`` per
    value) and the time to move them over PCIe at ``pcie_gbs`` GB/s (default 25: what a
    PCIe 4.0 x16 link sustains in one direction with pinned memory, of 32 nominal)."""

    model: PrefillCost = PrefillCost()
    dtype_bytes: int = 2
    pcie_gbs: float = 25.0

    def block_bytes(self, block_size: int) -> int:
        m = self.model
        return 2 * m.layers * block_size * m.kv_heads * m.head_dim * self.dtype_bytes

    def seconds(self, num_bytes: int) -> float:
        return num_bytes / (self.pcie_gbs * 1e9)

    def describe(self, block_size: int) -> str:
        return (f"{self.model.describe()}; KV blocks of {block_size} tokens in bf16 = "
                f"{self.block_bytes(block_size) / 2**20:g} MiB, moved at an assumed "
                f"{self.pcie_gbs:g} GB/s (PCIe 4.0 x16, pinned host memory)")


def device_pool(wl: Workload, block_size: int) -> int:
    """The sweep's device pool for ``wl`` (see the module docstring)."""
    share = DEVICE_POOL_SHARE.get(wl.name, 1)
    return max(default_pool_blocks(wl, block_size) // share, blocks_needed(wl, block_size))


def tier_point(result: dict[str, Any], host_blocks: int, block_size: int,
               transfer: TransferCost) -> dict[str, Any]:
    """The sweep's figures for one replay (``ReplayResult.to_dict()``) with a host tier
    of ``host_blocks``."""
    host_tokens = result["loaded_blocks"] * block_size
    queried = result["prefill_saved"] + result["prefill_computed"]
    moved = (result["offloaded_blocks"] + result["loaded_blocks"]) * transfer.block_bytes(block_size)
    requests = max(result["requests"], 1)  # not admissions: a re-admission after
    # preemption adds its cost to its request instead of diluting the average
    compute_s = transfer.model.seconds(result["prefill_computed"], result["prefill_computed_pairs"])
    return {
        "host_blocks": host_blocks,
        "hit_rate": result["hit_rate"],
        "readmitted_tokens": result["readmitted_tokens"],
        "readmitted_hit_rate": result["readmitted_hit_rate"],
        "device_hit_rate": (result["prefill_saved"] - host_tokens) / queried if queried else 0.0,
        "host_hit_rate": host_tokens / queried if queried else 0.0,
        "prefill_computed": result["prefill_computed"],
        "offloads_per_request": result["offloaded_blocks"] / requests,
        "loads_per_request": result["loaded_blocks"] / requests,
        "bytes_moved": moved,
        "est_prefill_ms_per_request": 1e3 * (compute_s + transfer.seconds(moved)) / requests,
        "est_transfer_ms_per_request": 1e3 * transfer.seconds(moved) / requests,
        "replay": result,
    }


def sweep_point(wl: Workload, pool: int, host_blocks: int, block_size: int,
                transfer: TransferCost) -> dict[str, Any]:
    """One replay of ``wl`` in a device pool of ``pool`` blocks with ``host_blocks`` slots."""
    alloc = KVCacheManager(pool, block_size, seed=0, host_blocks=host_blocks)
    return tier_point(replay(alloc, wl, "prefixkv").to_dict(), host_blocks, block_size, transfer)


def host_tier_sweep(wl: Workload, block_size: int, transfer: TransferCost = TransferCost(),
                    tick: Callable[[str], None] = lambda label: None) -> dict[str, Any]:
    """Replay ``wl`` with prefixkv in its sweep device pool, for each of HOST_FACTORS, then
    the two bounds (``bounds``: "host never evicts", "device holds all"; see the module
    docstring)."""
    pool = device_pool(wl, block_size)
    points = []
    for factor in HOST_FACTORS:
        tick(f"{wl.name} host tier {factor}x")
        points.append({"factor": factor,
                       **sweep_point(wl, pool, factor * pool, block_size, transfer)})
    every = sum(blocks_for(len(r.prompt) + len(r.output), block_size) for r in wl.requests)
    tick(f"{wl.name} bounds")
    bounds = {"host never evicts": {"pool_blocks": pool,
                                    **sweep_point(wl, pool, every, block_size, transfer)},
              "device holds all": {"pool_blocks": max(every, pool),
                                   **sweep_point(wl, max(every, pool), 0, block_size, transfer)}}
    return {"name": wl.name, "pool_blocks": pool, "block_size": block_size, "points": points,
            "bounds": bounds}


HOST_COLUMNS = ("workload", "host tier", "hit rate", "re-admitted tok (hit)", "from device",
                "from host", "prefill computed", "offloads/req", "loads/req", "GiB moved",
                "est. prefill ms/req")


def readmitted_cell(tokens: int, hit_rate: float) -> str:
    """Re-admitted prompt tokens and their hit rate, or "-" when nothing was preempted."""
    return f"{tokens:,} ({hit_rate:.0%})" if tokens else "-"


def _cells(name: str, label: str, p: dict[str, Any]) -> tuple[str, ...]:
    return (name, label, f"{p['hit_rate']:.1%}",
            readmitted_cell(p["readmitted_tokens"], p["readmitted_hit_rate"]),
            f"{p['device_hit_rate']:.1%}", f"{p['host_hit_rate']:.1%}",
            f"{p['prefill_computed']:,}", f"{p['offloads_per_request']:.1f}",
            f"{p['loads_per_request']:.1f}", f"{p['bytes_moved'] / 2**30:,.1f}",
            f"{p['est_prefill_ms_per_request']:.1f}")


def host_rows(sweeps: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row of formatted cells per (workload, tier size), then the workload's bounds,
    in HOST_COLUMNS order."""
    rows = []
    for s in sweeps:
        rows += [_cells(s["name"], f"{p['factor']}x ({p['host_blocks']:,})", p) for p in s["points"]]
        for label, b in s.get("bounds", {}).items():
            rows.append(_cells(s["name"], f"bound: {label}", b))
    return rows


def host_note(data: dict[str, Any]) -> str:
    """What the host-tier table assumes."""
    pools = ", ".join(f"{s['name']} {s['pool_blocks']:,} blocks" for s in data["host_tiers"])
    return (f"host tier: prefixkv with host slots of 0/1/4/16x the device pool ({pools}); "
            f"est. prefill ms/req is an ESTIMATE for {data['host_transfer']}: the prefill "
            f"FLOPs of the computed tokens plus every offload and load, per request of the "
            f"workload (a re-admission after preemption counts toward its request; no "
            f"queueing, no decode); hit rate: first admissions; re-admitted tok (hit): "
            f"prompt tokens of preempted requests admitted again, and their hit rate; from "
            f"device/from host: hits by source over every admission; bound rows: a host "
            f"tier that never evicts (same device pool) and a device pool holding the whole "
            f"workload (no tier, no preemption)")
