"""FlashAttention-3's ping-pong schedule in Gluon, compiled for sm_90a (issue 27 item 2; a probe).

Not part of the library: a second prefill kernel (``gluon_pingpong_kernel.py``), written to
see whether the schedule that Triton's language cannot emit (two consumer warpgroups taking
turns on the tensor cores, a wgmma wait on one of two groups) can be stated in Gluon on
triton 3.6-3.9, and what the serial static model makes of its SASS
(``kernel_pingpong.py``: ``kernel_timing.py``'s rules, two warpgroups replayed side by
side). Gluon has no interpreter, so only a GPU can check its results
(``tests/kernels/test_gluon_pingpong.py``; ``--time`` here).

Compile and model (no GPU; one triton version a run, ``PYTHONPATH=<that triton>`` for
another); check and time on a GPU::

    python benchmarks/gluon_pingpong.py [--layout dense|paged|both] [--block-n 32] [--stages 4] [--out F.json]
    python benchmarks/gluon_pingpong.py --time [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gluon_pingpong_kernel import BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, WG_ROWS, attn_pingpong, launch_args
from kernel_problems import SPEC_PREFILL


def compile_pingpong(layout: str, *, block_n: int = BLOCK_N, stages: int = STAGES, page: int = 16):
    """AOT-compile the kernel for sm_90a on meta tensors (no GPU): ``(CompiledKernel, ptxas log)``."""
    import torch

    from kernel_static import compile_launch

    meta = dict(device="meta", dtype=torch.bfloat16)
    n_keys, kv_heads, group = 4096, 8, 4
    q = torch.empty(BLOCK_M // group * 8, kv_heads * group, HEAD_DIM, **meta)
    if layout == "dense":
        k = torch.empty(kv_heads * n_keys, HEAD_DIM, **meta)
    else:
        k = torch.empty(n_keys // page, page, kv_heads, HEAD_DIM, **meta)
    table = torch.empty(n_keys // page, dtype=torch.int32, device="meta")
    _, args, kwargs = launch_args(q, k, k, torch.empty_like(q), table, kv_heads=kv_heads, batch=1,
                                  n_keys=n_keys, sm_scale=0.088, page=page if layout == "paged" else None,
                                  block_n=block_n, stages=stages)
    return compile_launch(attn_pingpong, args, kwargs)


def dense_kv(cache, block_table, kv_heads: int):
    """A paged cache ``[num_blocks, page, kv_heads, D]`` read through ``block_table``
    ``[batch, pages]`` as the dense ``[batch * kv_heads * keys, D]`` rows of the kernel."""
    batch, pages = block_table.shape
    kv = cache[block_table.long()]  # [batch, pages, page, kv_heads, D]
    return kv.permute(0, 3, 1, 2, 4).reshape(batch * kv_heads * pages * cache.shape[1], cache.shape[-1])


def reference(q, k, v, *, kv_heads: int, batch: int, n_keys: int, sm_scale: float, causal: bool = False,
              requests: list[int] | None = None):
    """The kernel's output for ``requests`` (all: None), ``[len(requests) * q_len, heads,
    D]``, in fp32: every query attends all ``n_keys`` keys of its request and KV head, or
    with ``causal`` the keys up to its position (the q_len tokens are the last ``n_keys``).
    ``q``: ``[batch * q_len, heads, D]``; ``k``/``v``: ``[batch * kv_heads * n_keys, D]``."""
    import torch

    picked = list(range(batch)) if requests is None else requests
    tokens, heads, dim = q.shape
    q_len, group = tokens // batch, heads // kv_heads
    qf = q.float().view(batch, q_len, kv_heads, group, dim)[picked]  # [r, pos, kv head, group, D]
    kf, vf = (t.float().view(batch, kv_heads, n_keys, dim)[picked] for t in (k, v))
    s = torch.einsum("rpkgd,rknd->rkgpn", qf, kf) * sm_scale
    if causal:
        pos = n_keys - q_len + torch.arange(q_len, device=s.device)
        s = s.masked_fill(torch.arange(n_keys, device=s.device) > pos[:, None], float("-inf"))
    out = torch.einsum("rkgpn,rknd->rpkgd", s.softmax(-1), vf)
    return out.reshape(len(picked) * q_len, heads, dim)


def problem(torch, *, batch: int, kv_heads: int, n_keys: int, q_len: int, page: int | None, group: int = 4,
            seed: int = 0):
    """Random bf16 Q ``[batch * q_len, kv_heads * group, D]``, K/V (dense, or paged with
    shuffled block ids) and the block table, on CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch * q_len, kv_heads * group, HEAD_DIM, generator=gen, **bf)
    if page is None:
        kv = [torch.randn(batch * kv_heads * n_keys, HEAD_DIM, generator=gen, **bf) for _ in range(2)]
        table = torch.zeros(batch, 1, dtype=torch.int32, device="cuda")
    else:
        blocks = batch * n_keys // page
        kv = [torch.randn(blocks, page, kv_heads, HEAD_DIM, generator=gen, **bf) for _ in range(2)]
        table = torch.randperm(blocks, generator=gen, device="cuda").to(torch.int32).view(batch, -1)
    return q, kv[0], kv[1], table


