"""Cascade attention on a GPU: one step's time and KV bytes, plain against cascade.

    python benchmarks/time_cascade.py [--smoke] [--out-dir benchmarks/results]

``bench_cascade.py`` counts the bytes a whole workload reads per step on a CPU; this
script times single steps on a GPU. Each case is a batch whose requests all share one
prefix of cached blocks (a system prompt) and hold their own blocks after it, as
``KVCacheManager.shared_prefixes`` reports them (one group of every request):

* decode: 64 requests, each 1 new token after the shared prefix and its own part;
* chunked prefill: 16 requests, each 256 new tokens after the shared prefix and its own part.

Plain: ``paged_prefill_attention`` (every request's tiles read the whole prefix). Cascade:
``cascade_attention`` with ``build_cascade_batch`` of that group (the prefix read once per
tile of the group's packed rows, the own parts as before, merged by log-sum-exp); its
metadata is built once outside the timing, as an engine builds it on the host per step.
The call runs both passes only where ``cascade_keys`` counts fewer keys for them than
for the plain call, else the plain call; where it picks plain, the two passes are timed
too (``force=True``, "forced"). Both outputs are compared (max abs diff). KV bytes:
``cascade_keys``, keys each call's programs load, from the tiles ``choose_tiles`` picks on
a GPU (one program of ``block_q`` query positions and one KV head loads every key its
rows may attend), x KV heads x head_dim x 2 (K, V) x element size. ``--smoke``: tiny
shapes through the Triton interpreter on a CPU (the script works; the timings mean
nothing). Writes ``cascade-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernel_problems import ROOT, SMOKE, SPEC_PREFILL, Timer, open_session, with_device

GPU_CASES = [dict(name="decode", batch=64, shared=4096, own=512, q_len=1),
             dict(name="decode, long prefix", batch=64, shared=16384, own=256, q_len=1),
             dict(name="chunked prefill", batch=16, shared=4096, own=1024, q_len=256)]
SMOKE_CASES = [dict(name="decode", batch=3, shared=32, own=16, q_len=1),
               dict(name="chunked prefill", batch=2, shared=32, own=16, q_len=8)]


def run_case(torch, kernels, timer, case: dict, shape: dict) -> dict:
    from prefixkv import SharedPrefix

    bs, batch, q_len = shape["block_size"], case["batch"], case["q_len"]
    shared_blocks, own_blocks = case["shared"] // bs, -(-(case["own"] + q_len) // bs)
    kv_len = case["shared"] + case["own"] + q_len
    ids = [list(range(shared_blocks)) + [shared_blocks + r * own_blocks + j for j in range(own_blocks)]
           for r in range(batch)]
    num_blocks = shared_blocks + batch * own_blocks
    gen = torch.Generator(device=shape["device"]).manual_seed(0)
    cache_shape = (num_blocks, bs, shape["kv_heads"], shape["head_dim"])
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen, device=shape["device"]).to(shape["dtype"])
                        for _ in range(2))
    q = torch.randn(batch * q_len, shape["heads"], shape["head_dim"], generator=gen,
                    device=shape["device"]).to(shape["dtype"])
    computed, new = [kv_len - q_len] * batch, [q_len] * batch
    step = kernels.build_paged_batch(ids, computed, new, bs, device=shape["device"])
    args = (q, k_cache, v_cache, step.block_table, step.cu_seqlens_q, step.seqused_k,
            step.max_seqlen_q, step.max_seqlen_k)
    cascade = kernels.build_cascade_batch([SharedPrefix(shared_blocks, tuple(range(batch)))], ids, computed,
                                          new, bs, device=shape["device"])
    # The timed calls write the outputs compared: on a CPU the timer makes one call, and
    # the interpreter's launches are the smoke's whole cost (a separate call for the
    # comparison doubled it).
    # Counted with the GPU's tiles (also in the smoke): what the call's choice rests on there.
    keys = kernels.cascade_keys(cascade, group=shape["heads"] // shape["kv_heads"],
                                head_dim=shape["head_dim"], max_seqlen_q=q_len, on_gpu=True,
                                elem_bytes=q.element_size())
    plain_out, cascade_out = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    plain_ms = timer(lambda: kernels.paged_prefill_attention(*args, out=plain_out, backend="triton"))
    cascade_ms = timer(lambda: kernels.cascade_attention(*args, cascade, out=cascade_out, backend="triton"))
    diff = (plain_out.float() - cascade_out.float()).abs().max().item()
    timed = dict(plain_ms=plain_ms, cascade_ms=cascade_ms, speedup=plain_ms / cascade_ms)
    if shape["device"] == "cuda" and not keys.pays:  # the call ran plain: time the two passes too
        forced_out = torch.full_like(q, float("nan"))
        timed["forced_ms"] = timer(lambda: kernels.cascade_attention(*args, cascade, out=forced_out,
                                                                     backend="triton", force=True))
        diff = max(diff, (plain_out.float() - forced_out.float()).abs().max().item())
    if shape["device"] == "cuda":  # replayed as engines run decode steps: no host time between launches
        for name, fn in (("plain", lambda: kernels.paged_prefill_attention(*args, backend="triton")),
                         ("cascade", lambda: kernels.cascade_attention(*args, cascade, backend="triton"))):
            try:
                timed[f"{name}_graph_ms"] = timer(captured(torch, fn))
            except Exception as exc:  # a capture failure is a result to report, not a lost run
                timed[f"{name}_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"{case['name']}, {name}: CUDA graph capture failed: {exc}", file=sys.stderr)
    key_bytes = shape["kv_heads"] * shape["head_dim"] * 2 * k_cache.element_size()  # K and V, every KV head
    return dict(case, kv_len=kv_len, picks="cascade" if keys.pays else "plain",
                plain_mb=keys.plain * key_bytes / 1e6, cascade_mb=keys.cascade * key_bytes / 1e6,
                max_abs_diff=diff, **timed)


def captured(torch, fn):
    """``fn`` captured once in a CUDA graph (after a warm-up on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def markdown(result: dict) -> str:
    s = result["shape"]
    lines = [f"# Cascade attention on {result['device']}", "",
             f"commit `{result['commit']}`, torch {result['torch']}, triton {result['triton']}; "
             f"`python benchmarks/time_cascade.py{' --smoke' if result['smoke'] else ''}`", "",
             f"{s['heads']} query / {s['kv_heads']} KV heads, head_dim {s['head_dim']}, {s['dtype']}, "
             f"block_size {s['block_size']}; every request of a case shares the prefix (one group). "
             "ms: median of triton's do_bench (CUDA events); MB: K/V bytes the programs load (counted).", ""]
    if result["smoke"]:
        lines += ["Smoke run: tiny shapes through the Triton interpreter; the timings mean nothing.", ""]
    lines += ["Graph: the same call captured in a CUDA graph and replayed (no host time between its "
              "launches, as engines run decode steps); eager: called from Python each time. Picks: "
              "what cascade_attention runs, by cascade_keys (both passes where they load fewer keys, "
              "else the plain call); forced: both passes anyway (`force=True`), timed where it picks "
              "plain. MB: cascade_keys of both passes, with the GPU's tiles.", "",
              "| case | batch | shared | own | q_len | picks | plain ms | cascade ms | plain / cascade | "
              "forced ms | graph: plain ms | graph: cascade ms | graph: plain / cascade | plain MB | "
              "cascade MB | max abs diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        nan = float("nan")
        gp, gc, forced = r.get("plain_graph_ms", nan), r.get("cascade_graph_ms", nan), r.get("forced_ms")
        lines.append(f"| {r['name']} | {r['batch']} | {r['shared']} | {r['own']} | {r['q_len']} | "
                     f"{r['picks']} | {r['plain_ms']:.3f} | {r['cascade_ms']:.3f} | {r['speedup']:.2f}x | "
                     f"{'-' if forced is None else f'{forced:.3f}'} | {gp:.3f} | {gc:.3f} | {gp / gc:.2f}x | "
                     f"{r['plain_mb']:.1f} | {r['cascade_mb']:.1f} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the Triton interpreter (CPU ok)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    opts = p.parse_args(argv)
    session = open_session("time_cascade", opts.smoke)
    if session is None:
        return 2
    torch, kernels, cuda, meta, slug = session
    per_step = ("batch", "prefix", "q_len")  # each case sets its own
    base = SMOKE if opts.smoke else {k: v for k, v in SPEC_PREFILL.items() if k not in per_step}
    shape = with_device(base, "cuda" if cuda else "cpu", torch)
    timer = Timer(cuda)
    cases = []
    for case in SMOKE_CASES if opts.smoke else GPU_CASES:
        row = run_case(torch, kernels, timer, case, shape)
        print(f"{row['name']}: plain {row['plain_ms']:.3f} ms, cascade {row['cascade_ms']:.3f} ms "
              f"({row['speedup']:.2f}x), {row['plain_mb']:.1f} -> {row['cascade_mb']:.1f} MB, "
              f"diff {row['max_abs_diff']:.1e}", flush=True)
        cases.append(row)
    result = dict(meta, smoke=opts.smoke, shape=dict(base), cases=cases)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / f"cascade-{slug}.json").write_text(json.dumps(result, indent=2) + "\n")
    (opts.out_dir / f"cascade-{slug}.md").write_text(markdown(result))
    print(f"wrote {opts.out_dir}/cascade-{slug}.json and .md")
    bad = [r["name"] for r in cases if not r["max_abs_diff"] <= (2e-2 if not opts.smoke else 1e-2)]
    if bad:
        print(f"time_cascade: cascade differs from the plain kernel in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
