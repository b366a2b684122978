"""cascade_keys (the keys cascade's passes and the plain call load, from the launches'
tiles) and cascade_attention's choice by it: the plain call where cascade loads as many
keys or more (issue 27: the H100's chunked prefill read 2x the bytes and took 3x as long),
both passes where it loads fewer or ``force`` says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixkv import SharedPrefix
from prefixkv.bench.cascade_bytes import keys_read as counted_keys_read
from prefixkv.kernels import (
    UnsupportedError,
    build_cascade_batch,
    build_paged_batch,
    cascade_attention,
    cascade_keys,
    paged_prefill_attention_reference,
)
from prefixkv.kernels.cascade_cost import keys_read

from .cases import tolerance
from .conftest import PRIMARY_DEVICE, triton_skip_reason

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RUN7 = RESULTS / "cascade-nvidia-h100-80gb-hbm3-run7.json"


def test_the_closed_form_is_the_sum_over_tiles():
    for q_len in (0, 1, 2, 7, 31, 32, 33, 256, 1000):
        for block_q in (1, 4, 16, 32, 64):
            for kv_len in (q_len, q_len + 5, q_len + 4096):
                assert keys_read(q_len, kv_len, block_q) == counted_keys_read(q_len, kv_len, block_q)


def _case_batch(batch: int, shared: int, own: int, q_len: int, bs: int = 16, device: str = "cpu"):
    """time_cascade.py's batch: every request shares ``shared`` tokens, then ``own`` + its new ones."""
    shared_blocks, own_blocks = shared // bs, -(-(own + q_len) // bs)
    ids = [list(range(shared_blocks)) + [shared_blocks + r * own_blocks + j for j in range(own_blocks)]
           for r in range(batch)]
    computed, new = [shared + own] * batch, [q_len] * batch
    cascade = build_cascade_batch([SharedPrefix(shared_blocks, tuple(range(batch)))], ids, computed, new, bs,
                                  device=device)
    return ids, computed, new, cascade


def test_the_h100_runs_counts_and_choices():
    """The KV MB of benchmarks/results/cascade-nvidia-h100-80gb-hbm3-run7.md, from the
    CascadeBatch's host counts: decode pays (1208 -> 168 MB, 4362 -> 202), the chunked
    prefill does not (1384 -> 2760 MB), so a call now runs it plain."""
    run = json.loads(RUN7.read_text())
    s = run["shape"]
    per_key = s["kv_heads"] * s["head_dim"] * 2 * 2  # K and V, bf16
    pays = []
    for case in run["cases"]:
        *_, cascade = _case_batch(case["batch"], case["shared"], case["own"], case["q_len"], s["block_size"])
        keys = cascade_keys(cascade, group=s["heads"] // s["kv_heads"], head_dim=s["head_dim"],
                            max_seqlen_q=case["q_len"], on_gpu=True, elem_bytes=2)
        assert keys.plain * per_key / 1e6 == pytest.approx(case["plain_mb"], abs=0.05)
        assert keys.cascade * per_key / 1e6 == pytest.approx(case["cascade_mb"], abs=0.05)
        pays.append(keys.pays)
    assert pays == [True, True, False]


def _step(q_len: int, batch: int = 2, device: str = "cpu"):
    """Requests of ``q_len`` new tokens after 32 shared and 32 own keys, a filled cache."""
    ids, computed, new, cascade = _case_batch(batch, 32, 0, q_len, device=device)
    step = build_paged_batch(ids, computed, new, 16, device=device)
    gen = torch.Generator().manual_seed(q_len)
    cache = [torch.randn(1 + max(max(r) for r in ids), 16, 2, 16, generator=gen).to(device) for _ in range(2)]
    q = torch.randn(sum(new), 4, 16, generator=gen).to(device)
    return (q, *cache, step.block_table, step.cu_seqlens_q, step.seqused_k, q_len, step.max_seqlen_k), cascade


@pytest.fixture
def prefill_launches(monkeypatch) -> list[int]:
    """One entry per launch of the attention kernel (which still runs)."""
    from prefixkv.kernels import attention

    kernel, seen = attention._paged_prefill_kernel, []

    class Counted:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            seen.append(1)
            return kernel[grid]

    monkeypatch.setattr(attention, "_paged_prefill_kernel", Counted())
    return seen


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
@pytest.mark.parametrize(("q_len", "passes"), [(1, 2), (32, 1)], ids=["decode-pays", "prefill-plain"])
def test_a_call_runs_the_passes_only_where_they_load_fewer_keys(prefill_launches, q_len, passes):
    # Interpreter tiles of 32 positions here (group 2, head_dim 16): two prefills of 32 rows
    # pack into 2 tiles of the prefix pass, as many as the plain call's; two decodes into 1.
    args, cascade = _step(q_len, device=PRIMARY_DEVICE)
    keys = cascade_keys(cascade, group=2, head_dim=16, max_seqlen_q=q_len, on_gpu=PRIMARY_DEVICE == "cuda",
                        elem_bytes=4)
    assert keys.pays == (passes == 2), keys
    want = paged_prefill_attention_reference(*args)
    got = cascade_attention(*args, cascade, backend="triton")
    assert len(prefill_launches) == passes
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    prefill_launches.clear()
    forced = cascade_attention(*args, cascade, backend="triton", force=True)
    assert len(prefill_launches) == 2
    torch.testing.assert_close(forced, want, **tolerance(torch.float32))


def test_force_must_be_a_bool():
    args, cascade = _step(1)
    with pytest.raises(UnsupportedError, match="force"):
        cascade_attention(*args, cascade, backend="torch", force="yes")  # type: ignore[arg-type]
