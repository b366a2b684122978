"""The host work of one cascade_attention call: torch ops, kernel launches and the Python's
time, with the Triton kernels stubbed (no GPU needed; counts, and a CPU timing).

    python benchmarks/cascade_host.py [--calls 300] [--rounds 5]

An eager call's time on a GPU is at least its host work: each torch op and each launch
costs the host a few microseconds whether the GPU is busy or not (the H100 run 7: an eager
decode step of 64 requests took 0.614 ms, 0.176 ms replayed in a CUDA graph; the plain
call 0.206). Here every launch of the attention, split-merge and cascade-merge kernels is
recorded instead of run, and each aten op is counted (TorchDispatchMode), on the
batches and shape of ``time_cascade.py`` (32 query / 8 KV heads, head_dim 128, fp16 CPU
tensors of zeros, one group of every request), with the GPU's tiles and split choice
(``tiling.gpu_tiles`` patched; the SM count is the H100's off CUDA already). The time is
the host path on one CPU thread, the plain call beside cascade's, alternated
``--rounds`` times in one process (median of the rounds of ``--calls`` calls each); it
includes the CPU work of the torch ops, which for copies of q's rows (the old path's
index_select, stack, float) is memory traffic a GPU does in a kernel. The build of the
CascadeBatch (once per step, on the host) is timed too. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors on the Triton path (launches are stubbed)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

CASES = [dict(name="decode", batch=64, shared=4096, own=512, q_len=1),
         dict(name="decode, long prefix", batch=64, shared=16384, own=256, q_len=1),
         dict(name="chunked prefill", batch=16, shared=4096, own=1024, q_len=256)]
BS = 16


class Ops(TorchDispatchMode):
    """Counts the aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def stub_kernels(launches: collections.Counter) -> None:
    """Record each launch of the kernels a cascade call makes instead of running it."""
    from prefixkv.kernels import attention, split_kv, tiling

    tiling.gpu_tiles = lambda device: True  # the H100's tiles and split choice on CPU tensors

    class Stub:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.update([self.name])

    attention._paged_prefill_kernel = Stub("attention")
    split_kv._combine_splits_kernel = Stub("split merge")
    try:
        from prefixkv.kernels import cascade_merge
    except ImportError:  # a tree from before the in-place merge
        return
    cascade_merge._merge_rows_kernel = Stub("cascade merge")


def case_calls(kernels, case: dict) -> dict:
    """The plain call, the cascade call and the build of its batch, as closures."""
    from prefixkv import SharedPrefix

    batch, q_len = case["batch"], case["q_len"]
    shared_blocks, own_blocks = case["shared"] // BS, -(-(case["own"] + q_len) // BS)
    ids = [list(range(shared_blocks)) + [shared_blocks + r * own_blocks + j for j in range(own_blocks)]
           for r in range(batch)]
    computed, new = [case["shared"] + case["own"]] * batch, [q_len] * batch
    cache = torch.zeros(shared_blocks + batch * own_blocks, BS, 8, 128, dtype=torch.float16)
    q = torch.zeros(batch * q_len, 32, 128, dtype=torch.float16)
    step = kernels.build_paged_batch(ids, computed, new, BS)
    args = (q, cache, cache, step.block_table, step.cu_seqlens_q, step.seqused_k, step.max_seqlen_q,
            step.max_seqlen_k)
    groups = [SharedPrefix(shared_blocks, tuple(range(batch)))]
    cascade = kernels.build_cascade_batch(groups, ids, computed, new, BS)
    out = torch.empty_like(q)
    return {"plain": lambda: kernels.paged_prefill_attention(*args, out=out, backend="triton"),
            "cascade": lambda: kernels.cascade_attention(*args, cascade, out=out, backend="triton"),
            "build": lambda: kernels.build_cascade_batch(groups, ids, computed, new, BS)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="calls per round (the build: a tenth)")
    p.add_argument("--rounds", type=int, default=5)
    opts = p.parse_args(argv)
    import prefixkv.kernels as kernels

    torch.set_num_threads(1)  # the host path, not a thread pool's spin-up on a shared machine
    launches: collections.Counter = collections.Counter()
    stub_kernels(launches)
    print("| case | call | torch ops | launches | host us per call (median of rounds) |")
    print("|---|---|---|---|---|")
    for case in CASES:
        calls = case_calls(kernels, case)
        times: dict[str, list[float]] = {name: [] for name in calls}
        counted = {}
        for name, fn in calls.items():
            fn()  # first call: one-time allocations (unit scales)
            launches.clear()
            with Ops() as ops:
                fn()
            counted[name] = (sum(ops.ops.values()), sum(launches.values()),
                             ", ".join(f"{k} {v}" for k, v in sorted(ops.ops.items())),
                             ", ".join(f"{k} {v}" for k, v in sorted(launches.items())))
        for _ in range(opts.rounds):  # alternated: the machine's load falls on all alike
            for name, fn in calls.items():
                n = max(1, opts.calls // 10) if name == "build" else opts.calls
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                times[name].append((time.perf_counter() - t) / n * 1e6)
        for name in calls:
            n_ops, n_launch, ops_s, launch_s = counted[name]
            print(f"| {case['name']} | {name} | {n_ops} ({ops_s or '-'}) | {n_launch} ({launch_s or '-'}) | "
                  f"{statistics.median(times[name]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
