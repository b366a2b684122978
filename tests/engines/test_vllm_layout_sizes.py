"""``read_layout`` on layouts of groups of different block sizes (docs/groups.md): which it
reads (full-attention and sliding-window groups, each size a multiple of vLLM's
``hash_block_size`` and a divisor of its ``scheduler_block_size``), into what
(``Layout.sizes``; ``block_size`` the scheduler's), and which it refuses by name. Needs
vllm installed."""

from __future__ import annotations

import os

import pytest

from prefixkv.groups import BlockSizes, full_attention, sliding_window

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _spec  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402


def _read(groups, scheduler, hashes):
    from prefixkv.integrations.vllm.layout import read_layout

    return read_layout(config(*(_spec(b, w) for b, w in groups), num_blocks=40),
                       scheduler_block_size=scheduler, hash_block_size=hashes)


@pytest.mark.parametrize(("groups", "scheduler", "hashes"), [
    (((8, None), (16, 20)), 16, 8),  # (vLLM's test_two_groups_different_block_sizes, halved)
    (((16, 20), (24, None)), 48, 8),  # (the lcm neither group's size)
    (((8, 6), (16, None), (32, 40)), 64, 8),  # (a scheduler size past the lcm)
    (((16, None), (16, 20)), 16, 8),  # (one size, hashed finer)
])
def test_groups_of_different_sizes_are_read_with_their_sizes(groups, scheduler, hashes):
    layout = _read(groups, scheduler, hashes)
    assert layout.sizes == BlockSizes.of([b for b, _ in groups], hashes, scheduler)
    assert layout.block_size == scheduler and not layout.sizes.one_size and layout.hybrid
    assert layout.groups == tuple(full_attention() if w is None else sliding_window(w) for _, w in groups)


@pytest.mark.parametrize(("groups", "scheduler", "hashes"), [
    (((16, None), (8, "mamba")), 16, 8),  # (a Mamba block no larger than the hash block)
    (((16, 20), (8, None), (16, "mamba")), 16, 8),  # (a window beside: vLLM's partial hits off)
    (((8, None), (16, 20), (32, "mamba")), 32, 8),
])
def test_mamba_beside_other_sizes_is_read_where_vllms_hits_are_aligned(groups, scheduler, hashes):
    layout = _read(groups, scheduler, hashes)
    assert layout.sizes == BlockSizes.of([b for b, _ in groups], hashes, scheduler)
    assert [g.kind for g in layout.groups] == [
        "full_attention" if w is None else "mamba" if w == "mamba" else "sliding_window" for _, w in groups]


@pytest.mark.parametrize(("groups", "scheduler", "hashes"), [
    (((8, None), (16, "mamba")), 16, 8),
    (((32, "mamba"), (8, None), (32, "mamba")), 32, 8),
])
def test_mamba_with_vllms_partial_hits_is_read_where_served(groups, scheduler, hashes):
    # (vLLM's fine-grained partial hits on: Mamba of one size beyond the hash block,
    # full attention at the hash block; groups/partial.py)
    layout = _read(groups, scheduler, hashes)
    assert layout.sizes == BlockSizes.of([b for b, _ in groups], hashes, scheduler, partial=True)
    assert layout.sizes.unit == hashes
    from prefixkv.integrations.vllm.layout import build_core

    assert build_core(layout, enable_caching=True, enable_events=True)[0].sizes.partial  # (events too)


def test_one_size_reads_as_before():
    layout = _read(((16, None), (16, 20)), 16, 16)
    assert layout.sizes == BlockSizes((16, 16), 16, 16) and layout.block_size == 16 and layout.sizes.one_size


@pytest.mark.parametrize(("make", "scheduler", "hashes", "named"), [
    (lambda: (_spec(8, None), _spec(12, None)), 24, 8, "multiple of the hash block size"),
    (lambda: (_spec(8, None), _spec(16, None)), 24, 8, "divisor of the scheduler's"),
    (lambda: (_spec(16, None),), 16, 8, "full-attention model"),
    (lambda: (_spec(16, None),), 32, 16, "full-attention model"),
    (lambda: (_spec(8, None), _chunked(16, 32)), 16, 8, "sliding-window and Mamba groups only"),
    # (vLLM's fine-grained partial hits: a Mamba block past the hash block, beside
    # groups that all look up at the hash block)
    # (served beside full attention only: not a window; full attention of two sizes only
    # where one is the hash block's, twofull-r28)
    (lambda: (_spec(8, 20), _spec(8, None), _spec(16, "mamba")), 16, 8, "fine-grained partial hits"),
    (lambda: (_spec(16, None), _spec(32, None), _spec(32, "mamba")), 32, 8, "fine-grained partial hits"),
])
def test_what_the_hybrid_manager_is_not_given_is_refused_by_name(make, scheduler, hashes, named):
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV
    from prefixkv.integrations.vllm.layout import read_layout

    with pytest.raises(UnsupportedByPrefixKV, match=named):
        read_layout(config(*make(), num_blocks=40), scheduler_block_size=scheduler, hash_block_size=hashes)


def _chunked(block_size, tokens):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                     attention_chunk_size=tokens)
