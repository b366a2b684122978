"""When a cached block is evicted while requests hold copies of it (spares: a request that
hit the prompt short of its last block recomputes that block), the block a later hit
names is the copy vLLM 0.33 names: its hash map keeps the copies in the order it cached
them and answers the first left. Before, prefixkv's index handed the prefix to the last
spare made (every copy holds the same KV: no hit was wrong, but the ids handed to vLLM's
worker differed from vLLM's own). Needs vllm installed."""

from __future__ import annotations

import os

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_free_order import _admit, _free  # noqa: E402
from .test_vllm_reference import BS, _managers, _request  # noqa: E402


@pytest.mark.parametrize("holders", [2, 3, 4])
def test_an_evicted_block_hands_its_prefix_to_the_first_copy_cached(holders):
    prompt = [7] * (2 * BS)  # a hit stops a token short: each holder recomputes block 2
    hits = []
    for s in _managers(13):  # 12 blocks to hand out (vLLM's null block 0 aside)
        a = _admit(s, "a", prompt, 0)
        copies = [_admit(s, f"h{i}", prompt, 0) for i in range(holders)]
        assert all(c[0] == a[0] and c[1] != a[1] for c in copies)  # block 1 hit, block 2 a copy
        _free(s, "a")  # a's block 2: free, cached; each holder's copy held
        _admit(s, "d", [100 + k for k in range((11 - holders) * BS)], 0)  # every free block: a's 2 evicted
        blocks, hit, _ = s.m.get_computed_blocks(_request("p", prompt + [1], None))
        assert hit == 2 * BS
        hits.append((list(blocks.get_block_ids()), [c[1] for c in copies], a[1]))
    (ours, ours_copies, _), (theirs, their_copies, a2) = hits
    assert ours_copies == their_copies and ours == theirs
    assert theirs[0][1] == their_copies[0]  # (vLLM: the first copy cached)
    assert a2 not in theirs[0]
