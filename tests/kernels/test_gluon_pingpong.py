"""The Gluon ping-pong probe (``benchmarks/gluon_pingpong_kernel.py``) against the fp32
reference, on a Hopper GPU only.

Gluon has no interpreter, so nothing here runs without CUDA; the kernel's wgmma needs
sm_90 (Blackwell has no wgmma). The probe is not part of the library: these tests are
what a GPU session checks before it times the kernel (``gpu_session.sh``'s ``gluon``
step; ``benchmarks/results/kernels-sm90-gluon-pingpong.md`` for the static figures).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from .conftest import HAS_CUDA, torch

ROOT = Path(__file__).resolve().parents[2]


def _hopper_reason() -> str | None:
    if not HAS_CUDA:
        # (the argument checks too: imported after triton under TRITON_INTERPRET=1, the kernel
        # module, which unsets it, fails inside gluon's own import)
        return ("needs a CUDA GPU: Gluon has no interpreter, and gluon_pingpong_kernel cannot be "
                "imported where triton runs interpreted (gluon's standard library asserts compiled "
                "JIT functions)")
    if torch.cuda.get_device_capability()[0] != 9:
        return "the kernel's wgmma needs sm_90"
    return None


pytestmark = pytest.mark.skipif(_hopper_reason() is not None, reason=str(_hopper_reason()))


@pytest.fixture(scope="module")
def pingpong():
    """The kernel module's launch (``run``, ``BLOCK_M``) and the script's problem and reference."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gluon_pingpong
    import gluon_pingpong_kernel

    return types.SimpleNamespace(**vars(gluon_pingpong), run=gluon_pingpong_kernel.run)


Q_LEN = 128  # new tokens a request: two query tiles of 64 positions x 4 query heads


# 1, 2, 5 and 32 key tiles of 32 (fewer tiles than the ring's 4 buffers, more, and the
# ring wrapping 8 times); a scale of 1 makes the rows' maxima move tile to tile, so the
# accumulator's rescale (alpha) matters.
@pytest.mark.parametrize("n_keys", [32, 64, 160, 1024])
@pytest.mark.parametrize("page", [None, 16], ids=["dense", "paged16"])
@pytest.mark.parametrize("sm_scale", [128 ** -0.5, 1.0])
def test_matches_the_fp32_reference(pingpong, n_keys, page, sm_scale):
    _check(pingpong, n_keys=n_keys, page=page, sm_scale=sm_scale, causal=False)


# Causal: 128 new positions (two query tiles of 64 positions x 4 heads) after 0, 32, 96
# and 992 cached keys: the first tile's keys all on the diagonal (no unmasked pass), one
# unmasked pass, several, and the ring wrapped.
@pytest.mark.parametrize("prefix", [0, 32, 96, 992])
@pytest.mark.parametrize("page", [None, 16], ids=["dense", "paged16"])
def test_causal_matches_the_fp32_reference(pingpong, prefix, page):
    _check(pingpong, n_keys=prefix + Q_LEN, page=page, sm_scale=1.0, causal=True)


def _check(pingpong, *, n_keys: int, page: int | None, sm_scale: float, causal: bool) -> None:
    batch, kv_heads = 2, 2
    q, k, v, table = pingpong.problem(torch, batch=batch, kv_heads=kv_heads, n_keys=n_keys, q_len=Q_LEN,
                                      page=page, seed=n_keys)
    dense = (k, v) if page is None else tuple(pingpong.dense_kv(t, table, kv_heads) for t in (k, v))
    shape = dict(batch=batch, kv_heads=kv_heads, n_keys=n_keys, sm_scale=sm_scale, causal=causal)
    out = pingpong.run(q, k, v, table, page=page, **shape)
    torch.testing.assert_close(out.float(), pingpong.reference(q, *dense, **shape), atol=2e-2, rtol=2e-2)


def test_refuses_what_the_kernel_cannot_run(pingpong):
    q, k, v, table = pingpong.problem(torch, batch=1, kv_heads=1, n_keys=64, q_len=64, page=16)
    for bad, match in ((dict(n_keys=48), "multiple of 32"), (dict(stages=1), "at least 2 buffers"),
                       (dict(page=32), "block size"), (dict(kv_heads=8), "heads of a KV head"),
                       (dict(batch=3), "tokens of 3 requests"),
                       (dict(n_keys=32, causal=True), "causal")):  # 64 new tokens are not the last of 32
        shape = {"batch": 1, "kv_heads": 1, "n_keys": 64, "sm_scale": 1.0, "page": 16, **bad}
        with pytest.raises(ValueError, match=match):
            pingpong.run(q, k, v, table, **shape)