def time_goal_shape(tolerance: float = 2e-2) -> list[dict]:
    """On a GPU: the SPEC goal shape (8 requests x (8192 cached + 2048 new), 32 query / 8
    KV heads, causal: 2.47 TFLOP a call), K/V dense and paged (block size 16): the error
    against the fp32 reference on the first and the last request, and TFLOP/s
    of the attended pairs (as ``bench_kernels.py`` counts them) by
    ``triton.testing.do_bench`` of the launch alone; ``ok`` False past ``tolerance``."""
    import torch
    import triton

    spec = SPEC_PREFILL
    prefix, q_len, group = spec["prefix"], spec["q_len"], spec["heads"] // spec["kv_heads"]
    shape = dict(batch=spec["batch"], kv_heads=spec["kv_heads"], n_keys=prefix + q_len)
    sm_scale, out, ends = HEAD_DIM ** -0.5, [], [0, shape["batch"] - 1]
    pairs = q_len * prefix + q_len * (q_len + 1) // 2  # a (request, query head)
    flops = 4 * HEAD_DIM * pairs * group * shape["kv_heads"] * shape["batch"]
    for page in (None, spec["block_size"]):
        q, k, v, table = problem(torch, q_len=q_len, group=group, page=page, **shape)
        dense = (k, v) if page is None else tuple(dense_kv(t, table, shape["kv_heads"]) for t in (k, v))
        o = q.new_empty(q.shape)
        grid, args, kwargs = launch_args(q, k, v, o, table, **shape, sm_scale=sm_scale, page=page,
                                         causal=True)
        attn_pingpong[grid](*args, **kwargs)
        want = reference(q, *dense, **shape, sm_scale=sm_scale, causal=True, requests=ends)
        got = o.view(shape["batch"], q_len, *o.shape[1:])[ends].reshape(want.shape)
        err = float((got.float() - want).abs().max())
        ms = triton.testing.do_bench(lambda: attn_pingpong[grid](*args, **kwargs))  # noqa: B023
        out.append(dict(layout="dense" if page is None else f"paged {page}", max_abs_err=err,
                        ok=err <= tolerance, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1)))
        print(json.dumps(out[-1]), flush=True)
    return out


