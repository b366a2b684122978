"""Metadata builders: exact tensors from plain block ids, and their errors."""

from __future__ import annotations

import pytest
import torch

from prefixkv.kernels import (
    BatchError,
    build_block_table,
    build_cu_seqlens_q,
    build_paged_batch,
    build_seqused_k,
    build_slot_mapping,
)


def test_block_table_pads_rows():
    table = build_block_table([[4, 2], [7], []], pad_id=9)
    assert table.dtype == torch.int32
    assert table.tolist() == [[4, 2], [7, 9], [9, 9]]
    assert build_block_table([[1]], max_blocks=3).tolist() == [[1, 0, 0]]
    assert build_block_table([]).shape == (0, 1)


def test_slot_mapping_continues_after_the_cached_prefix():
    # request 0: 3 cached + 3 new in blocks [4, 2] of size 4 -> positions 3, 4, 5
    # request 1: 0 cached + 2 new in block [7] -> positions 0, 1
    slots = build_slot_mapping([[4, 2], [7]], [3, 0], [3, 2], 4, pad_to=7)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [4 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 28, 29, -1, -1]


def test_cu_seqlens_and_seqused_k():
    assert build_cu_seqlens_q([3, 0, 2]).tolist() == [0, 3, 3, 5]
    assert build_cu_seqlens_q([3]).dtype == torch.int32
    assert build_seqused_k([5, 0], [1, 2]).tolist() == [6, 2]


def test_paged_batch_bundles_one_step():
    batch = build_paged_batch([[4, 2], [7]], [3, 0], [3, 2], 4, max_blocks=4)
    assert batch.block_table.tolist() == [[4, 2, 0, 0], [7, 0, 0, 0]]
    assert batch.slot_mapping.tolist() == [19, 8, 9, 28, 29]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5]
    assert batch.seqused_k.tolist() == [6, 2]
    assert (batch.max_seqlen_q, batch.max_seqlen_k) == (3, 6)


def test_paged_batch_of_nothing():
    batch = build_paged_batch([], [], [], 16)
    assert batch.slot_mapping.shape == (0,) and (batch.max_seqlen_q, batch.max_seqlen_k) == (0, 0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: build_block_table([[1, -2]]), r"block_ids\[0\]"),
        (lambda: build_block_table([[1]], pad_id=2**31), "pad_id"),
        (lambda: build_block_table([[1, 2, 3]], max_blocks=2), "3 blocks but max_blocks is 2"),
        (lambda: build_cu_seqlens_q([1, -1]), "num_new"),
        (lambda: build_cu_seqlens_q([2**31 - 1, 1]), "exceed"),
        (lambda: build_seqused_k([1, 2], [1]), "one per request"),
        (lambda: build_seqused_k([2**31 - 1], [1]), "seqused_k"),
        (lambda: build_slot_mapping([[1]], [0], [3], 2), "need 2 blocks of 2, it has 1"),
        (lambda: build_slot_mapping([[1]], [0], [1], 0), "block_size"),
        (lambda: build_slot_mapping([[1]], [0], [2], 4, pad_to=1),
         r"pad_to must be None or an int >= 2 .*got 1"),
        # wrong Python types: typed errors, never a bare TypeError or a silently empty batch
        (lambda: build_slot_mapping([iter([1, 2])], [0], [2], 4), r"block_ids\[0\] must be a sequence"),
        (lambda: build_block_table([iter([1, 2])]), r"block_ids\[0\] must be a sequence"),
        (lambda: build_paged_batch((r for r in [[1, 2]]), [0], [2], 4), "block_ids must be a sequence"),
        (lambda: build_paged_batch([[1]], iter([0]), [1], 4), "num_computed must be a sequence"),
        (lambda: build_block_table(3), "block_ids must be a sequence"),
        (lambda: build_block_table([3]), r"block_ids\[0\] must be a sequence"),
        (lambda: build_block_table(["12"]), r"block_ids\[0\] must be a sequence"),
        (lambda: build_block_table([[1]], max_blocks=2.0), "max_blocks must be None or an int >= 1, got 2.0"),
        (lambda: build_block_table([[1]], max_blocks=True), "max_blocks .* got True"),
        (lambda: build_block_table([[1]], max_blocks=0), "max_blocks .* got 0"),
        (lambda: build_slot_mapping([[1]], [0], [1], 4, pad_to=2.0), "pad_to .* got 2.0"),
        (lambda: build_slot_mapping([[1]], [0], [1], True), "block_size"),
        (lambda: build_cu_seqlens_q(3), "num_new must be a sequence"),
        (lambda: build_seqused_k([1], 2), "num_new must be a sequence"),
        (lambda: build_slot_mapping([[1]], [0, 1], [2], 4), "num_computed"),
        (lambda: build_paged_batch([[1]], [True], [1], 4), "num_computed"),
        # two new tokens into one slot (the kernel's programs would race): was accepted
        (lambda: build_slot_mapping([[3], [3]], [0, 1], [2, 1], 4),
         r"new tokens 1 \(request 0\) and 2 \(request 1\) both go to slot 13, of block 3"),
        (lambda: build_paged_batch([[5, 2, 5]], [0], [9], 3), r"new tokens 0 \(request 0\) and 6 .* slot 15"),
    ],
)
def test_bad_batches_raise(call, match):
    with pytest.raises(BatchError, match=match):
        call()
