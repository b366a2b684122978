"""cascade_attention refuses a CascadeBatch built from another step's counts: another row
count always (q's rows are on the host), other ``num_new`` or keys with the same row count
when ``checked`` (their values are on the device)."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    MetadataError,
    ShapeError,
    build_cascade_batch,
    cascade_attention,
    paged_prefill_attention_reference,
)

from .conftest import PRIMARY_DEVICE
from .test_cascade import BACKENDS, BS, _args, _batch


def _device(backend: str) -> str:
    return PRIMARY_DEVICE if backend == "triton" else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cascade_for_fewer_rows_than_q_is_refused_before_any_write(backend):
    # Built for a step of 20 new tokens, called with a batch of 22 (e computes 15, not 13):
    # before, the 19 rows it names fit in q, and the call returned a wrong result silently.
    groups, ids, computed, new, q, k_cache, v_cache = _batch(seed=7)
    cascade = build_cascade_batch(groups, ids, computed, new, BS, device=_device(backend))
    new2 = new[:4] + [15]
    q2 = torch.randn(sum(new2), *q.shape[1:], generator=torch.Generator().manual_seed(1))
    args = _args(ids, computed, new2, q2, k_cache, v_cache, torch.float32, _device(backend))
    out = torch.full_like(args[0], 7.0)
    with pytest.raises(ShapeError, match="cascade is for 20 rows of q .* q has 22"):
        cascade_attention(*args, cascade, out=out, backend=backend)
    assert (out == 7.0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cascade_of_other_num_new_with_as_many_rows_is_refused_when_checked(backend):
    # a and b swap their new-token counts (1 and 4) and keep their keys: as many rows, as
    # many keys, other rows per request. The host cannot tell; checked reads cu_seqlens_q.
    groups, ids, computed, new, q, k_cache, v_cache = _batch(seed=8)
    cascade = build_cascade_batch(groups, ids, computed, new, BS, device=_device(backend))
    new2, computed2 = [4, 1, *new[2:]], [18, 18, *computed[2:]]
    args = _args(ids, computed2, new2, q, k_cache, v_cache, torch.float32, _device(backend))
    assert sum(new2) == sum(new) and args[6] >= max(new)
    out = torch.full_like(args[0], 7.0)
    with pytest.raises(MetadataError, match=r"other new tokens than this batch's cu_seqlens_q \(entry 1: 4 "):
        cascade_attention(*args, cascade, out=out, backend=backend, checked=True)
    assert (out == 7.0).all()
    right = build_cascade_batch(groups, ids, computed2, new2, BS, device=_device(backend))
    got = cascade_attention(*args, right, backend=backend, checked=True)
    torch.testing.assert_close(got, paged_prefill_attention_reference(*args), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cascade_of_other_keys_is_refused_when_checked(backend):
    groups, ids, computed, new, q, k_cache, v_cache = _batch(seed=9)
    cascade = build_cascade_batch(groups, ids, computed, new, BS, device=_device(backend))
    computed2 = [computed[0] - 2, *computed[1:]]  # a has 2 keys fewer than the cascade says
    args = _args(ids, computed2, new, q, k_cache, v_cache, torch.float32, _device(backend))
    with pytest.raises(MetadataError, match=r"other keys than this batch's seqused_k \(entry 0: 20 where"):
        cascade_attention(*args, cascade, backend=backend, checked=True)
