"""Problems and timers shared by the kernel benchmarks (bench, tune, compile, fp8 capacity).

Imports no other benchmark. The shapes are plain dicts of ints and a dtype name, so the
compile script can use them without a device:

* ``SPEC_PREFILL``: the kernel goal's shape, 8 requests x (8192 cached + 2048 new), 32 query / 8 KV
  heads, head_dim 128, bf16, block_size 16 (2.47 TFLOP per call);
* ``SPEC_DECODE``: 64 requests x 8k context, q_len 1;
* ``SPLIT_DECODE``: 1 request x 32k context, q_len 1 (the split-KV case).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SPEC_PREFILL = dict(batch=8, prefix=8192, q_len=2048, heads=32, kv_heads=8, head_dim=128, block_size=16,
                    dtype="bfloat16")
SPEC_DECODE = dict(SPEC_PREFILL, batch=64, prefix=8191, q_len=1)
SPLIT_DECODE = dict(SPEC_PREFILL, batch=1, prefix=32767, q_len=1)
SMOKE = dict(heads=4, kv_heads=2, head_dim=64, block_size=16, dtype="float16")  # interpreter-sized


def with_device(shape: dict, device: str, torch) -> dict:
    """``shape`` with its dtype name turned into a torch dtype and a ``device``: the
    keywords of :func:`make_problem`."""
    return dict(shape, dtype=getattr(torch, shape["dtype"]) if isinstance(shape["dtype"], str)
                else shape["dtype"],
                device=device)


def attended_pairs(q_len: int, kv_len: int) -> int:
    """(query, key) pairs of one request under bottom-right causal masking."""
    prefix = kv_len - q_len
    return q_len * prefix + q_len * (q_len + 1) // 2


def prefill_flops(cfg: dict) -> int:
    """FLOPs of one call on a ``make_problem`` shape: ``4 * head_dim`` per attended pair and head."""
    pairs = attended_pairs(cfg["q_len"], cfg["prefix"] + cfg["q_len"])
    return 4 * cfg["heads"] * cfg["head_dim"] * cfg["batch"] * pairs


def git_commit() -> str:
    """$PREFIXKV_COMMIT when set (a copy whose .git is missing or stale: the device tool's
    copy kept the .git of the session's first call), else HEAD (with -dirty when the kernels
    changed), else "unknown"."""
    if os.environ.get("PREFIXKV_COMMIT"):
        return os.environ["PREFIXKV_COMMIT"]
    fallback = "unknown"
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src/prefixkv/kernels"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "") if rev else fallback
    except OSError:
        return fallback


def make_problem(torch, kernels, *, batch, prefix, q_len, heads, kv_heads, head_dim, block_size, dtype,
                 device):
    """Random paged problem: every request has ``prefix`` cached + ``q_len`` new tokens.
    Returns (the positional arguments of ``paged_prefill_attention``, block ids per request)."""
    kv_len = prefix + q_len
    n_blk = -(-kv_len // block_size)
    perm = torch.randperm(batch * n_blk).tolist()  # scattered blocks, as after real churn
    ids = [perm[i * n_blk:(i + 1) * n_blk] for i in range(batch)]
    shape = (batch * n_blk, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    step = kernels.build_paged_batch(ids, [prefix] * batch, [q_len] * batch, block_size, device=device)
    q = torch.randn(batch * q_len, heads, head_dim, dtype=dtype, device=device)
    args = (q, k_cache, v_cache, step.block_table, step.cu_seqlens_q, step.seqused_k,
            step.max_seqlen_q, step.max_seqlen_k)
    return args, ids


class Timer:
    """Median milliseconds of a call: CUDA events via triton's do_bench, or wall clock."""

    def __init__(self, cuda: bool, warmup: int = 25, rep: int = 100):
        self.cuda, self.warmup, self.rep = cuda, warmup, rep  # do_bench's milliseconds

    def __call__(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median"))
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def open_session(script: str, smoke: bool):
    """Imports for a kernel benchmark run: ``(torch, prefixkv.kernels, cuda, meta, slug)``,
    or None (after saying why on stderr) without CUDA unless ``smoke``. On a CPU it turns
    the Triton interpreter on before the kernels are imported. ``meta``: device, commit,
    torch and triton versions; ``slug``: the device name for result file names."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        print(f"{script}: needs a CUDA GPU (none found). Use --smoke for a tiny CPU run through the "
              "Triton interpreter that only checks the script works.", file=sys.stderr)
        return None
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before prefixkv.kernels pulls in any @triton.jit
    sys.path.insert(0, str(ROOT / "src"))
    import triton

    import prefixkv.kernels as kernels

    name = torch.cuda.get_device_name() if cuda else f"cpu-interpreter ({platform.machine()})"
    slug = "smoke" if smoke else "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    meta = {"device": name, "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__}
    return torch, kernels, cuda, meta, slug
