"""prefixkv's vLLM plug-in beside vLLM 0.33's own manager on Mamba groups with speculative
state blocks (``MambaSpec.num_speculative_blocks``: MTP / EAGLE steps write their draft
tokens' states into blocks past the request's end). In ``mamba_cache_mode="none"`` (caching
off) vLLM's ``MambaManager`` counts ``num_tokens + num_speculative_blocks * block_size``
in that group only; prefixkv serves it as a 2-token window holding that many blocks past
its row's end (``GroupSpec.ahead``, groups/spec_blocks.py). The request stream of
test_vllm_reference.py with the comparisons of test_vllm_hybrid_reference.py after every
call runs on such layouts in test_vllm_mamba_none.py (``NONE_LAYOUTS``); here, scenarios
with exact ids and a seeded stream beside full attention of another block size (align
mode's, where vLLM moves them each step: test_vllm_mamba_spec_align.py). Needs vllm
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

from .test_vllm_mamba_none import _at_max_model_len, _none, _run_steps  # noqa: E402
from .test_vllm_plugin import config, full  # noqa: E402
from .test_vllm_reference import BS, MAX_LEN, _managers, _request  # noqa: E402


def test_a_request_holds_its_speculative_blocks_past_its_row_as_in_vllm():
    # full attention beside Mamba (none) with 2 speculative blocks, caching off, blocks
    # of 4: 11 tokens in chunks of 5, 3 (lookahead 2), 3, then a decode step. Mamba's
    # row is cdiv(slots, 4) + 2 entries; the second step releases its block 3 (below
    # token 4's state), which full attention's third block reuses at once
    tables = [_run_steps(side.m, 11, ((5, 0), (3, 2), (3, 0), (1, 0)))
              for side in _managers(20, (full(BS), _none(num_speculative_blocks=2)), enable_caching=False)]
    assert tables[0] == tables[1]
    assert tables[0] == [([[1, 2], [3, 4, 5, 6]], 13), ([[1, 2, 3], [0, 4, 5, 6, 7]], 12),
                         ([[1, 2, 3], [0, 4, 5, 6, 7]], 12), ([[1, 2, 3], [0, 0, 5, 6, 7]], 13)]


def test_a_mamba_block_of_max_model_len_with_speculative_blocks_is_served_as_in_vllm():
    # vLLM's usual none-mode layout with MTP: Mamba's block is max_model_len (256) beside
    # full attention at 16 (scheduler and hash block 256, the lcm: nothing is hashed),
    # 3 speculative blocks: the Mamba row is 1 + 3 blocks throughout. 100 tokens in
    # steps of 30, 40 (lookahead 3), 30, then decode steps; then freed
    answers = _at_max_model_len(num_speculative_blocks=3)
    assert answers[0] == answers[1]
    fa, mamba_row = [1, 2, 7, 8, 9, 10, 11], [3, 4, 5, 6]
    assert answers[0] == ([([fa[:2], mamba_row], 33), ([fa[:5], mamba_row], 30), ([fa, mamba_row], 28),
                           ([fa, mamba_row], 28), ([fa, mamba_row], 28)], 39)


SIZED = {  # (full attention's block, Mamba's, its speculative blocks); scheduler = hash = the lcm
    "full4+mamba8s2": (4, 8, 2),
    "full4+mamba16s1": (4, 16, 1),
    "full8+mamba32s3": (8, 32, 3),
}
SIZED_OP = st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "free"]), st.integers(0, 3),
                     st.integers(1, 40), st.integers(0, 3))


def _sized_pair(layout: str, num_blocks: int) -> list[Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import MambaSpec

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    fa, mb, spec = SIZED[layout]
    mamba = MambaSpec(block_size=mb, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="none",
                      num_speculative_blocks=spec)
    return [make(config(full(fa), mamba, num_blocks=num_blocks), max_model_len=MAX_LEN,
                 scheduler_block_size=mb, hash_block_size=mb, enable_caching=False)
            for make in (KVCacheManager, Theirs)]


def _held_apart(m: Any, live: list[str], num_blocks: int) -> list[list[list[int]]]:
    """Each live request's tables, checked: no block in two tables or twice in one
    (nothing is cached: a shared block is another request's KV), none of them free."""
    tables = [[list(g) for g in m.get_block_ids(rid)] for rid in live]
    held = [b for t in tables for g in t for b in g if b != 0]
    assert len(held) == len(set(held)), tables
    assert len(held) + m.block_pool.get_num_free_blocks() == num_blocks - 1
    return tables


@pytest.mark.parametrize("layout", list(SIZED))
@settings(max_examples=40, deadline=None)
@given(extra=st.integers(0, 12), ops=st.lists(SIZED_OP, min_size=6, max_size=30),
       lengths=st.lists(st.integers(1, MAX_LEN - 8), min_size=4, max_size=4))
def test_they_agree_on_speculative_blocks_beside_full_attention_of_another_size(layout, extra, ops, lengths):
    # a seeded stream on both managers (caching off): admissions in chunks with
    # lookahead slots, steps (a decoded token once the prompt is done), frees; after
    # each call the same answer, each group's table length and null entries, and the
    # free count, every held block in one table only
    from vllm.v1.request import RequestStatus

    fa, mb, spec = SIZED[layout]
    num_blocks = MAX_LEN // fa + MAX_LEN // mb + spec + extra
    sides = _sized_pair(layout, num_blocks)
    live: list[list[Any]] = [[], []]
    for serial, (op, slot, n, ahead) in enumerate(ops):
        answers = []
        for m, reqs in zip(sides, live, strict=True):
            if op == "add":
                r = _request(f"r{serial}", list(range(lengths[slot])), None)
                r.status = RequestStatus.RUNNING
                got = m.allocate_slots(r, min(n, r.num_tokens), num_lookahead_tokens=ahead)
                if got is not None:
                    r.num_computed_tokens = min(n, r.num_tokens)
                    reqs.append(r)
            elif not reqs:
                got = None
            elif op == "step":
                r = reqs[slot % len(reqs)]
                if r.num_computed_tokens == r.num_tokens and r.num_tokens < MAX_LEN - 4:
                    r.append_output_token_ids(7)  # (a decode step; none past MAX_LEN - 4)
                k = min(n, r.num_tokens - r.num_computed_tokens)
                got = m.allocate_slots(r, k, num_lookahead_tokens=ahead) if k else "done"
                if got is not None:
                    r.num_computed_tokens += k
            else:
                r = reqs.pop(slot % len(reqs))
                got = m.free(r)
            answers.append((got is None, [r.request_id for r in reqs]))
        assert answers[0] == answers[1]
        rows = [_held_apart(m, [r.request_id for r in reqs], num_blocks)
                for m, reqs in zip(sides, live, strict=True)]
        shape = [[[[b == 0 for b in g] for g in t] for t in tables] for tables in rows]
        assert shape[0] == shape[1]
        assert sides[0].block_pool.get_num_free_blocks() == sides[1].block_pool.get_num_free_blocks()


def test_a_retention_interval_keeps_the_speculative_blocks_as_in_vllm():
    # vLLM's prefix_cache_retention_interval rebuilt the windows' specs and dropped their
    # blocks ahead (caching off: nothing is retained, but the rows must stay vLLM's)
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager

    init_none_hash(sha256)
    answers = []
    for make in (KVCacheManager, Theirs):
        kv = config(full(BS), _none(num_speculative_blocks=2), num_blocks=30,
                    prefix_cache_retention_interval=8)
        m = make(kv, max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False)
        answers.append(_run_steps(m, 11, ((5, 0), (3, 2), (3, 0), (1, 0))))
    assert answers[0] == answers[1]
    assert [len(t[0][1]) for t in answers[0]] == [2 + 2, 3 + 2, 3 + 2, 3 + 2]
