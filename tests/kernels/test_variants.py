"""warmup(): after it, no batch size or length compiles a new kernel variant.

Triton's JIT caches a compiled kernel under the specialisation its binder computes from a
launch's arguments (constexpr values, ints equal to 1 or divisible by 16, pointer
alignment) and its options (warps, stages). The test runs, in a child process without
the interpreter, ``warmup`` and then a sweep of batch sizes and lengths on ``meta``
tensors, with each ``@triton.jit`` kernel replaced by a recorder that asks that same
binder for the key it would compile under (for sm_90, no device needed). Every key of the
sweep must be one of warmup's. ``meta`` tensors have no values, so the same run also
shows that a launch reads nothing from the device (no host synchronisation).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from prefixkv.kernels import AttentionSpec, attention_variants, warmup

from .conftest import PRIMARY_DEVICE

ROOT = Path(__file__).resolve().parents[2]

# The child's start: each kernel's launch records the compile key its binder gives.
RECORDER = textwrap.dedent("""
    import json, sys
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    from prefixkv.kernels import attention, cascade_merge, split_kv, tiling, write_kv
    from prefixkv.kernels import AttentionSpec, alloc_split_workspace, warmup

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys = []

    class Recorder:
        def __init__(self, fn):
            self.fn, self.binder = fn, create_function_from_signature(fn.signature, fn.params, backend)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                _, specialization, options = self.binder(*args, **dict(kwargs, debug=False))
                keys.append(repr((self.fn.__name__, specialization, options)))
            return launch

    for mod, name in ((attention, "_paged_prefill_kernel"), (split_kv, "_combine_splits_kernel"),
                      (write_kv, "_write_kv_kernel"), (cascade_merge, "_merge_rows_kernel")):
        setattr(mod, name, Recorder(getattr(mod, name)))
    tiling.gpu_tiles = lambda device: True  # meta tensors take the GPU's tiles and split rule
