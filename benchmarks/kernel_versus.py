"""The static model against a GPU tune: every prefill tile the tune timed, compiled here for
sm_90 with the installed triton and read by the serial model, with and without memory.
Helper of ``compile_kernels.py`` (which compiles; this module imports no benchmark):

    PYTHONPATH=<triton of the tune>:src python benchmarks/compile_kernels.py \\
        --versus-tune benchmarks/results/tune-nvidia-h100-80gb-hbm3-run3.json \\
        --out-name static-vs-tune-run3 [--extra 128x64w8s5 ...]

For each timed row of the tune's ``prefill`` shape: the whole shape's share of peak under
the serial model (``kernel_static.shape_ceiling``: each key loop weighted by its trips),
before (memory left out) and after (cp.async round trips, the L2 port, spills read back:
``kernel_timing``), the model's TFLOP/s at the H100's 989.4 peak, and the measured
TFLOP/s. The ranks of model and measurement are compared by Spearman's rho (ties in the
model broken by order). ``--extra`` tiles (``256x128w8s3``, a trailing ``a``: QK ahead)
are compiled and predicted without a measurement. Needs the tune's triton on the path
(the model reads the SASS that triton emits); a CPU is enough.
"""

from __future__ import annotations

from kernel_static import PEAK_TFLOPS


def tile_text(row: dict) -> str:
    """``256x128w8s3`` (a trailing ``a``: QK ahead) of a tune row."""
    return "{block_m}x{block_n}w{num_warps}s{num_stages}".format(**row) + ("a" if row["qk_ahead"] else "")


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equal-length lists (ties ranked by position)."""
    def ranks(v: list[float]) -> list[int]:
        out = [0] * len(v)
        for r, i in enumerate(sorted(range(len(v)), key=v.__getitem__)):
            out[i] = r
        return out
    a, b, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / (n * (n * n - 1))


def model_row(compile_spec, tiles: str) -> dict:
    """The model's figures for the whole SPEC prefill compiled with ``tiles``;
    ``compile_spec(tiles)``: ``compile_kernels.compile_config``'s row for it."""
    from kernel_problems import SPEC_PREFILL
    from kernel_static import causal_trips, shape_ceiling

    row = compile_spec(tiles)
    out = {"tiles": tiles, "ok": row["ok"]}
    if not row["ok"]:
        return dict(out, error=row["error"][:300])
    loops, c = row["sass"]["loops"], row["constexprs"]
    trips = causal_trips(prefix=SPEC_PREFILL["prefix"], q_len=SPEC_PREFILL["q_len"], group_p2=c["GROUP_P2"],
                         block_m=c["BLOCK_M"], block_n=c["BLOCK_N"])
    before = {k: {"serial": {"peak_fraction": v["serial"]["peak_fraction_without_memory"]}}
              for k, v in loops.items()}
    return dict(out, n_regs=row["n_regs"], n_spills=row["n_spills"], shared=row["shared"],
                blocks_per_sm=row["blocks_per_sm"], kv_ring=row["sass"]["kv_ring"],
                before=round(shape_ceiling(before, trips), 4), after=round(shape_ceiling(loops, trips), 4),
                bound=loops["phase2"]["serial"]["bound"], l2_bytes=loops["phase2"]["serial"]["l2_bytes"],
                phase2_period=loops["phase2"]["serial"]["period"])


def versus(tune: dict, tune_name: str, compile_spec, extra: list[str], triton_version: str, log) -> dict:
    """Every timed prefill row of ``tune`` and the ``extra`` tiles through :func:`model_row`."""
    import kernel_timing

    shape = next(s for s in tune["shapes"] if s["name"] == "prefill")
    measured = {tile_text(r): r["tflops"] for r in shape["rows"] if r.get("ok") and "tflops" in r}
    rows = []
    for tiles in list(measured) + [t for t in extra if t not in measured]:
        rows.append(dict(model_row(compile_spec, tiles), measured=measured.get(tiles)))
        log(f"{rows[-1]}")
    timed = [r for r in rows if r.get("ok") and r["measured"]]
    meas = [r["measured"] for r in timed]
    return {"tune": tune_name, "tune_triton": tune["triton"], "triton": triton_version,
            "l2_bytes_per_clock": kernel_timing.L2_BYTES_PER_CLOCK, "l2_latency": kernel_timing.L2_LATENCY,
            "timed": len(timed), "spearman_before": round(spearman(meas, [r["before"] for r in timed]), 3),
            "spearman_after": round(spearman(meas, [r["after"] for r in timed]), 3), "rows": rows}


def markdown(result: dict) -> str:
    rows = [r for r in result["rows"] if r.get("ok")]
    lines = [f"# The static model against the H100 tune ({result['tune']})", "",
             f"Tiles compiled for sm_90 with triton {result['triton']} (the tune ran "
             f"{result['tune_triton']}) by `benchmarks/compile_kernels.py --versus-tune`; whole SPEC shape "
             "under the serial model, each key loop weighted by its trips. *Before*: memory left out "
             "(the model until run 3); *after*: the "
             "cp.async round trips, the L2 port and spills read back (`kernel_timing.py`, L2 "
             f"{result['l2_bytes_per_clock']} B/clk a SM, latency {result['l2_latency']:.0f} clocks). Model "
             f"TFLOP/s: share x {PEAK_TFLOPS:.1f}.", "",
             f"**Spearman's rho, model vs measured, over {result['timed']} timed tiles: before "
             f"{result['spearman_before']:.3f}, after {result['spearman_after']:.3f}.**", "",
             "| tile | measured TFLOP/s | model before | model after | after, TFLOP/s | after / measured | "
             "phase 2 bound | K/V ring | regs / spills (B) | smem (B) | CTAs/SM |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -(r.get("measured") or 0)):
        meas = r.get("measured")
        model = r["after"] * PEAK_TFLOPS
        lines.append(f"| {r['tiles']} | {meas:.1f} | " if meas else f"| {r['tiles']} | - | ")
        lines[-1] += (f"{100 * r['before']:.1f}% | {100 * r['after']:.1f}% | {model:.1f} | "
                      + (f"{model / meas:.2f} | " if meas else "- | ")
                      + f"{r['bound']} | {r['kv_ring']} | {r['n_regs']} / {r['n_spills']} | {r['shared']} | "
                      f"{r['blocks_per_sm']} |")
    failed = [r for r in result["rows"] if not r.get("ok")]
    lines += [""] + [f"- {r['tiles']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"