def model_report(sass: str, *, block_n: int, stages: int) -> dict:
    """The serial model on the SASS: per phase (``phase2``: the unmasked loops, ``phase3``:
    the masked diagonal's, in source order), the two consumer warpgroups' loops replayed
    side by side (``kernel_pingpong``), and the goal shape's whole ceiling (each phase
    weighted by its key tiles, ``kernel_static.causal_trips``)."""
    from kernel_pingpong import innermost, pingpong_clocks, producer_loop
    from kernel_static import causal_trips, loops
    from kernel_timing import decode, tile_clocks

    bodies = sorted(innermost(loops(sass)), key=lambda b: b[0].addr)
    if len(bodies) != 4:
        raise RuntimeError(f"expected two loops (unmasked, masked) a consumer, found {len(bodies)}")
    pairs = {"phase2": [bodies[0], bodies[2]], "phase3": [bodies[1], bodies[3]]}
    producer = producer_loop(sass)
    shape = dict(rows=WG_ROWS, block_n=block_n, dim=HEAD_DIM, stages=stages,
                 tile_bytes=2 * block_n * HEAD_DIM * 2, producer=producer)
    out: dict = {"loops": {k: [len(b) for b in v] for k, v in pairs.items()},
                 "producer_instructions": len(producer),
                 # the wgmma waits of each loop (N of WARPGROUP.DEPBAR.LE gsb0, N)
                 "group_waits": {k: [[op.max_groups for op in map(decode, (i.text for i in b))
                                      if op.kind == "group_wait"] for b in v] for k, v in pairs.items()},
                 "model": {k: pingpong_clocks(v, **shape) for k, v in pairs.items()}}
    # the unmasked loops with every instruction holding the schedulers longer (the model has
    # no ALU latencies), and one of them under kernel_timing's one-loop model: alone (its own
    # overlap only), and as that model credits two independent CTAs filling each other's waits
    out["issue_scale"] = {x: pingpong_clocks(pairs["phase2"], **shape, issue_scale=x)["peak_fraction"]
                          for x in (1.05, 1.1, 1.2)}
    # ... and with the results' latencies (kernel_pingpong.LATENCY, assumed)
    out["with_latency"] = {k: pingpong_clocks(v, **shape, latency=True) for k, v in pairs.items()}
    one = dict(block_m=WG_ROWS, block_n=block_n, dim=HEAD_DIM, num_warps=4, mma="wgmma")
    out["one_warpgroup"] = {c: tile_clocks(bodies[0], **one, ctas_per_sm=c)["peak_fraction"] for c in (1, 2)}
    spec = SPEC_PREFILL
    trips = causal_trips(prefix=spec["prefix"], q_len=spec["q_len"], block_m=BLOCK_M, block_n=block_n,
                         group_p2=spec["heads"] // spec["kv_heads"])

    def whole(runs: dict, key: str = "peak_fraction") -> float:
        return round(sum(trips[k] for k in pairs) / sum(trips[k] / runs[k][key] for k in pairs), 4)

    out["whole_shape"] = dict(trips, peak_fraction=whole(out["model"]),
                              with_smem=whole(out["model"], "peak_fraction_with_smem"),
                              with_latency=whole(out["with_latency"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=("dense", "paged", "both"), default="both")
    p.add_argument("--stages", type=int, default=STAGES)
    p.add_argument("--block-n", type=int, default=BLOCK_N)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--time", action="store_true", help="on a GPU: check and time the goal shape instead")
    p.add_argument("--dump", type=Path, help="write each compile's ttgir/ptx/sass here")
    opts = p.parse_args(argv)
    import triton

    if opts.time:
        rows = time_goal_shape()
        if opts.out:
            opts.out.write_text(json.dumps(rows, indent=2) + "\n")
        return 0 if all(r["ok"] for r in rows) else 1
    from kernel_static import disassemble, parse_ptxas

    rows = []
    for layout in ("dense", "paged") if opts.layout == "both" else (opts.layout,):
        kernel, log = compile_pingpong(layout, block_n=opts.block_n, stages=opts.stages)
        res = parse_ptxas(log)
        sass = disassemble(kernel.asm["cubin"])
        res.update(model_report(sass, block_n=opts.block_n, stages=opts.stages))
        rows.append(dict(triton=triton.__version__, layout=layout, block_n=opts.block_n, stages=opts.stages,
                         shared=kernel.metadata.shared, **res))
        print(json.dumps(rows[-1]))
        if opts.dump:
            opts.dump.mkdir(parents=True, exist_ok=True)
            stem = opts.dump / f"{layout}-n{opts.block_n}-s{opts.stages}-{triton.__version__}"
            for ext in ("ttgir", "ptx"):
                Path(f"{stem}.{ext}").write_text(kernel.asm[ext])
            Path(f"{stem}.sass").write_text(sass)
            Path(f"{stem}.ptxas.log").write_text(log)
    if opts.out:
        opts.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