""")

CHILD = RECORDER + textwrap.dedent("""
    report = {}
    for label, extra in (("bf16", {}), ("fp8-sinks-window", dict(
            cache_dtype=torch.float8_e4m3fn, kv_scales="head", sinks=True, windows=(None, (4095, 0))))):
        spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                             max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768, **extra)
        keys.clear()
        launches = warmup(spec, "meta")
        warm = set(keys)
        keys.clear()
        meta = dict(device="meta")
        cache_dtype = spec.cache_dtype or spec.dtype
        scales = ({} if spec.kv_scales is None
                  else dict(k_scale=torch.empty(8, **meta), v_scale=torch.empty(8, **meta)))
        sinks = torch.empty(32, **meta) if spec.sinks else None
        calls = 0
        for batch in (1, 2, 3, 7, 16, 17, 64, 100, 255, 256):
            for q_len in (1, 2, 3, 5, 16, 17, 100, 1000, 8192):
                if batch * q_len > spec.max_num_batched_tokens:
                    continue
                for prefix in (0, 1, 511, 4000, 32767 - q_len):
                    kv_len = prefix + q_len
                    if kv_len > spec.max_model_len or prefix < 0:
                        continue
                    width = -(-kv_len // 16) + batch % 3  # the block table's width varies too
                    cache = torch.empty(batch * width, 16, 8, 128, dtype=cache_dtype, **meta)
                    q = torch.empty(batch * q_len, 32, 128, dtype=spec.dtype, **meta)
                    for window in spec.windows:
                        attention.paged_prefill_attention_triton(
                            q, cache, cache, torch.empty(batch, width, dtype=torch.int32, **meta),
                            torch.empty(batch + 1, dtype=torch.int32, **meta),
                            torch.empty(batch, dtype=torch.int32, **meta), q_len, kv_len,
                            window_size=window, sinks=sinks, **scales)
                        calls += 1
                    key = torch.empty(batch * q_len, 8, 128, dtype=spec.dtype, **meta)
                    slots = torch.empty(batch * q_len, dtype=torch.int64, **meta)
                    write_kv.write_kv_cache_triton(key, key, cache, cache, slots, **scales)
        report[label] = dict(launches=launches, warm=len(warm), calls=calls, sweep=len(set(keys)),
                             missing=sorted(set(keys) - warm)[:3])
    json.dump(report, sys.stdout)
""")


def _compiler_skip() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from triton.backends import backends

    return None if "nvidia" in backends else "this triton build has no NVIDIA backend"


def _run_child(code: str, *args: str) -> dict:
    """Run ``code`` (with ``args`` in its ``sys.argv``) in a child without the interpreter;
    its stdout is one JSON object."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                         timeout=900)  # a hang's bound: a busy 2-core CI machine is slow
    assert run.returncode == 0, run.stderr[-3000:]
    report: dict = json.loads(run.stdout)
    return report


@pytest.mark.skipif(_compiler_skip() is not None, reason=str(_compiler_skip()))
def test_after_warmup_no_batch_size_or_length_compiles():
    report = _run_child(CHILD)
    for label, r in report.items():
        assert r["calls"] > 200 and r["sweep"] >= 2, (label, r)
        assert r["missing"] == [], f"{label}: variants compiled after warm-up: {r['missing']}"
        assert r["warm"] <= r["launches"] + 1, (label, r)  # one key per warm-up launch (+ the merge)


# The CUDA-graph launch mode (docs/kv_layout.md): one workspace passed to every step, so
# every launch, prefills included, runs with the split axis on.
WORKSPACE_CHILD = RECORDER + textwrap.dedent("""
    meta = dict(device="meta")
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                         max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768,
                         workspace_splits=int(sys.argv[1]))
    warmup(spec, "meta")
    warm = set(keys)
    keys.clear()
    ws = alloc_split_workspace(max(1, spec.workspace_splits), 256, 32, 128, "meta")
    for batch, q_len in ((1, 1), (64, 1), (4, 3), (4, 17), (8, 100), (2, 1000), (1, 8192)):
        kv_len = 4096 + q_len
        width = -(-kv_len // 16)
        cache = torch.empty(batch * width, 16, 8, 128, dtype=torch.bfloat16, **meta)
        attention.paged_prefill_attention_triton(
            torch.empty(batch * q_len, 32, 128, dtype=torch.bfloat16, **meta), cache, cache,
            torch.empty(batch, width, dtype=torch.int32, **meta),
            torch.empty(batch + 1, dtype=torch.int32, **meta), torch.empty(batch, dtype=torch.int32, **meta),
            q_len, kv_len, split_workspace=ws)
    json.dump(dict(calls=len(keys), missing=sorted(set(keys) - warm)), sys.stdout)
""")


@pytest.mark.skipif(_compiler_skip() is not None, reason=str(_compiler_skip()))
def test_after_warmup_launches_with_a_split_workspace_compile_nothing():
    """The audit of r8: with a split workspace every tile runs split (``SPLIT``, a constexpr),
    and warm-up compiled prefill tiles unsplit only: the first prefill of a server in the
    CUDA-graph mode compiled the 256 x 128 and 128-row tiles while serving. A spec now
    names the workspace's split count (a count over 64 also needs a wider merge tile)."""
    for splits in (16, 100):
        report = _run_child(WORKSPACE_CHILD, str(splits))
        assert report["calls"] >= 7 and report["missing"] == [], (splits, report["missing"][:1])


# cascade_attention: its own-part pass returns the LSE, its prefix pass is non-causal and
# splits on few tiles, and the two merge in a kernel of their own (cascade_merge).
CASCADE_CHILD = RECORDER + textwrap.dedent("""
    from prefixkv import SharedPrefix
    from prefixkv.kernels import build_cascade_batch, cascade, cascade_attention, dispatch
    cascade.resolve_backend = dispatch.resolve_backend = lambda backend, device: "triton"  # meta tensors
    meta = dict(device="meta")
    i32 = dict(dtype=torch.int32, **meta)
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                         max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768, sinks=True,
                         cascade=sys.argv[1] == "cascade")
    warmup(spec, "meta")
    warm = set(keys)
    keys.clear()
    for batch, q_len, shared in ((2, 1, 256), (64, 1, 4096), (200, 1, 16384), (8, 3, 1024), (4, 500, 4096)):
        kv_len = shared + 512 + q_len
        width = -(-kv_len // 16)
        cache = torch.empty(batch * width, 16, 8, 128, dtype=torch.bfloat16, **meta)
        own = width - shared // 16
        ids = [list(range(shared // 16)) + [shared // 16 + r * own + j for j in range(own)]
               for r in range(batch)]
        groups = build_cascade_batch([SharedPrefix(shared // 16, tuple(range(batch)))], ids,
                                     [kv_len - q_len] * batch, [q_len] * batch, 16, device="meta")
        for force in (False, True):  # the call's choice (the plain call for a long prefill), both passes
            cascade_attention(torch.empty(batch * q_len, 32, 128, dtype=torch.bfloat16, **meta), cache, cache,
                              torch.empty(batch, width, **i32), torch.empty(batch + 1, **i32),
                              torch.empty(batch, **i32), q_len, kv_len, groups, sinks=torch.empty(32, **meta),
                              force=force)
    json.dump(dict(calls=len(keys), missing=sorted(set(keys) - warm)), sys.stdout)
""")


@pytest.mark.skipif(_compiler_skip() is not None, reason=str(_compiler_skip()))
def test_after_warmup_cascade_attention_compiles_nothing():
    """The audit of r8: cascade's passes (LSE out; the prefix pass non-causal, without sinks,
    split on few tiles) compiled variants warm-up never launched, on the first cascade
    step of a server. ``AttentionSpec.cascade`` warms them."""
    before = _run_child(CASCADE_CHILD, "plain")
    assert before["missing"], "cascade needs variants of its own (else the spec flag is moot)"
    report = _run_child(CASCADE_CHILD, "cascade")
    assert report["calls"] >= 10 and report["missing"] == [], report["missing"][:1]


def test_variants_are_bounded_and_split_only_for_decode():
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                         max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32768)
    variants = attention_variants(spec, on_gpu=True)
    tiles = {(c.block_m, c.block_n) for _, c in variants}

    from prefixkv.kernels.tiling import PREFILL_TILE

    long = PREFILL_TILE  # the long-prefill tile of this triton
    want = {(16, 128), (32, 64), (64, 64), (long.block_m, long.block_n)}  # decode: 128 keys (H100 tune)
    if long.block_m > 128:
        want.add((128, 128))  # 128 rows below the 256-row tile
    assert tiles == want
    assert {c.block_m for _, c in variants if c.num_splits > 1} == {16, 32, 64}  # q_len <= 16 only
    short = dataclasses.replace(spec, max_model_len=300)  # too short to split
    assert all(c.num_splits == 1 for _, c in attention_variants(short, on_gpu=True))


