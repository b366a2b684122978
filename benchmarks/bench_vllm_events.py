"""Admission with KV events on, prefixkv against vLLM 0.33's own ``KVCacheManager``, side
by side in one process (SPEC section 4: at least 8x with events on).

    python benchmarks/bench_vllm_events.py [--rounds 6] [--out benchmarks/results]

Needs vllm 0.33.0 importable by the Python that runs it (vLLM's scheduler side is pure
Python and runs on a CPU), and this tree's ``src`` (put first on the path). The committed
results were made with a venv holding the 0.33.0 wheel with its dependencies and CPU
torch; whether ``make install-vllm`` (the wheel without its dependencies, plus the pinned
pure-Python ones) is enough for these imports, or needs tests/engines/vllm_cpu.py's
stand-ins, was not checked. Four managers of 10,000 blocks of 16 tokens,
each filled to capacity with cached blocks first (every miss evicts): vLLM with
``enable_kv_cache_events`` off and on, prefixkv with ``enable_events`` off and on. A
vLLM admission is what its scheduler does for a new request: ``Request(...)`` with the
block hasher (xxhash, as ``--prefix-caching-hash-algo xxhash``; the hashes are computed
there), ``get_computed_blocks`` and ``allocate_slots``; prefixkv's is ``add_request``.
After each admission the request is freed and the events taken (untimed, and timed apart
as "+ take"). Each round runs the same prompts through the four managers, in an order
that alternates; times are this thread's CPU ns (other processes' time slices do not
count); ratios are the median of each round's own ratio (paired).
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this tree's prefixkv

import torch  # noqa: E402  (vLLM's KV spec names a dtype)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import xxhash  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

from prefixkv import KVCacheManager  # noqa: E402

BS = 16
POOL = 10_000
CLOCK = time.thread_time_ns
init_none_hash(xxhash)
HASHER = get_request_block_hasher(BS, xxhash)
SAMPLING = SamplingParams(max_tokens=16)


def vllm_manager(events: bool) -> VllmManager:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=POOL, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])
    return VllmManager(cfg, max_model_len=40_000, scheduler_block_size=BS, hash_block_size=BS,
                       enable_caching=True, enable_kv_cache_events=events)


def admit(kind: str, m, rid: str, tokens: list[int]) -> tuple[int, int, object]:
    """(ns in all, ns without vLLM's Request construction, what ``free`` takes)."""
    if kind == "prefixkv":
        t0 = CLOCK()
        ok = m.add_request(rid, tokens)
        t = CLOCK() - t0
        assert ok is not None
        return t, t, rid
    t0 = CLOCK()
    req = Request(rid, tokens, SAMPLING, None, block_hasher=HASHER)
    t1 = CLOCK()
    blocks, hit, *_ = m.get_computed_blocks(req)
    ok = m.allocate_slots(req, len(tokens) - hit, num_new_computed_tokens=hit,
                          new_computed_blocks=blocks)
    t2 = CLOCK()
    assert ok is not None
    return t2 - t0, t2 - t1, req


def fill(kind: str, m, rng: random.Random) -> None:
    """Admit and free distinct 16k-token prompts until the pool has cycled once."""
    for i in range(POOL // 1024 + 2):
        _, _, h = admit(kind, m, f"fill{i}", prompt(rng, 16 * 1024))
        m.free(h)
        m.take_events()


def prompt(rng: random.Random, n: int) -> list[int]:
    return list(array("H", rng.randbytes(2 * n)))


def run(rounds: int) -> list[dict]:
    rng = random.Random(0)
    managers = {("vLLM", e): vllm_manager(e) for e in (False, True)}
    managers.update({("prefixkv", e): KVCacheManager(POOL, BS, seed=0, enable_events=e,
                                                     max_events=1 << 20) for e in (False, True)})
    for (kind, _), m in managers.items():
        fill(kind, m, rng)
    gc.collect()
    gc.freeze()
    rows = []
    for tokens, count in ((2048, 40), (32768, 4)):
        for hit in (False, True):
            got: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
            for r in range(rounds):
                ps = ([prompt(rng, tokens)] * count if hit
                      else [prompt(rng, tokens) for _ in range(count)])
                order = list(managers.items())
                for (kind, events), m in (order if r % 2 == 0 else order[::-1]):
                    alone, inner, total = [], [], []
                    for i, p in enumerate(ps):
                        t, t_inner, h = admit(kind, m, f"{r}.{i}", p)
                        m.free(h)
                        t0 = CLOCK()
                        m.take_events()
                        alone.append(t)
                        inner.append(t_inner)
                        total.append(t + CLOCK() - t0)
                    keep = slice(1, None) if hit else slice(None)  # a hit's first admission misses
                    got.setdefault((kind, events), []).append(
                        tuple(statistics.median(x[keep]) / 1e3 for x in (alone, inner, total)))
            v, p = got[("vLLM", True)], got[("prefixkv", True)]
            rows.append(dict(
                row=f"admit {tokens // 1024}k, {100 if hit else 0}% hit",
                **{f"{k}_{'on' if e else 'off'}_us":
                   round(statistics.median(x[0] for x in got[(k, e)]), 1)
                   for k in ("vLLM", "prefixkv") for e in (False, True)},
                vllm_on_no_request_us=round(statistics.median(x[1] for x in v), 1),
                vllm_on_take_us=round(statistics.median(x[2] for x in v), 1),
                prefixkv_on_take_us=round(statistics.median(x[2] for x in p), 1),
                ratio_on=paired(v, p, 0, 0), ratio_on_no_request=paired(v, p, 1, 0),
                ratio_on_take=paired(v, p, 2, 2)))
    return rows


def paired(v: list, p: list, i: int, j: int) -> float:
    """The median over rounds of vLLM's figure ``i`` over prefixkv's figure ``j``."""
    return round(statistics.median(a[i] / b[j] for a, b in zip(v, p, strict=True)), 1)


def markdown(rows: list[dict], command: str, rounds: int) -> str:
    import vllm

    lines = [f"# Admission with KV events: prefixkv against vLLM {vllm.__version__} "
             f"({platform.machine()}, Python {platform.python_version()})", "",
             f"Command: `{command}` ({rounds} rounds). µs: median over rounds of each round's "
             "median admission, this thread's CPU time. Ratios: vLLM / prefixkv, the median of "
             "each round's own ratio. \"without Request()\": vLLM's time less the construction "
             "of its Request (where it hashes the prompt's blocks).", "",
             "| row | vLLM off | vLLM on | vLLM on, without Request() | vLLM on + take | "
             "prefixkv off | prefixkv on | prefixkv on + take | vLLM/prefixkv, on | "
             "without Request() | on + take |", "|---|" + "---:|" * 10]
    for r in rows:
        lines.append(f"| {r['row']} | {r['vLLM_off_us']} | {r['vLLM_on_us']} | "
                     f"{r['vllm_on_no_request_us']} | {r['vllm_on_take_us']} | "
                     f"{r['prefixkv_off_us']} | {r['prefixkv_on_us']} | {r['prefixkv_on_take_us']} | "
                     f"{r['ratio_on']}x | {r['ratio_on_no_request']}x | {r['ratio_on_take']}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None, help="folder for vllm-events-ab.md")
    args = ap.parse_args()
    md = markdown(run(args.rounds), "python " + " ".join(["benchmarks/bench_vllm_events.py",
                                                         *sys.argv[1:]]), args.rounds)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vllm-events-ab.md").write_text(md)


if __name__ == "__main__":
    main()
