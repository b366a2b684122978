"""Caches over 2^31 elements: slot and block offsets must be computed in int64.

Runs in a subprocess so the 2 x 4 GiB caches (allocated with ``torch.empty``, only a few
blocks ever touched, so little is resident) are freed with it and cannot disturb other
tests. The blocks used sit past element 2^31, where int32 offsets would wrap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import PRIMARY_DEVICE, triton_skip_reason

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from prefixkv.kernels import (build_paged_batch, paged_prefill_attention,
                                  paged_prefill_attention_reference, write_kv_cache)

    device = sys.argv[1]
    block_size, heads, dim = 16, 1, 64
    num_blocks = 2**21 + 64  # (2^21 + 64) * 16 * 64 elements > 2^31
    k_cache = torch.empty(num_blocks, block_size, heads, dim, dtype=torch.float16, device=device)
    v_cache = torch.empty_like(k_cache)
    assert k_cache.numel() > 2**31
    ids = [[num_blocks - 1, 2**21 + 3, 5, num_blocks - 20], [2**21 + 40]]
    cached, new = [40, 3], [14, 4]
    batch = build_paged_batch(ids, [0, 0], [a + b for a, b in zip(cached, new)], block_size, device=device)
    key = torch.randn(batch.slot_mapping.shape[0], heads, dim, device=device).half()
    value = torch.randn_like(key)
    # int32 slots: the kernel itself must widen before multiplying by the block stride
    write_kv_cache(key, value, k_cache, v_cache, batch.slot_mapping.int(), backend="triton")
    assert torch.equal(k_cache[num_blocks - 1, 0], key[0]), "write landed elsewhere"
    assert torch.equal(v_cache[2**21 + 40, 6], value[-1]), "write landed elsewhere"

    step = build_paged_batch(ids, cached, new, block_size, device=device)
    q = torch.randn(sum(new), 4, dim, device=device).half()
    args = (q, k_cache, v_cache, step.block_table, step.cu_seqlens_q, step.seqused_k,
            step.max_seqlen_q, step.max_seqlen_k)
    got = paged_prefill_attention(*args, backend="triton")
    want = paged_prefill_attention_reference(*args)
    torch.testing.assert_close(got, want, atol=5e-3, rtol=1e-2)
    print("ok")
    """
)


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_cache_over_two_to_the_31_elements():
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    if PRIMARY_DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", SCRIPT, PRIMARY_DEVICE], env=env, capture_output=True,
                         text=True,
                         timeout=900)  # a hang's bound: the interpreter on a busy machine
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
