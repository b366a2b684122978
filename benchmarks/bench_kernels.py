"""Kernel benchmark: paged prefix-prefill attention TFLOP/s and decode bandwidth.

Needs a CUDA GPU. It first measures the device's own ceilings (dense bf16 matmul TFLOP/s
and device-to-device copy GB/s), then times:

* the SPEC shape (the kernel goal's): 8 requests x (8192 cached + 2048 new), 32 q / 8 kv heads,
  head_dim 128, bf16, block_size 16, against our torch reference and dense SDPA;
* a sweep over cached prefix 0..32k and q_len 1..8k;
* decode: 64 requests x 8k context, q_len 1, as GB/s of K/V read against the copy GB/s;
* split-KV decode: 1 and 4 requests x 32k context, with the heuristic's splits and unsplit.

Results go to ``benchmarks/results/kernels-<device>.json`` and ``.md`` with the device,
git commit, versions and shapes. ``--smoke`` runs tiny shapes through the Triton
interpreter on a CPU, only to prove the script works (no timings worth reading). Tile
tuning is ``tune_kernels.py``; the shapes and timer live in ``kernel_problems.py``.

FLOPs count only the (query, key) pairs attended: with bottom-right causal alignment,
query i of a request with ``kv_len`` keys and ``q_len`` queries sees
``kv_len - q_len + i + 1`` keys; each pair costs ``4 * head_dim`` FLOPs per query head.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kernel_problems import (
    ROOT,
    SMOKE,
    SPEC_DECODE,
    SPEC_PREFILL,
    SPLIT_DECODE,
    Timer,
    make_problem,
    open_session,
    prefill_flops,
    with_device,
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the Triton interpreter (CPU ok)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--no-sweep", action="store_true", help="skip the prefix x q_len sweep")
    return p.parse_args(argv)


def dense_sdpa(torch, args, ids, *, batch, q_len, kv_len, heads, kv_heads):
    """A closure running torch SDPA on contiguous copies (the best non-paged baseline)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    q, k_cache, v_cache, block_table = args[:4]
    blocks = torch.tensor(ids, device=q.device)
    k = k_cache[blocks].flatten(1, 2)[:, :kv_len].repeat_interleave(heads // kv_heads, 2).transpose(1, 2)
    v = v_cache[blocks].flatten(1, 2)[:, :kv_len].repeat_interleave(heads // kv_heads, 2).transpose(1, 2)
    qd = q.view(batch, q_len, heads, -1).transpose(1, 2)
    mask = causal_lower_right(q_len, kv_len)
    return lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask)


def flash_sdpa(torch, args, ids, *, batch, q_len, kv_len, heads, kv_heads):
    """The local anchor: torch's flash SDPA backend on contiguous K/V, GQA without copies.

    Flash attention in torch has no bottom-right causal mask, so it attends every
    (query, key) pair: its TFLOP/s are counted on that larger work (``flash_flops``)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k_cache, v_cache = args[:3]
    blocks = torch.tensor(ids, device=q.device)
    k = k_cache[blocks].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
    v = v_cache[blocks].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
    qd = q.view(batch, q_len, heads, -1).transpose(1, 2)

    def call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, k, v, enable_gqa=True)
    return call


def device_ceilings(torch, timer):
    """Measured dense bf16 matmul TFLOP/s and copy GB/s (read + write) of this GPU."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = timer(lambda: a @ b)
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    return {"matmul_bf16_tflops": 2 * n**3 / ms / 1e9, "copy_gbps": 2 * src.numel() / copy_ms / 1e6}


def run_case(torch, kernels, timer, cfg, *, reference, sdpa, flash=False):
    """Time one prefill shape; returns a result row."""
    args, ids = make_problem(torch, kernels, **cfg)
    kv_len = cfg["prefix"] + cfg["q_len"]
    flops = prefill_flops(cfg)
    out = torch.empty_like(args[0])
    fn = lambda: kernels.paged_prefill_attention(*args, out=out, backend="triton")  # noqa: E731
    row = {k: v for k, v in cfg.items() if k not in ("dtype", "device")}
    row["dtype"] = str(cfg["dtype"]).replace("torch.", "")
    row["tflop"] = flops / 1e12
    row["triton_ms"] = timer(fn)
    row["triton_tflops"] = flops / row["triton_ms"] / 1e9
    if reference:
        want = kernels.paged_prefill_attention_reference(*args)
        row["max_abs_err_vs_reference"] = err = float((out.float() - want.float()).abs().max())
        if not err < 5e-2:
            print(f"WARNING: Triton output differs from the reference by {err} on {row}", file=sys.stderr)
        row["reference_ms"] = timer(lambda: kernels.paged_prefill_attention_reference(*args))
    dense_gb = 2 * cfg["batch"] * kv_len * cfg["heads"] * cfg["head_dim"] * args[0].element_size() / 1e9
    if sdpa and dense_gb > 16:
        row["sdpa_dense_error"] = f"skipped: dense K/V copies would take {dense_gb:.0f} GB"
    elif sdpa:
        try:
            row["sdpa_dense_ms"] = timer(dense_sdpa(torch, args, ids, batch=cfg["batch"], q_len=cfg["q_len"],
                                                    kv_len=kv_len, heads=cfg["heads"],
                                                    kv_heads=cfg["kv_heads"]))
        except (RuntimeError, ImportError) as exc:  # no lower-right mask support on this build
            row["sdpa_dense_error"] = str(exc)[:200]
    if sdpa and flash:
        try:
            shape = dict(batch=cfg["batch"], q_len=cfg["q_len"], kv_len=kv_len, heads=cfg["heads"],
                         kv_heads=cfg["kv_heads"])
            row["sdpa_flash_ms"] = timer(flash_sdpa(torch, args, ids, **shape))
            flash_flops = 4 * cfg["head_dim"] * cfg["heads"] * cfg["batch"] * cfg["q_len"] * kv_len
            row["sdpa_flash_tflops"] = flash_flops / row["sdpa_flash_ms"] / 1e9
        except (RuntimeError, ImportError, TypeError) as exc:  # no flash backend for this shape/build
            row["sdpa_flash_error"] = str(exc)[:200]
    return row


def run_decode(torch, kernels, timer, cfg, num_splits=None):
    """Decode: GB/s of K/V actually read (each request's kv_len tokens, all kv heads).
    ``num_splits`` forces the split-KV count (1: unsplit); None leaves it to the heuristic."""
    args, _ = make_problem(torch, kernels, **cfg)
    out = torch.empty_like(args[0])
    call = lambda: kernels.paged_prefill_attention(*args, out=out, backend="triton")  # noqa: E731
    if num_splits is not None:
        from prefixkv.kernels.attention import paged_prefill_attention_triton
        from prefixkv.kernels.tiling import choose_tiles

        tiles = choose_tiles(group=cfg["heads"] // cfg["kv_heads"], head_dim=cfg["head_dim"], max_seqlen_q=1,
                             on_gpu=args[0].is_cuda, elem_bytes=args[0].element_size())
        config = dataclasses.replace(tiles, num_splits=num_splits)
        call = lambda: paged_prefill_attention_triton(*args, out=out, config=config)  # noqa: E731
    ms = timer(call)
    elem = args[1].element_size()
    kv_bytes = 2 * cfg["batch"] * (cfg["prefix"] + 1) * cfg["kv_heads"] * cfg["head_dim"] * elem
    return {"batch": cfg["batch"], "context": cfg["prefix"] + 1, "kv_heads": cfg["kv_heads"],
            "heads": cfg["heads"],
            "head_dim": cfg["head_dim"], "block_size": cfg["block_size"], "ms": ms, "kv_gb": kv_bytes / 1e9,
            "gbps": kv_bytes / ms / 1e6}


def shapes(smoke: bool, device: str, torch):
    """The SPEC shape, sweep and decode configs (tiny ones for --smoke)."""
    if smoke:
        base = with_device(SMOKE, device, torch)
        return (dict(batch=2, prefix=40, q_len=24, **base),
                [dict(batch=1, prefix=p, q_len=q, **base) for p in (0, 33) for q in (1, 17)],
                dict(batch=3, prefix=50, q_len=1, **base))
    spec, decode = with_device(SPEC_PREFILL, device, torch), with_device(SPEC_DECODE, device, torch)
    sweep = [dict(spec, batch=max(1, min(64, 8192 // q)), prefix=p, q_len=q)
             for p in (0, 1024, 4096, 16384, 32768) for q in (1, 16, 128, 1024, 8192)]
    return spec, sweep, decode


def split_shapes(smoke: bool, device: str, torch):
    """Long-context decode with few requests: the heuristic splits the keys (SM count 132: 17, 5)."""
    if smoke:
        return [dict(batch=1, prefix=599, q_len=1, **with_device(SMOKE, device, torch))]
    return [dict(with_device(SPLIT_DECODE, device, torch), batch=b) for b in (1, 4)]


def write_results(result: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"kernels-{name}.json", out_dir / f"kernels-{name}.md"
    jpath.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Kernel benchmark on {result['device']}", "",
             f"commit `{result['commit']}`, torch {result['torch']}, triton {result['triton']}", ""]
    if result["smoke"]:
        lines += ["Smoke run: tiny shapes, possibly through the Triton interpreter; the timings mean "
                  "nothing.", ""]
    for key, val in result.get("ceilings", {}).items():
        lines.append(f"- {key}: {val:.1f}")
    s = result["spec_shape"]
    lines += ["", "## SPEC shape", "", f"{s['batch']} x ({s['prefix']} cached + {s['q_len']} new), "
              f"{s['heads']}/{s['kv_heads']} heads, d {s['head_dim']}, {s['dtype']}, block "
              f"{s['block_size']}: "
              f"**{s['triton_tflops']:.1f} TFLOP/s** ({s['triton_ms']:.3f} ms, {s['tflop']:.3f} TFLOP)"]
    if "sdpa_dense_ms" in s:
        lines += ["", "- torch SDPA, contiguous K/V, lower-right causal mask (same work): "
                  f"{s['sdpa_dense_ms']:.3f} ms"]
    if "sdpa_flash_ms" in s:
        lines += [f"- torch flash SDPA, contiguous K/V, no mask (every pair attended, counted as such): "
                  f"{s['sdpa_flash_ms']:.3f} ms, {s['sdpa_flash_tflops']:.1f} TFLOP/s"]
    for key in ("sdpa_dense_error", "sdpa_flash_error"):
        if key in s:
            lines.append(f"- {key}: {s[key]}")
    if result.get("sweep"):
        lines += ["", "## Sweep", "", "| batch | prefix | q_len | ms | TFLOP/s | SDPA dense ms |",
                  "|---|---|---|---|---|---|"]
        for r in result["sweep"]:
            lines.append(f"| {r['batch']} | {r['prefix']} | {r['q_len']} | {r['triton_ms']:.3f} | "
                         f"{r['triton_tflops']:.1f} | {r.get('sdpa_dense_ms', float('nan')):.3f} |")
    d = result["decode"]
    lines += ["", "## Decode", "", f"{d['batch']} x {d['context']} context: {d['gbps']:.0f} GB/s "
              f"({d['ms']:.3f} ms for {d['kv_gb']:.2f} GB of K/V)", ""]
    if result.get("split_decode"):
        lines += ["## Split-KV decode", "", "| batch | context | split ms | GB/s | unsplit ms | GB/s |",
                  "|---|---|---|---|---|---|"]
        for r in result["split_decode"]:
            u = r["unsplit"]
            lines.append(f"| {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['gbps']:.0f} | "
                         f"{u['ms']:.3f} | {u['gbps']:.0f} |")
        lines.append("")
    mpath.write_text("\n".join(lines))
    return jpath, mpath


def main(argv=None) -> int:
    opts = parse_args(argv)
    session = open_session("bench_kernels", opts.smoke)
    if session is None:
        return 2
    torch, kernels, cuda, meta, slug = session
    device = "cuda" if cuda else "cpu"
    timer = Timer(cuda)
    spec, sweep, decode = shapes(opts.smoke, device, torch)
    result = dict(meta, smoke=opts.smoke, ceilings=device_ceilings(torch, timer) if cuda else {})
    result["spec_shape"] = run_case(torch, kernels, timer, spec, reference=True, sdpa=cuda, flash=cuda)
    if cuda:
        result["spec_shape"]["fraction_of_matmul_peak"] = (
            result["spec_shape"]["triton_tflops"] / result["ceilings"]["matmul_bf16_tflops"])
    result["sweep"] = [] if opts.no_sweep else [
        run_case(torch, kernels, timer, cfg, reference=opts.smoke, sdpa=cuda) for cfg in sweep]
    result["decode"] = run_decode(torch, kernels, timer, decode)
    if cuda:
        result["decode"]["fraction_of_copy_bw"] = result["decode"]["gbps"] / result["ceilings"]["copy_gbps"]
    result["split_decode"] = [dict(run_decode(torch, kernels, timer, cfg), unsplit=run_decode(
        torch, kernels, timer, cfg, num_splits=1)) for cfg in split_shapes(opts.smoke, device, torch)]
    jpath, mpath = write_results(result, opts.out_dir, slug)
    print(mpath.read_text())
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
