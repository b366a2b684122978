"""Time to first token with a shared store, end to end on a simulated engine: requests
that use the store and requests that do not, with no store, a fast store (a redis-server
of this machine) and a slow one (the same behind ``LatencyProxy``, +``SLOW`` seconds a
round trip).

The engine is one ``KVCacheManager`` with a store and a loop of steps: poll the store,
admit waiting requests in arrival order within a token budget (a ``StoreWait`` stays
waiting), then a forward pass that sleeps ``tokens computed / PREFILL_TPS`` (the
stated prefill throughput; the fetcher threads work meanwhile, as beside a GPU). A
request's TTFT: from its arrival to the end of the step that computed its prompt.
Requests arrive every ``GAP`` seconds, alternately *shared* (its prompt computed and
written to the store by another replica before) and *fresh* (in no cache anywhere). The
cost rule is ``FetchCost(PREFILL_TPS)``, warmed by a few fetches before the run: a slow
store is then judged not worth asking for these prompts, so it costs fresh requests
nothing, while a fast one is asked and lowers the TTFT of shared requests. KV payloads
are stand-ins of ``BLOCK_BYTES`` (a small model's KV: the bytes are moved and checked;
nothing is computed).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..core.manager import KVCacheManager
from ..results import StorePut, StoreWait

BS = 16
PROMPT = 512
"""Tokens of each prompt (32 blocks)."""
BLOCK_BYTES = 4096
PREFILL_TPS = 20_000.0
"""The simulated engine's stated prefill throughput, tokens per second."""
BUDGET = 2048
"""Tokens a step may compute."""
GAP = 0.04
"""Seconds between arrivals."""
SLOW = 0.05
"""Seconds a round trip to the slow store adds."""
REQUESTS = 16


def _prompt(i: int, salt: str) -> list[int]:
    seed = sum(map(ord, salt)) * 7919 + i * 104729
    return [(seed + 31 * j) % 30000 + 1 for j in range(PROMPT + 1)]


def _write(shared: Any, backend: Any, prompts: list[list[int]]) -> None:
    """Another replica computed these prompts: their blocks are in the store."""
    from ..store import SharedStore, encode_value
    other = KVCacheManager(len(prompts) * (PROMPT // BS + 2), BS, hash_mode="sha256",
                           host_blocks=1, store=SharedStore(backend, shared.layout))
    for i, p in enumerate(prompts):
        other.add_request(i, p, read_cache=False)
    other.take_kv_ops()
    payload = bytes(BLOCK_BYTES)
    backend.put([(op.key, encode_value(op.head, payload)) for op in other.take_kv_ops()
                 if isinstance(op, StorePut)])


def _engine(shared: Any, requests: list[tuple[str, list[int], str]]
            ) -> tuple[dict[str, list[float]], Any, int]:
    """Run the arrivals on one engine: TTFT seconds per kind, the stats, and how many
    admissions waited on a fetch."""
    m = KVCacheManager(4 * REQUESTS * (PROMPT // BS + 1), BS, hash_mode="sha256",
                       host_blocks=REQUESTS * (PROMPT // BS + 1), store=shared)
    t0 = time.perf_counter()
    arrive = {rid: t0 + k * GAP for k, (rid, _, _) in enumerate(requests)}
    todo = list(requests)
    ttft: dict[str, list[float]] = {"shared": [], "fresh": []}
    waits, waited = 0, set[str]()
    while todo:
        now = time.perf_counter()
        m.poll_store()
        admitted: list[tuple[tuple[str, list[int], str], int]] = []
        budget = BUDGET
        for req in [r for r in todo if arrive[r[0]] <= now]:
            rid, prompt, kind = req
            adm = m.add_request(rid, prompt)
            if isinstance(adm, StoreWait):
                waits += rid not in waited
                waited.add(rid)
                continue
            if adm is None:
                continue
            if adm.num_new_tokens > budget and admitted:  # next step
                m.free(rid)
                continue
            budget -= adm.num_new_tokens
            admitted.append((req, adm.num_new_tokens))
        m.take_kv_ops()
        computed = sum(n for _, n in admitted)
        time.sleep(computed / PREFILL_TPS if computed else 0.001)  # the forward pass
        end = time.perf_counter()
        for req, _ in admitted:
            todo.remove(req)
            ttft[req[2]].append(end - arrive[req[0]])
            m.free(req[0])
    return ttft, m.stats, waits


def run_ttft(backend_of: Any, tick: Any = lambda label: None) -> dict[str, Any]:
    """The scenario for no store, a fast and a slow store. ``backend_of(delay)``: a
    ``RedisStore`` on the shared server, reached through ``delay`` seconds of added
    latency a round trip (0: direct), and a closer for it."""
    from ..store import FetchCost, SharedStore, StoreLayout
    rows = []
    setups = (("no store", None), ("fast store", 0.0), (f"slow store (+{SLOW * 1e3:g} ms)", SLOW))
    for label, delay in setups:
        tick(f"time to first token, {label}")
        tag = uuid.uuid4().hex[:8]
        shared_prompts = [_prompt(i, "shared" + tag) for i in range(REQUESTS // 2)]
        requests = []
        for i in range(REQUESTS // 2):
            requests.append((f"s{i}", shared_prompts[i], "shared"))
            requests.append((f"f{i}", _prompt(i, "fresh" + tag), "fresh"))
        shared, close = None, None
        if delay is not None:
            backend, close = backend_of(delay)
            shared = SharedStore(backend, StoreLayout(f"ttft-{tag}", "stand-in", BLOCK_BYTES),
                                 cost=FetchCost(PREFILL_TPS), max_fetch=PROMPT // BS,
                                 timeout=10.0)  # (a stall's bound: a busy machine is slow)
            _write(shared, backend, shared_prompts)
            _engine(shared, [(f"w{i}", _prompt(i, "warm" + tag), "fresh") for i in range(3)])
        try:
            t, stats, waits = _engine(shared, requests)
        finally:
            if close is not None:
                close()
        rows.append({"setup": label, "shared_ms": 1e3 * sum(t["shared"]) / len(t["shared"]),
                     "fresh_ms": 1e3 * sum(t["fresh"]) / len(t["fresh"]),
                     "waits": waits, "store_hits": stats.store_hits, "queries": stats.queries})
    return {"prompt": PROMPT, "prefill_tps": PREFILL_TPS, "budget": BUDGET, "gap_ms": GAP * 1e3,
            "block_bytes": BLOCK_BYTES, "rows": rows}
