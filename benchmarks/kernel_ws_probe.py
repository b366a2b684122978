"""Does Triton's warp specialisation work on Hopper for an attention loop? (issue 27, item 2)

Compiles, ahead of time for sm_90a on a machine without a GPU, the plainest
FlashAttention forward loop (QK^T, online softmax, PV over 64-key tiles of a 128-row
tile, head_dim 128, bf16) with ``tl.range(..., warp_specialize=...)`` off and on, its K/V
read three ways (pointer loads, a device-side ``tl.make_tensor_descriptor``, a host-side
``TensorDescriptor``: TMA), on 4 and 8 warps, and reports per compile whether it built,
how many ``ttg.warp_specialize`` regions the TTGIR holds (the producer/consumer split the
Hopper pass makes) and ``ptxas`` registers and spills. A loop that Triton cannot split
here cannot be split in the paged kernel either (its K/V are gathers through the block
table, and its loops sit inside a request search that the pass also refuses; see
``benchmarks/results/kernels-sm90-warp-specialize-probe.md``).

Run once per triton version (``PYTHONPATH=<pip --target dir of that triton>``)::

    python benchmarks/kernel_ws_probe.py [--out benchmarks/results/ws-probe-<version>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kernel_static import compile_launch, parse_ptxas


def _kernel():
    """The probe kernel (defined after ``TRITON_INTERPRET`` is cleared)."""
    import triton
    import triton.language as tl

    @triton.jit
    def attn(q_ptr, k, v, o_ptr, n_keys, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # type: ignore[no-untyped-def]
             D: tl.constexpr, WS: tl.constexpr, LOADS: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
        d = tl.arange(0, D)
        q = tl.load(q_ptr + m[:, None] * D + d[None, :])  # [BLOCK_M, D]
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        if LOADS == "device-tma":
            k = tl.make_tensor_descriptor(k, [n_keys, D], [D, 1], [BLOCK_N, D])
            v = tl.make_tensor_descriptor(v, [n_keys, D], [D, 1], [BLOCK_N, D])
        for start in tl.range(0, n_keys, BLOCK_N, warp_specialize=WS):
            if LOADS == "pointer":
                n = start + tl.arange(0, BLOCK_N)
                kt = tl.load(k + n[:, None] * D + d[None, :])  # [BLOCK_N, D]
                vt = tl.load(v + n[:, None] * D + d[None, :])
            else:
                kt = k.load([start, 0])
                vt = v.load([start, 0])
            s = tl.dot(q, tl.trans(kt)) * qk_scale  # [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), vt, acc * alpha[:, None])
            m_i = m_new
        tl.store(o_ptr + m[:, None] * D + d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))

    return attn


def probe() -> list[dict]:
    """One row per (loads, warps, warp_specialize) compile."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    attn, rows = _kernel(), []
    meta = dict(device="meta", dtype=torch.bfloat16)
    for loads in ("pointer", "device-tma", "host-tma"):
        for warps in (4, 8):
            for ws in (False, True):
                kv = [torch.empty(4096, 128, **meta) for _ in range(2)]
                if loads == "host-tma":
                    kv = [TensorDescriptor.from_tensor(t, [64, 128]) for t in kv]
                args = (torch.empty(256, 128, **meta), *kv, torch.empty(256, 128, **meta), 4096, 0.1)
                kwargs = dict(BLOCK_M=128, BLOCK_N=64, D=128, WS=ws, LOADS=loads, num_warps=warps,
                              num_stages=3)
                row: dict = dict(loads=loads, num_warps=warps, warp_specialize=ws)
                try:
                    kernel, log = compile_launch(attn, args, kwargs)
                    row.update(ok=True, ws_regions=kernel.asm["ttgir"].count("ttg.warp_specialize"),
                               **{k: v for k, v in parse_ptxas(log).items() if k in ("n_regs", "n_spills")})
                except Exception as exc:  # noqa: BLE001  a failed compile is the finding
                    last = str(exc).strip().splitlines()[-1][:160]
                    row.update(ok=False, error=f"{type(exc).__name__}: {last}")
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    opts = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported (compile_kernels.py says why)
    import triton

    result = {"triton": triton.__version__, "target": "sm_90a", "rows": probe()}
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"triton {result['triton']}: " + ", ".join(
        f"{r['loads']} w{r['num_warps']} ws={int(r['warp_specialize'])}: "
        + (f"{r['ws_regions']} regions, {r['n_regs']} regs, {r['n_spills']} B spills" if r["ok"]
           else "FAILED")
        for r in result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
