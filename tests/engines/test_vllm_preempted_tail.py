"""A preempted request's partial tail entry (vLLM's ``_cache_partial_tail_block``: a
full-attention group larger than the hash block announces the prompt's last hash
boundary before its last token as one more entry of the block holding it), prefixkv's
plug-in beside vLLM 0.33's own ``KVCacheManager``. vLLM's scheduler preempts a request
(``free``, ``num_computed_tokens`` back to 0) and re-admits it with its prompt and the
tokens it decoded so far; the ``Request``'s ``num_prompt_tokens`` stays the prompt's
length, so the boundary is the prompt's, not the end of what is prefilled again. The
same events on both sides at every call. Needs vllm."""

from __future__ import annotations

import os
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request, _spec  # noqa: E402
from .test_vllm_plugin import config  # noqa: E402

HASH, SCHED = 8, 16


def _sides(groups: tuple[tuple[int, int | None], ...], num_blocks: int) -> tuple[Any, Any]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    kw = dict(max_model_len=256, scheduler_block_size=SCHED, hash_block_size=HASH,
              enable_kv_cache_events=True)
    return tuple(cls(config(*(_spec(b, w) for b, w in groups), num_blocks=num_blocks), **kw)
                 for cls in (Ours, Theirs))


def _events(m: Any, r: Any, ours: bool) -> list[tuple[Any, ...]]:
    """Each entry an event announces or withdraws (one per hash, however batched): kind,
    group, the tokens its hash covers, and a stored one's size, parent's tokens and own
    tokens when it is a partial tail entry (one hash block in a larger block). Each
    side's hashes are its own (prefixkv's or vLLM's chain over ``r``'s tokens)."""
    from .test_vllm_block_sizes_manager import entries, learn

    tokens = list(r.all_token_ids)
    prefixes: dict[Any, tuple[int, ...]] = {}
    learn(prefixes, m.core.prepare(tokens).hashes if ours else r.block_hashes, tokens, HASH)
    return entries(m.take_events(), prefixes, [8, 16], HASH)


@pytest.mark.parametrize("groups", [((8, 10), (16, None)), ((8, None), (16, None))])
@pytest.mark.parametrize("decoded", [15, 16, 32])
@pytest.mark.parametrize("cleared", [False, True])
def test_a_resumed_request_announces_its_prompts_tail_as_vllm(groups, decoded, cleared):
    """A prompt of 32 tokens (its tail boundary at 24, inside the full group's block 1)
    decodes ``decoded`` tokens (the last one not computed), is preempted (the cache then
    ``cleared``, or not) and re-admitted: its prefill again ends at ``32 + decoded``,
    whose own last boundary (40 for 16 tokens, 56 for 32) lies inside a block of 16 too
    (15: before the alignment, no tail either way). Before, prefixkv announced that one."""
    sides = _sides(groups, 40)
    prompt = list(range(100, 132))
    reqs = [_request("r", prompt, HASH) for _ in sides]
    for m, r in zip(sides, reqs, strict=True):
        blocks, hit, *_ = m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        for t in range(decoded):
            r.append_output_token_ids(500 + t)
            if t < decoded - 1:
                assert m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
    assert _events(sides[0], reqs[0], True) == _events(sides[1], reqs[1], False)
    for m, r in zip(sides, reqs, strict=True):  # (vLLM's scheduler, _preempt_request)
        m.free(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        if cleared:
            assert m.reset_prefix_cache()
    assert _events(sides[0], reqs[0], True) == _events(sides[1], reqs[1], False)
    for m, r in zip(sides, reqs, strict=True):
        assert r.num_prompt_tokens == 32 and r.num_tokens == 32 + decoded
        blocks, hit, *_ = m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
    assert _events(sides[0], reqs[0], True) == _events(sides[1], reqs[1], False)
    ours, theirs = ([list(ids) for ids in m.get_block_ids("r")] for m in sides)
    assert ours == theirs
