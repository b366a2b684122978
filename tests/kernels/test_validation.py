"""Every documented Raises of paged_prefill_attention, on both backends, before any write."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    ArgumentTypeError,
    DeviceError,
    DtypeError,
    ShapeError,
    UnsupportedError,
    paged_prefill_attention,
    write_kv_cache,
)

from .cases import make_case
from .conftest import PRIMARY_DEVICE, triton_skip_reason

BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(triton_skip_reason() is not None,
                                                    reason=str(triton_skip_reason()))),
]


def _case():
    return make_case([2, 1], [5, 3], num_kv_heads=2, group=2, head_dim=16, block_size=4,
                     device=PRIMARY_DEVICE)


def _replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


def _option(name, value):
    return lambda a, k: (a, {**k, name: value})


def _argument(index, change):
    return lambda a, k: (_replace(a, index, change(a[index])), k)


# (error, message fragment, how to break the call: (args, kwargs) -> (args, kwargs))
BAD_CALLS = {
    "q rank": (ShapeError, "q must be", lambda a, k: (_replace(a, 0, a[0][0]), k)),
    "q head_dim": (ShapeError, "q must be", lambda a, k: (_replace(a, 0, a[0][..., :8]), k)),
    "heads not a multiple": (ShapeError, "multiple of num_kv_heads 2",
                             lambda a, k: (_replace(a, 0, a[0][:, :3]), k)),
    "cache rank": (ShapeError, "k_cache must be", lambda a, k: (_replace(a, 1, a[1][0]), k)),
    "v_cache shape": (ShapeError, "v_cache shape", lambda a, k: (_replace(a, 2, a[2][:1]), k)),
    # no block: the Triton kernel read block -1 (a segfault under the interpreter), torch an IndexError
    "no block": (ShapeError, "no block", lambda a, k: ([a[0], a[1][:0], a[2][:0], *a[3:]], k)),
    "cu_seqlens rank": (ShapeError, "cu_seqlens_q must be", lambda a, k: (_replace(a, 4, a[4][None]), k)),
    "seqused_k size": (ShapeError, r"seqused_k must be \[2\]", lambda a, k: (_replace(a, 5, a[5][:1]), k)),
    "block_table rows": (ShapeError, r"block_table must be \[2,", lambda a, k: (_replace(a, 3, a[3][:1]), k)),
    "max_seqlen_k capacity": (ShapeError, "block_table capacity", lambda a, k: (_replace(a, 7, 1000), k)),
    "out shape": (ShapeError, "out shape",
                  lambda a, k: (a, {**k, "out": torch.empty(3, 4, 8, device=a[0].device)})),
    "q dtype": (DtypeError, "q dtype", lambda a, k: (_replace(a, 0, a[0].half()), k)),
    "cache dtype": (DtypeError, "k_cache/v_cache dtypes", lambda a, k: (_replace(a, 2, a[2].double()), k)),
    "int64 block table": (DtypeError, "block_table dtype", lambda a, k: (_replace(a, 3, a[3].long()), k)),
    "int64 seqused": (DtypeError, "seqused_k dtype", lambda a, k: (_replace(a, 5, a[5].long()), k)),
    "out dtype": (DtypeError, "out dtype",
                  lambda a, k: (a, {**k, "out": torch.empty(3, 4, 16, device=a[0].device).half()})),
    "device": (DeviceError, "meta", lambda a, k: (_replace(a, 3, a[3].to("meta")), k)),
    "head_dim 12": (UnsupportedError, "head_dim 12", lambda a, k: (
        [a[0][..., :12], a[1][..., :12], a[2][..., :12], *a[3:]], k)),
    "max_seqlen_q": (UnsupportedError, "max_seqlen_q", lambda a, k: (_replace(a, 6, 2.0), k)),
    "window shape": (UnsupportedError, "window_size", lambda a, k: (a, {**k, "window_size": 8})),
    "window value": (UnsupportedError, "window_size", lambda a, k: (a, {**k, "window_size": (-2, 0)})),
    "causal right": (UnsupportedError, "right -1 or 0", lambda a, k: (a, {**k, "window_size": (4, 2)})),
    "softcap": (UnsupportedError, "softcap", lambda a, k: (a, {**k, "softcap": -1.0})),
    "scale": (UnsupportedError, "softmax_scale", lambda a, k: (a, {**k, "softmax_scale": 0.0})),
    # past float32 once scaled by log2(e) (kern-r9): 1e39 gave NaN on torch, numbers on Triton;
    # softcap 3e38 NaN on Triton, numbers on torch
    "scale past float32": (UnsupportedError, r"softmax_scale must be a float in \(0, 1.7e\+38\]",
                           _option("softmax_scale", 1e39)),
    "softcap past float32": (UnsupportedError, r"softcap must be 0 \(off\) or a float in \[1.18e-38, 1.7e\+",
                             _option("softcap", 3e38)),
    # below float32's normal range, or a scale / softcap past it: a score of 0 became NaN
    # (0 / 0, 0 * inf): 1e-46 on both backends, 1e-40 / 1e-46 on torch, 1e30 / 1e-10 on Triton (kern-r10)
    "softcap below float32": (UnsupportedError, r"softcap must be 0 \(off\) or a float in \[1.18e-38",
                              _option("softcap", 1e-46)),
    "scale / softcap past float32": (UnsupportedError, r"softmax_scale / softcap must be at most 1.7e\+38",
                                     lambda a, k: (a, {**k, "softmax_scale": 1e30, "softcap": 1e-10})),
    # flags and scalars of the wrong type: truthy strings and bools must not pass as options
    "causal str": (UnsupportedError, "causal must be True or False, got 'no'", _option("causal", "no")),
    "causal int": (UnsupportedError, "causal must be True or False", _option("causal", 1)),
    "return_lse str": (UnsupportedError, "return_lse must be", _option("return_lse", "yes")),
    "checked None": (UnsupportedError, "checked must be", _option("checked", None)),
    "scale bool": (UnsupportedError, "softmax_scale .* got True", _option("softmax_scale", True)),
    "scale str": (UnsupportedError, "softmax_scale", _option("softmax_scale", "0.1")),
    "softcap bool": (UnsupportedError, "softcap .* got True", _option("softcap", True)),
    "window floats": (UnsupportedError, "window_size", _option("window_size", (4.0, 0))),
    "window bools": (UnsupportedError, "window_size", _option("window_size", (True, 0))),
    "window str": (UnsupportedError, "window_size", _option("window_size", "4,0")),
    # non-tensors
    "q list": (ArgumentTypeError, "q must be a torch.Tensor, got list", _argument(0, lambda t: t.tolist())),
    "block_table list": (ArgumentTypeError, "block_table must be a torch",
                         _argument(3, lambda t: t.tolist())),
    "seqused_k tuple": (ArgumentTypeError, "seqused_k must be", _argument(5, lambda t: (5, 3))),
    "out list": (ArgumentTypeError, "out must be", _option("out", [[0.0]])),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_call_raises_before_writing(backend, name):
    error, match, breaker = BAD_CALLS[name]
    case = _case()
    out = torch.full_like(case.q, 5.0)
    args, kwargs = breaker(list(case.args), {"out": out})
    with pytest.raises(error, match=match):
        paged_prefill_attention(*args, backend=backend, **kwargs)
    assert (out == 5.0).all()


def test_errors_are_value_errors():
    for error, _, _ in BAD_CALLS.values():
        assert issubclass(error, ValueError)
    assert issubclass(ArgumentTypeError, TypeError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_rejects_non_tensors_and_non_bool_checked(backend):
    cache = torch.zeros(2, 4, 1, 8, device=PRIMARY_DEVICE)
    key = torch.ones(2, 1, 8, device=PRIMARY_DEVICE)
    slots = torch.tensor([0, 1], device=PRIMARY_DEVICE)
    with pytest.raises(ArgumentTypeError, match="key must be a torch.Tensor"):
        write_kv_cache(key.tolist(), key, cache, cache, slots, backend=backend)
    with pytest.raises(ArgumentTypeError, match="slot_mapping must be"):
        write_kv_cache(key, key, cache, cache, [0, 1], backend=backend)
    with pytest.raises(ArgumentTypeError, match="k_cache must be"):
        write_kv_cache(key, key, None, cache, slots, backend=backend)
    with pytest.raises(UnsupportedError, match="checked must be True or False"):
        write_kv_cache(key, key, cache, cache, slots, backend=backend, checked="no")
    assert not cache.any()
