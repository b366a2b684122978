"""The cascade count (prefixkv.bench.cascade_bytes) against hand-worked cases: keys each KV
head's programs load, from the kernel's tiling (32 query / 8 KV heads, head_dim 128, bf16)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("triton")

from prefixkv import SharedPrefix  # noqa: E402
from prefixkv.bench.cascade_bytes import (  # noqa: E402
    ModelShape,
    block_q,
    count_workload,
    keys_read,
    step_keys,
)
from prefixkv.bench.workloads import BenchRequest, Workload  # noqa: E402

SHAPE = ModelShape()
KEY_BYTES = 8 * 128 * 2 * 2  # KV heads x head_dim x (K, V) x bf16


def test_keys_read_by_hand():
    assert keys_read(1, 41, 4) == 41  # decode: one tile, every key
    assert keys_read(5, 20, 4) == (15 + 4) + (15 + 5)  # two tiles, causal
    assert keys_read(100, 100, 64) == 64 + 100


def test_block_q_follows_the_kernels_tiles():
    assert SHAPE.bytes_per_key == KEY_BYTES
    assert block_q(SHAPE, 1) == 4  # a 16-row decode tile holds the 4 query heads of a KV head
    assert block_q(SHAPE, 100) == 64  # PREFILL_TILE: 256 rows
    assert block_q(SHAPE, 100, lse=True) == 32  # the LSE output keeps 128 rows


def test_decode_step_with_and_without_a_shared_prefix():
    """Two requests decoding after 40 and 45 tokens, sharing their first 2 blocks (32
    tokens): plain reads 41 + 46 keys; cascade reads their own 9 + 14 and the prefix
    once (2 packed rows: one tile)."""
    ids = [[0, 1, 2], [0, 1, 3]]
    shared = step_keys(SHAPE, [SharedPrefix(2, (0, 1))], ids, [40, 45], [1, 1], 16)
    assert shared == (87, 9 + 14 + 32, 2)
    alone = step_keys(SHAPE, [], [[0, 1, 2], [4, 5, 3]], [40, 45], [1, 1], 16)
    assert alone == (87, 87, 0)


def test_prefill_step_after_a_shared_cached_prefix():
    """Two requests of 8 new tokens after the same 32 cached tokens: tiles of 8 query
    positions; plain 2 x (32 + 8); cascade 2 x 8 own and the prefix once for the 16
    packed rows (a 64-row tile: one)."""
    got = step_keys(SHAPE, [SharedPrefix(2, (0, 1))], [[0, 1, 2], [0, 1, 3]], [32, 32], [8, 8], 16)
    assert got == (80, 16 + 32, 2)


def test_replay_of_a_tiny_workload_by_hand():
    """Two prompts of a shared 32-token prefix + 3 tokens, decoding 2 and 1 tokens.
    Step 1 prefills both (b hits a's two blocks, but they are computed in this step, so
    no group): 35 + 35 keys. Step 2 decodes both on 36 keys, grouped: 4 + 4 own + 32.
    Step 3 decodes a alone on 37."""
    prefix = tuple(range(100, 132))
    wl = Workload("tiny", "", (BenchRequest("a", prefix + (1, 2, 3), (7, 8)),
                               BenchRequest("b", prefix + (4, 5, 6), (9,))), 1024)
    got = count_workload(wl, 16, SHAPE)
    plain, cascade = 70 + 72 + 37, 70 + 40 + 37
    assert got["steps"] == 3 and got["grouped_request_steps"] == 2 and got["decode_steps"] == 2
    assert got["plain_bytes_per_step"] == plain * KEY_BYTES / 3
    assert got["cascade_bytes_per_step"] == cascade * KEY_BYTES / 3
    assert got["decode_plain_bytes_per_step"] == (72 + 37) * KEY_BYTES / 2
    assert got["decode_cascade_bytes_per_step"] == (40 + 37) * KEY_BYTES / 2
    assert got["ratio"] == plain / cascade


def test_a_request_waits_while_the_running_ones_need_the_pool():
    """A pool of 4 blocks, two requests of one block growing to four: the second would
    leave the first too few blocks to finish, so it waits (the replay never runs out):
    one request at a time, a prefill step and 40 decode steps each."""
    wl = Workload("tight", "", tuple(BenchRequest(r, tuple(range(k, k + 16)), tuple(range(40)))
                                     for r, k in (("a", 0), ("b", 500))), 64)
    got = count_workload(wl, 16, SHAPE)
    assert got["steps"] == 82 and got["grouped_request_steps"] == 0


def test_imports_neither_torch_nor_triton():
    code = ("import sys, prefixkv.bench.cascade_bytes; "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cascade_passes_count_the_tiles_of_their_lse_output():
    """cascade_attention's two passes return the LSE (for the merge), and an LSE call
    never takes the 256-row PREFILL_TILE: 128 rows, 32 query positions a tile. The count
    took the plain call's tiles for them, so it read the prefix pass of 64 decoding
    members as one tile (it is two) and a long prefill's own part in half the tiles."""
    ids = [[0, 1, 2 + i] for i in range(64)]
    got = step_keys(SHAPE, [SharedPrefix(2, tuple(range(64)))], ids, [40] * 64, [1] * 64, 16)
    assert got == (64 * 41, 64 * 9 + 2 * 32, 64)  # 64 rows: 2 tiles of 32 over the prefix
    # 2 x 100 new tokens after 32 shared: plain tiles of 64 positions (228 keys each);
    # cascade's own part in tiles of 32 (292 each) and the prefix for 200 rows (7 tiles)
    ids = [[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 9, 10, 11, 12, 13, 14, 15]]
    got = step_keys(SHAPE, [SharedPrefix(2, (0, 1))], ids, [32, 32], [100, 100], 16)
    assert got == (2 * 228, 2 * 292 + 7 * 32, 2)


def test_a_step_without_a_group_runs_the_plain_kernel():
    """No group: the engine calls the plain kernel (cascade's LSE tiles would read more)."""
    got = step_keys(SHAPE, [], [[0, 1, 2, 3, 4, 5, 6]], [0], [100], 16)
    assert got == (164, 164, 0)


@settings(max_examples=25, deadline=None)
@given(members=st.integers(2, 100), shared=st.integers(1, 4), own=st.lists(st.integers(0, 40), min_size=1,
                                                                            max_size=100))
def test_a_decode_step_saves_the_prefix_of_each_member_but_its_groups_tiles(members, shared, own):
    """Decode (one new token each): cascade saves members - tiles prefix reads of the
    shared tokens, where the prefix pass packs the members' rows into tiles of
    block_q(members, lse)."""
    own = [own[i % len(own)] for i in range(members)]
    ids = [list(range(shared)) + [100 + 10 * i + j for j in range(-(-(o + 1) // 16))]
           for i, o in enumerate(own)]
    computed = [16 * shared + o for o in own]
    got = step_keys(SHAPE, [SharedPrefix(shared, tuple(range(members)))], ids, computed, [1] * members, 16)
    tiles = -(-members // block_q(SHAPE, members, lse=True))
    assert got.plain == sum(c + 1 for c in computed) and got.grouped == members
    assert got.plain - got.cascade == (members - tiles) * 16 * shared
