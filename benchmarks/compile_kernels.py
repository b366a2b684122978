"""Compile the Triton kernels ahead of time for NVIDIA Hopper (sm_90) on a machine without a GPU.

The interpreter that runs our tests on a CPU never lowers a kernel, so it misses GPU-only
failures (unsupported ops, ``tl.dot`` type mismatches, too much shared memory, spills).
Triton compiles for a given target without a device or driver: TTIR -> TTGIR -> LLVM ->
PTX, then the ``ptxas`` in the wheel makes the cubin.

Each config runs our real launcher on ``meta`` tensors; a stub in place of the
``@triton.jit`` object records the arguments, which Triton's own binder then specialises
as a launch would (16-byte alignment, ints equal to 1 as constants) before compiling for
``GPUTarget("cuda", 90, 32)``. Registers and spills: the ``ptxas -v`` log of that compile;
shared memory: Triton's allocation (a launch's dynamic shared memory). Whether the K/V tile
loads are software-pipelined: the TTGIR of each compile (:func:`loop_loads`).

Runs unchanged on triton 3.6 through 3.9 (``benchmarks/results/kernels-triton-compat.md``):
``GPUTarget``, ``ASTSource``, ``make_backend``, ``create_function_from_signature``,
``JITFunction._pack_args``, ``knobs.nvidia.dump_ptxas_log`` and ``get_ptxas`` have the same
place and signature in all four. ``--out-name`` keeps one run per version apart.

``TRITON_INTERPRET`` must be off when Triton is imported (it turns every ``@triton.jit``
function, ``tl.sum`` included, into an interpreter object), so ``main`` clears it and the
test suite, which sets it, runs this script in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from kernel_problems import ROOT, SPEC_DECODE, SPEC_PREFILL, SPLIT_DECODE
from kernel_static import (
    MAX_REGS_PER_THREAD,
    MAX_WARPS_PER_SM,
    MMA_FLOP_PER_CLOCK,
    SMEM_PER_BLOCK,
    causal_trips,
    compile_launch,
    loop_loads,
    occupancy,
    parse_ptxas,
    shape_ceiling,
    static_report,
)

SPEC = dict(SPEC_PREFILL, kind="attn")
DECODE = dict(SPEC_DECODE, kind="attn")
CONFIGS = {
    "prefill-spec": SPEC,
    # The loop with QK^T a tile ahead and PV behind (the tile triton 3.7+ took until run 3):
    # kept compiled, spill-free, as the tune's candidate and the tests' guard of the overlap.
    "prefill-spec-qk-ahead": dict(SPEC, tiles="128x64w8s3a"),
    # The 256-row tile with a three-deep K/V ring (num_stages 5): the static model's best
    # tile for the SPEC shape (the ring hides the round trip), measured below 256 x 128 (run 6).
    "prefill-spec-deep-ring": dict(SPEC, tiles="256x64w8s5"),
    "decode": DECODE,
    **{f"{n}-{dt}": dict(c, dtype=f"float{dt[2:]}") for dt in ("fp16", "fp32") for n, c in
       (("prefill", SPEC), ("decode", DECODE))},
    **{f"prefill-d{d}": dict(SPEC, head_dim=d) for d in (64, 80, 96, 256)},
    **{f"decode-d{d}": dict(DECODE, head_dim=d) for d in (64, 80, 96, 256)},
    "prefill-d256-q8": dict(SPEC, head_dim=256, q_len=8),
    **{f"{n}-group{g}": dict(c, kv_heads=32 // g) for n, c in (("prefill", SPEC), ("decode", DECODE))
       for g in (1, 8)},
    "prefill-softcap": dict(SPEC, softcap=50.0),
    "prefill-window": dict(SPEC, window_size=(4095, 0)),
    "prefill-lse": dict(SPEC, return_lse=True),
    "prefill-all-switches": dict(SPEC, softcap=50.0, window_size=(4095, 0), return_lse=True),
    "prefill-d256-all-switches": dict(SPEC, head_dim=256, softcap=50.0, window_size=(4095, 0),
                                      return_lse=True),
    "decode-all-switches": dict(DECODE, softcap=50.0, window_size=(4095, 0), return_lse=True),
    "prefill-noncausal-block5": dict(SPEC, block_size=5, causal=False),
    # Split-KV decode (the heuristic picks 17 and 5 splits); "-combine": the merge kernel.
    "decode-split-32k": (SPLIT := dict(SPLIT_DECODE, kind="attn")),
    "decode-split-32k-combine": dict(SPLIT, kernel="combine"),
    "decode-split-32k-b4": dict(SPLIT, batch=4),
    "decode-split-32k-all-switches": dict(SPLIT, softcap=50.0, window_size=(4095, 0), return_lse=True),
    "decode-split-32k-lse-combine": dict(SPLIT, return_lse=True, kernel="combine"),
    "decode-split-32k-d256-fp16": dict(SPLIT, head_dim=256, dtype="float16"),
    # fp8 caches (q and output bf16), per-KV-head scales; attention sinks.
    **{f"{n}-fp8-{f}": dict(c, cache_dtype=f"float8_{f}", scales="head") for n, c in
       (("prefill", SPEC), ("decode", DECODE)) for f in ("e4m3fn", "e5m2")},
    "prefill-sinks": dict(SPEC, sinks=True),
    "decode-split-32k-sinks-fp8": dict(SPLIT, sinks=True, cache_dtype="float8_e4m3fn", scales="tensor"),
    "write_kv-fp8-e4m3fn": dict(kind="write_kv", kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16",
                                cache_dtype="float8_e4m3fn", scales="head", tokens=2048),
    "write_kv": dict(kind="write_kv", kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16", tokens=2048),
    "write_kv-d80-fp16": dict(kind="write_kv", kv_heads=8, head_dim=80, block_size=16, dtype="float16",
                              tokens=2048),
    "write_kv-d256-h1": dict(kind="write_kv", kv_heads=1, head_dim=256, block_size=16, dtype="bfloat16",
                             tokens=64),
}


def load_compiled_modules():
    """The ``attention`` and ``write_kv`` modules; raises RuntimeError if the interpreter is on."""
    sys.path.insert(0, str(ROOT / "src"))
    from triton import knobs

    if knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is on in this process: run benchmarks/compile_kernels.py "
                           "in a process without it to compile for a GPU target")
    from prefixkv.kernels import attention, split_kv, write_kv

    return {"attention": attention, "split_kv": split_kv, "write_kv": write_kv}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs

        return launch


def parse_tiles(text: str):
    """``"256x128w8s3"`` (block_m x block_n, warps, stages; a trailing ``a``: QK^T a tile
    ahead) as a ``TileConfig``."""
    from prefixkv.kernels.tiling import TileConfig

    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(a?)", text)
    if not m:
        raise ValueError(f"tiles must read like 256x128w8s3 or 128x64w8s3a (block_m x block_n, warps, "
                         f"stages, a: QK^T a tile ahead), got {text!r}")
    bm, bn, w, st = map(int, m.groups()[:4])
    return TileConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, qk_ahead=m.group(5) == "a")


def record_launch(mods, cfg: dict, tiles=None):
    """Run our launcher on ``meta`` tensors; return (jit kernel, grid, args, kwargs) of the
    attention kernel, or with ``kernel="combine"`` of the split-KV merge that follows it.
    ``tiles`` (a ``TileConfig``) replaces the heuristic's choice, else the config's own
    ``tiles`` (text, as ``--tiles``) does."""
    import torch

    if tiles is None and "tiles" in cfg:
        tiles = parse_tiles(cfg["tiles"])

    dt = getattr(torch, cfg["dtype"])
    cdt = getattr(torch, cfg.get("cache_dtype", cfg["dtype"]))
    meta = dict(device="meta")
    kvh, d, bs = cfg["kv_heads"], cfg["head_dim"], cfg["block_size"]
    extra = {}
    if "scales" in cfg:
        n_scales = kvh if cfg["scales"] == "head" else 1
        extra = dict(k_scale=torch.empty(n_scales, **meta), v_scale=torch.empty(n_scales, **meta))
    if cfg.get("sinks"):
        extra["sinks"] = torch.empty(cfg["heads"], **meta)
    if cfg["kind"] == "write_kv":
        mod, attr = mods["write_kv"], "_write_kv_kernel"
        n = cfg["tokens"]
        cache = torch.empty(-(-n // bs) + 1, bs, kvh, d, dtype=cdt, **meta)
        args = (torch.empty(n, kvh, d, dtype=dt, **meta), torch.empty(n, kvh, d, dtype=dt, **meta),
                cache, torch.empty_like(cache), torch.empty(n, dtype=torch.int64, **meta))
        call, kwargs = mod.write_kv_cache_triton, extra
    else:
        mod, attr = mods["attention"], "_paged_prefill_kernel"
        from prefixkv.kernels.tiling import choose_tiles

        b, q_len, kv_len = cfg["batch"], cfg["q_len"], cfg["prefix"] + cfg["q_len"]
        n_blk = -(-kv_len // bs)
        cache = torch.empty(b * n_blk, bs, kvh, d, dtype=cdt, **meta)
        args = (torch.empty(b * q_len, cfg["heads"], d, dtype=dt, **meta), cache, torch.empty_like(cache),
                torch.empty(b, n_blk, dtype=torch.int32, **meta),
                torch.empty(b + 1, dtype=torch.int32, **meta),
                torch.empty(b, dtype=torch.int32, **meta), q_len, kv_len)
        window = cfg.get("window_size") is not None and cfg["window_size"][0] >= 0
        tiles = tiles or choose_tiles(group=cfg["heads"] // kvh, head_dim=d, max_seqlen_q=q_len, on_gpu=True,
                             elem_bytes=args[0].element_size(), window=window,
                             return_lse=cfg.get("return_lse", False), kv_fp8=cdt.itemsize == 1)
        kwargs = dict(config=tiles, causal=cfg.get("causal", True), window_size=cfg.get("window_size"),
                      softcap=cfg.get("softcap", 0.0), return_lse=cfg.get("return_lse", False), **extra)
        call = mod.paged_prefill_attention_triton
    stubs = [(mod, attr)] + ([(mods["split_kv"], "_combine_splits_kernel")] if cfg["kind"] == "attn" else [])
    saved = {name: getattr(m, name) for m, name in stubs}
    recs = {name: _Recorder() for _, name in stubs}
    for m, name in stubs:
        setattr(m, name, recs[name])
    try:
        call(*args, **kwargs)
    finally:
        for m, name in stubs:
            setattr(m, name, saved[name])
    if cfg.get("kernel") == "combine":
        attr = "_combine_splits_kernel"
        if not hasattr(recs[attr], "grid"):
            raise RuntimeError("the heuristic chose no split for this config, so there is no combine launch")
    return saved[attr], recs[attr].grid, recs[attr].args, recs[attr].kwargs


def compile_config(name: str, mods: dict, tiles=None, sass: bool = True) -> dict:
    """Compile one entry of :data:`CONFIGS` for sm_90 (with ``tiles`` instead of the
    heuristic's, when given); a result row (``ok`` False on error). ``sass``: read the
    attention kernel's SASS too (``row["sass"]``, ``row["shape_ceiling"]``: nvdisasm and
    the loop model, about 1 s a config)."""
    cfg = CONFIGS[name]
    row = {"name": name, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}}
    start = time.perf_counter()
    try:
        jit_fn, grid, args, kwargs = record_launch(mods, cfg, tiles)
        row.update(grid=list(grid), num_warps=kwargs.get("num_warps", 4),
                   num_stages=kwargs.get("num_stages", 3))
        row["constexprs"] = {k: v for k, v in kwargs.items() if k.isupper() and k != "DOT_PRECISION"}
        kernel, log = compile_launch(jit_fn, args, kwargs)
        md = kernel.metadata
        row.update(parse_ptxas(log), ok=True, shared=md.shared, num_warps=md.num_warps,
                   num_stages=md.num_stages)
        row["blocks_per_sm"] = occupancy(row["n_regs"], md.num_warps, md.shared)
        ptx = kernel.asm["ptx"]
        row["ptx_fp8_cvt"] = sorted(set(re.findall(r"cvt\.[a-z0-9.]*(?:e4m3|e5m2)[a-z0-9.]*",
                                                   ptx)))  # fp8 casts
        row["mma"] = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
        row["loop_loads"] = loads = loop_loads(kernel.asm["ttgir"])
        row["pipelined"] = (loads["async"] + loads["tma"] > 0
                            and loads["sync"] == 0) if any(loads.values()) else None
        c = row["constexprs"]
        if sass and "BLOCK_N" in c and cfg.get("kernel") != "combine":  # the attention kernel's key loops
            row["sass"] = static_report(kernel.asm["cubin"], kernel.asm["ttgir"],
                                        Path(jit_fn.fn.__code__.co_filename),
                                        block_m=c["BLOCK_M"], block_n=c["BLOCK_N"], dim=c["DIM_P2"],
                                        num_warps=md.num_warps, mma=row["mma"],
                                        ctas_per_sm=max(1, row["blocks_per_sm"]),
                                        phase_order=[1, 2, 3] if c.get("HAS_LEFT") else [2, 3],
                                        resources=dict(stack_frame=row["stack_frame"], shared=md.shared))
            row["shape_ceiling"] = whole_shape(cfg, c, row["sass"]["loops"])
    except Exception as exc:  # noqa: BLE001  a failed compile is a result, reported per config
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-1500:]}")
    row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


def whole_shape(cfg: dict, c: dict, loops: dict) -> dict | None:
    """The config's key tiles per KV head and request (:func:`causal_trips`) and the serial
    model's share of peak over all of them (:func:`shape_ceiling`), with memory
    (``peak_fraction``) and without (``without_memory``); ``main_loop``: the loop that
    takes most of the shape's clocks, ``main_share`` that part, ``bound`` what bounds it;
    ``port_cap``: the most any schedule of that loop's tile could reach at the model's L2
    port floor (its wgmma clocks over its K/V bytes' port clocks, at most 1). None unless
    the kernel is causal, windowless and unsplit and both key loops were found."""
    if (not cfg.get("causal", True) or cfg.get("window_size") is not None or c.get("SPLIT")
            or not {"phase2", "phase3"} <= loops.keys()):
        return None
    trips = causal_trips(prefix=cfg["prefix"], q_len=cfg["q_len"], group_p2=c["GROUP_P2"],
                         block_m=c["BLOCK_M"], block_n=c["BLOCK_N"])
    clocks = {k: trips[k] * loops[k]["serial"]["clocks"] for k in ("phase2", "phase3")}
    main = max(clocks, key=clocks.__getitem__)
    mma = 4 * c["BLOCK_M"] * c["BLOCK_N"] * c["DIM_P2"] / MMA_FLOP_PER_CLOCK["wgmma"]
    port = loops[main]["serial"]["units"].get("l2")
    return dict(trips, peak_fraction=round(shape_ceiling(loops, trips), 4),
                without_memory=round(shape_ceiling(loops, trips, "peak_fraction_without_memory"), 4),
                main_loop=main, main_share=round(clocks[main] / sum(clocks.values()), 4),
                bound=loops[main]["serial"]["bound"],
                port_cap=round(min(1.0, mma / port), 4) if port else None)


def flags(r: dict) -> list[str]:
    """Red flags of one compiled row, against the Hopper limits."""
    out = [f"{r['n_spills']} B of register spills"] if r["n_spills"] else []
    out += [f"{r['n_regs']} registers, the 255 cap"] if r["n_regs"] >= MAX_REGS_PER_THREAD else []
    out += [f"ptxas serialised every wgmma ({why}): a wait after each one"
            for why in r.get("wgmma_serialized", [])]
    out += [f"{r['shared']} B smem, over the {SMEM_PER_BLOCK} B a block may "
            "use"] if r["shared"] > SMEM_PER_BLOCK else []
    out += [f"{r['loop_loads']['sync']} tile loads in loops not "
            "pipelined"] if r.get("pipelined") is False else []
    warps = r["blocks_per_sm"] * r["num_warps"]
    out += [f"{warps} resident warps/SM ({warps / MAX_WARPS_PER_SM:.1%} occupancy)"] if warps < 8 else []
    return out


def pipelining(r: dict) -> str:
    """The ``pipelined loads`` cell: yes/no and the 2-D loads in loops by kind, ``-`` without any."""
    if r.get("pipelined") is None:
        return "-"
    kinds = ", ".join(f"{n} {kind}" for kind, n in r["loop_loads"].items() if n)
    return f"{'yes' if r['pipelined'] else 'no'} ({kinds})"


def _tile_text(r: dict) -> str:
    c = r.get("constexprs", {})
    return (f"{c['BLOCK_M']} x {c['BLOCK_N']}, {r['num_warps']} warps, {r['num_stages']} stages"
            + (", QK ahead" if c.get("QK_AHEAD") else "")) if "BLOCK_M" in c else "-"


def _shares(row: dict, loop: str) -> tuple[str, str, str]:
    """Instructions a tile and the serial model's % of peak with and without memory of one
    loop of a report row, or of the whole shape (``loop`` "whole shape"); "-" where an
    older report lacks a figure."""
    if loop == "whole shape":
        w, loops = row.get("shape_ceiling"), row["sass"]["loops"]
        if not w:
            return "-", "-", "-"
        trips = {k: w[k] for k in ("phase2", "phase3")}
        without = ("-" if not all("peak_fraction_without_memory" in loops[k].get("serial", {}) for k in trips)
                   else f"{100 * shape_ceiling(loops, trips, 'peak_fraction_without_memory'):.1f}")
        return "-", f"{100 * w['peak_fraction']:.1f}", without
    t = row["sass"]["loops"][loop]
    ser = t.get("serial", {})
    without = ser.get("peak_fraction_without_memory")
    return (str(t["instructions"]), f"{100 * ser['peak_fraction']:.1f}" if ser else "-",
            "-" if without is None else f"{100 * without:.1f}")


def before_after(before: dict, after: dict) -> list[str]:
    """Markdown rows comparing the key loops, and the whole shape, of the configs both
    reports compiled."""
    old = {r["name"]: r for r in before["configs"] if r["ok"]}
    lines = [f"## Before and after (before: triton {before['triton']}, `{before.get('source', '?')}`)", "",
             "Serial model, % of peak with memory / without.", "",
             "| config | loop | before: tile | regs / spills (B) | instr/tile | serial % peak | after: tile "
             "| regs / spills (B) | instr/tile | serial % peak |", "|---" * 10 + "|"]
    for r in after["configs"]:
        b = old.get(r["name"])
        if not (b and r["ok"] and r.get("sass") and b.get("sass")):
            continue
        for loop in [*r["sass"]["loops"], "whole shape"]:
            if loop != "whole shape" and loop not in b["sass"]["loops"]:
                continue
            (bi, bw, bo), (ai, aw, ao) = _shares(b, loop), _shares(r, loop)
            if loop == "whole shape" and "-" in (bw, aw):
                continue
            lines.append(f"| {r['name']} | {loop} | {_tile_text(b)} | {b['n_regs']} / {b['n_spills']} | "
                         f"{bi} | {bw} / {bo} | {_tile_text(r)} | {r['n_regs']} / {r['n_spills']} | "
                         f"{ai} | {aw} / {ao} |")
    return lines + [""]


def markdown(result: dict, reading: str = "", before: dict | None = None) -> str:
    """The report; ``reading`` (a hand-written ``## Reading`` section) is kept across runs;
    ``before`` (an earlier report's JSON) adds a before/after table of the key loops."""
    rows = result["configs"]
    lines = [f"# Ahead-of-time compile for sm_90 (H100): triton {result['triton']}, {result['ptxas']}", "",
             "Compiled on a CPU-only machine (no CUDA driver) by `benchmarks/compile_kernels.py`. "
             "Registers and spills: `ptxas -v` of each compile; smem: Triton's shared-memory "
             "allocation per block; blocks/SM: occupancy estimate from those figures and the "
             "Hopper limits (65536 regs/SM, 228 KiB smem/SM, 227 KiB per block, 64 warps/SM).", "",
             "| config | ok | BLOCK_M x BLOCK_N | warps | stages | regs | spills (B) | smem (B) | blocks/SM "
             "| warps/SM | mma | pipelined loads | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("constexprs", {})
        tile = f"{c['BLOCK_M']} x {c['BLOCK_N']}" if "BLOCK_M" in c else "-"
        tile += f" ({r['grid'][2]} splits)" if c.get("SPLIT") else ""
        tile += " QK ahead" if c.get("QK_AHEAD") else ""
        cells = ([r["n_regs"], r["n_spills"], r["shared"], r["blocks_per_sm"],
                  r["blocks_per_sm"] * r["num_warps"],
                  r["mma"], pipelining(r)] if r["ok"] else ["-"] * 7)
        lines.append(f"| {r['name']} | {'ok' if r['ok'] else '**error**'} | {tile} | "
                     f"{r.get('num_warps', '-')} | "
                     f"{r.get('num_stages', '-')} | " + " | ".join(map(str,
                                                                       cells)) + f" | {r['compile_s']} |")
    lines += ["", "## Key loops in the SASS (per CTA, per key tile)", "",
              "Instructions of one pass of each phase loop of the attention kernel (`nvdisasm` of the cubin; "
              "phase 2: cached prefix, no mask; phase 3: diagonal, masked; phase 1: left window edge, "
              "masked), "
              "scaled to 64 keys; MMA and MUFU.EX2 per warp per tile; K/V ring: shared-memory buffers of "
              "the cp.async pipeline. Clocks per tile on one H100 SM: MMA (FLOPs / 4096 per clock for "
              "wgmma, 2048 assumed for mma.sync), issue (instructions x warps / 4 schedulers), exp2 "
              "(MUFU.EX2 x warps x 32 / 16 per clock); the bound is the largest, and % of peak is the "
              "wgmma clocks over it (the 989 TFLOP/s this loop could reach if memory and latency never "
              "stalled it): the *overlap* model, which assumes the units always overlap. The "
              "*serial* model (`benchmarks/kernel_timing.py`) replays the loop body and adds what "
              "the SASS serialises: issue stops at `WARPGROUP.DEPBAR` until the wgmma groups are "
              "done, an instruction waits for the MUFU/HMMA results it reads, and with c CTAs per SM "
              "their waits overlap (clocks = max(one CTA's period / c, busiest unit)); since run 3 "
              "it adds memory: each cp.async group lands an L2 latency after crossing the SM's L2 "
              "port (24 B/clk shared by the CTAs, 800 clocks), `DEPBAR.LE SB0` waits for it, spills "
              "read back wait for L1 or L2, and the port is a unit. Waits: `WARPGROUP.DEPBAR` / "
              "`BAR.SYNC` per pass. The overlap model leaves memory out.", "",
              "| config | loop | instr/tile | instr/64 keys | mma | ex2 | K/V ring | clocks mma / issue / "
              "ex2 "
              "| waits | overlap: bound, % peak | serial: clocks | serial: bound | serial: % peak |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for loop, t in (r.get("sass") or {}).get("loops", {}).items():
            clk, ser = t["clocks"], t["serial"]
            lines.append(f"| {r['name']} | {loop}{' (masked)' if t['masked'] else ''} | {t['instructions']} "
                         "| "
                         f"{t['per_64_keys']} | {t['mma']} | {t['ex2']} | {r['sass']['kv_ring']} | "
                         f"{clk['mma']:.0f} / {clk['issue']:.0f} / {clk['ex2']:.0f} | "
                         f"{ser['waits']['group_wait']} / {ser['waits']['bar_sync']} | {t['bound']}, "
                         f"{100 * t['peak_fraction']:.1f} | {ser['clocks']:.0f} | {ser['bound']} | "
                         f"{100 * ser['peak_fraction']:.1f} |")
    lines += ["", "## Whole shape (serial model)", "",
              "Each key loop's serial clocks per tile weighted by the key tiles it runs for the "
              "config's shape (causal, no window, no split; per request and KV head, as the kernel "
              "bounds its phases): the share of peak of all the shape's key tiles together, with "
              "memory and without (the model before run 3). Main loop: the loop with most of the "
              "shape's clocks, its share of them, and what bounds it; L2 port cap: the most any "
              "schedule of that tile could reach with its K/V bytes at the model's port floor "
              "(24 B/clk); ptxas's notes that it serialised the wgmma (C751x), if any.", "",
              "| config | tile | query tiles | phase 2 tiles | phase 3 tiles | phase 2 tiles per phase 3 "
              "tile | % peak | % peak without memory | main loop (share of clocks) | bound | L2 port cap "
              "| wgmma serialised by ptxas |", "|---" * 12 + "|"]
    for r in rows:
        if w := r.get("shape_ceiling"):
            ratio = f"{w['phase2'] / w['phase3']:.1f}" if w["phase3"] else "-"
            serial = ", ".join(c.split(":")[0] for c in r.get("wgmma_serialized", [])) or "no"
            extra = (f"{100 * w['without_memory']:.1f} | {w['main_loop']} ({100 * w['main_share']:.1f}%) | "
                     f"{w['bound']} | " + (f"{100 * w['port_cap']:.1f}" if w.get("port_cap") else "-")
                     if "without_memory" in w else "- | - | - | -")  # reports before these columns
            lines.append(f"| {r['name']} | {_tile_text(r)} | {w['query_tiles']} | {w['phase2']} | "
                         f"{w['phase3']} | {ratio} | **{100 * w['peak_fraction']:.1f}** | {extra} | "
                         f"{serial} |")
    if before is not None:
        lines += [""] + before_after(before, result)
    lines += ["", "## Flags (computed)", ""]
    lines += [f"- `{r['name']}`: " + "; ".join(flags(r)) for r in rows if r["ok"] and flags(r)] or ["- none"]
    lines += [f"- `{r['name']}`: **error** `{r['error'][:600]}`" for r in rows if not r["ok"]]
    return "\n".join(lines) + "\n" + (f"\n{reading.strip()}\n" if reading else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="compile only these configs")
    p.add_argument("--tiles", help="compile the attention configs with these tiles instead of the "
                   "heuristic's, e.g. 256x128w8s3 (block_m x block_n, warps, stages)")
    p.add_argument("--before", type=Path, help="an earlier report's JSON: adds a before/after table")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--out-name", default="kernels-sm90-compile",
                   help="file name of the report without suffix (.json and .md are written)")
    p.add_argument("--versus-tune", type=Path, help="a tune JSON: compile every prefill tile it timed and "
                   "set the model beside the measurement (kernel_versus.py)")
    p.add_argument("--extra", nargs="*", default=[], help="with --versus-tune: tiles to predict unmeasured")
    p.add_argument("--sass", nargs="*", choices=sorted(CONFIGS),
                   help="read the SASS (loops, the cycle model) of these configs only (default: all)")
    opts = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported; see the module docstring
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    mods, rows = load_compiled_modules(), []
    if opts.versus_tune:
        import kernel_versus

        start = time.perf_counter()
        result = kernel_versus.versus(
            json.loads(opts.versus_tune.read_text()), opts.versus_tune.name,
            lambda tiles: compile_config("prefill-spec", mods, parse_tiles(tiles)), opts.extra,
            triton.__version__,
            lambda msg: print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True))
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        (opts.out_dir / f"{opts.out_name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (opts.out_dir / f"{opts.out_name}.md").write_text(md := kernel_versus.markdown(result))
        print(md)
        return 0
    tiles = parse_tiles(opts.tiles) if opts.tiles else None
    for name in opts.only or CONFIGS:
        rows.append(r := compile_config(name, mods, tiles, sass=opts.sass is None or name in opts.sass))
        print(f"{name}: " + (f"ok regs={r['n_regs']} spills={r['n_spills']} smem={r['shared']}"
                             if r["ok"] else r["error"][:300]), file=sys.stderr)
        if w := r.get("shape_ceiling"):
            print(f"{name}: whole shape {w['phase2']} cached-prefix + {w['phase3']} diagonal key tiles, "
                  f"{100 * w['peak_fraction']:.1f}% of peak (serial model)", file=sys.stderr)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    ptxas = get_ptxas(90)
    result = {"target": "sm_90", "triton": triton.__version__, "tiles": opts.tiles,
              "ptxas": f"{Path(ptxas.path).name} {ptxas.version}",
              "configs": rows}
    (opts.out_dir / f"{opts.out_name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md_path = opts.out_dir / f"{opts.out_name}.md"
    old = md_path.read_text() if md_path.exists() else ""
    before = None
    if opts.before:
        before = dict(json.loads(opts.before.read_text()), source=opts.before.name)
    md_path.write_text(md := markdown(result, old[old.find("## Reading"):] if "## Reading" in old else "",
                                      before))
    print(md)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