@pytest.mark.usefixtures("needs_triton")
def test_warmup_launches_each_variant_here():
    """On the interpreter the launches really run (tiles of the CPU path), fp8 and sinks included."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16,
                         max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024,
                         cache_dtype=torch.float8_e5m2, kv_scales="tensor", sinks=True,
                         windows=(None, (31, 0)))
    assert warmup(spec, PRIMARY_DEVICE) == 1 + len(attention_variants(spec, on_gpu=PRIMARY_DEVICE == "cuda"))


@pytest.mark.usefixtures("needs_triton")
def test_warmup_launches_cascade_and_workspace_variants_here():
    """The variants of cascade's passes and of a split workspace really launch (interpreter
    tiles): each tile split 8 ways, and cascade's own-part and prefix passes on top."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16,
                         max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024, sinks=True,
                         workspace_splits=8)
    plain = attention_variants(spec, on_gpu=PRIMARY_DEVICE == "cuda")
    assert {c.num_splits for _, c in plain} == {1, 2, 8}
    assert all(any(c == dataclasses.replace(t, num_splits=8) for _, c in plain) for _, t in plain)
    launches = warmup(dataclasses.replace(spec, cascade=True), PRIMARY_DEVICE)
    assert launches > 1 + len(plain)


@pytest.mark.usefixtures("needs_triton")
def test_warmup_rejects_a_spec_the_kernels_reject():
    from prefixkv.kernels import ShapeError

    spec = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=32, block_size=16, dtype=torch.float16,
                         max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024)
    with pytest.raises(ShapeError, match="multiple of num_kv_heads"):
        warmup(spec, PRIMARY_DEVICE)


@pytest.mark.parametrize("field, value", [
    ("kv_scales", "bogus"),          # was taken as "tensor"
    ("windows", ()),                 # compiled the cache write only: every attention call JIT-compiled later
    ("windows", [None]),
    ("max_model_len", -3),           # were taken
    ("max_num_batched_tokens", 0),
    ("max_num_seqs", 2.0),
    ("workspace_splits", 1025),      # more than a SplitWorkspace may have
    ("workspace_splits", True),
    ("cascade", 1),
])
def test_a_spec_that_would_compile_nothing_or_the_wrong_variants_is_refused(field, value):
    import dataclasses

    from prefixkv.kernels import UnsupportedError

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16,
                         max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024,
                         cache_dtype=torch.float8_e4m3fn)
    bad = dataclasses.replace(spec, **{field: value})
    with pytest.raises(UnsupportedError, match=field):
        attention_variants(bad, on_gpu=False)
    with pytest.raises(UnsupportedError, match=field):
        warmup(bad, "cpu")
