"""vLLM 0.33's lookahead hashing (``num_hash_lookahead_tokens`` = L > 0) beside Mamba
groups at ONE block size (every group, the hash block and the scheduler's block alike:
vLLM's fine-grained partial hits off), with and without Mamba's chunk-end checkpoint
blocks (``prefix_cache_retention_interval`` refused by name): prefixkv's plug-in beside vLLM's own
``KVCacheManager`` on test_vllm_lookahead_mamba.py's random streams (``LookaheadSides``:
after every call the same answers and blocks, tables, free count, hits with their
blocks and junctions for a probe and each live request's tokens and one more, the
blocks' hashes where the plug-in reads them (beside checkpoints), ``check_invariants()``), requests hashed
with their L following tokens on both sides, chunks cut by vLLM's own scheduler with
partial hits off. Equal hits mean a state prefixkv serves is the one vLLM serves, keyed
by the prefix and the L tokens after it. Also a scenario with exact values. Needs vllm
installed."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_fine_full import same_block_hashes  # noqa: E402
from .test_vllm_lookahead_mamba import PAIRS, LookaheadSides, _specs, lookahead_request  # noqa: E402
from .test_vllm_mamba_sizes import OP  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PROMPT  # noqa: E402
from .vllm_split import vllm_mamba_chunk  # noqa: E402

ONE_SIZE = {  # (groups at 8, the hash block 8; and at 4)
    "full8+mamba8": ((8, None), (8, "mamba")),
    "mamba8+full8": ((8, "mamba"), (8, None)),
    "full8+mamba8+mamba8": ((8, None), (8, "mamba"), (8, "mamba")),
    "full4+mamba4": ((4, None), (4, "mamba")),
}


def one_size_pair(groups: Any, num_blocks: int, lookahead: int, prefill: int, align: int = 0,
                  retention: int | None = None) -> list[Any]:
    """vLLM's manager and prefixkv's plug-in at one block size, with lookahead hashing."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    b = groups[0][0]
    kw = dict(max_model_len=256, scheduler_block_size=b, hash_block_size=b,
              num_hash_lookahead_tokens=lookahead, num_prefill_lookahead=prefill)
    specs = _specs(groups, align)
    return [make(config(*specs, num_blocks=num_blocks, prefix_cache_retention_interval=retention), **kw)
            for make in (Theirs, Ours)]


class OneSizeLookaheadSides(LookaheadSides):
    def __init__(self, groups: Any, num_blocks: int, lookahead: int, prefill: int, align: int = 0,
                 retention: int | None = None) -> None:
        super().__init__(groups, num_blocks, lookahead, prefill, align)
        self.ms = one_size_pair(groups, num_blocks, lookahead, prefill, align, retention)
        assert not self.ms[0].coordinator.enable_partial_hash_hits

    def _chunk(self, start: int, n: int, total: int, prompt: int) -> int:
        return vllm_mamba_chunk(self.step, self.h, start, n, total, prompt, lookahead=self.lookahead,
                                align=self.align, partial=False)


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(ONE_SIZE))
@pytest.mark.parametrize(("lookahead", "prefill"), PAIRS)
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT,
       checkpoints=st.sampled_from([None, (1, None), (2, None)]))
def test_the_plugin_keys_one_size_mamba_states_with_their_lookahead_as_vllm(layout, lookahead, prefill, small,
                                                                            ops, probe, checkpoints):
    # (small: a pool a little over one longest request per group: refusals and
    # evictions; checkpoints: one chunk-end checkpoint block per Mamba group aligned to
    # the block (1) or half of it (2); a retention interval is refused: below)
    groups = ONE_SIZE[layout]
    b = groups[0][0]
    align, retention = (0, None) if checkpoints is None else (b // checkpoints[0], checkpoints[1])
    sides = OneSizeLookaheadSides(groups, len(groups) * -(-MAX_LEN // b) + 4 if small else 400,
                                  lookahead, prefill, align, retention)

    def each(s: Any) -> None:
        s.ms[1].core.check_invariants()
        if align:  # (else every block reads None: integrations/vllm/block_hash_view.py)
            same_block_hashes(s)
    sides.drive(ops, probe, each)


def test_a_one_size_state_is_found_only_with_its_lookahead_tokens():
    # full attention and Mamba at 8 (hash 8), L = 1: a prompt of 25 tokens is cut at its
    # last boundary (25 - 1) // 8 * 8 = 24, its Mamba state there keyed with token 24;
    # a reader with the same 25 tokens hits 24, one parting at token 24 (the lookahead)
    # or 23 hits 16 (the state at 16 keyed with token 16) on both managers
    groups = ONE_SIZE["full8+mamba8"]
    got = []
    for m in one_size_pair(groups, 400, 1, 0):
        r = lookahead_request(m, "a", list(range(25)), 8, 1)
        for n in (16, 8, 1):
            assert m.allocate_slots(r, n) is not None
            r.num_computed_tokens += n
            m.new_step_starts()
        m.free(r)
        got.append([m.get_computed_blocks(lookahead_request(m, f"b{shared}", list(range(shared)) + [99] * 6,
                                                            8, 1))[1] for shared in (25, 24, 23)])
    assert got == [[24, 16, 16], [24, 16, 16]], got


@pytest.mark.parametrize("retention", [0, 16])
def test_a_retention_interval_beside_one_size_lookahead_is_refused(retention):
    # (vLLM keeps the state where a step ends at the prompt's boundary (p - L) // b * b
    # unless that step checkpoints: found by the stream above on mamba8+full8, L = 3, a
    # prompt of 17 whose first chunk ends at 8, retention 0: vLLM hits 8, prefixkv 0)
    from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match="prefix_cache_retention_interval"):
        one_size_pair(ONE_SIZE["full8+mamba8"], 40, 1, 0, 8, retention)
