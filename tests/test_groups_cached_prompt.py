"""``HybridKVCacheManager.cached_block_ids`` (groups/cached.py) given a prepared ``Prompt``,
and a token count inside a hash block (cases mutants-r25's mutation pass found no test
of)."""

from __future__ import annotations

import pytest

from prefixkv import ExtraKeys, RequestError
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

PROMPT = [*range(8), 1, 2, 3, 4, 5]


def test_a_prepared_prompt_is_answered_as_its_tokens():
    m = HybridKVCacheManager([full_attention(), sliding_window(4)], 16, 4)
    ids = m.add_request("a", PROMPT).group_block_ids
    want = [(ids[0][j], ids[1][j]) for j in range(3)]
    assert [m.cached_block_ids(m.prepare(PROMPT), n) for n in (4, 8, 12)] == want
    # its extra keys are the prompt's own: another salt names other prefixes
    salted = m.prepare(PROMPT, extra=ExtraKeys(cache_salt="s"))
    assert [m.cached_block_ids(salted, n) for n in (4, 8, 12)] == [(None, None)] * 3
    with pytest.raises(RequestError, match="num_tokens"):
        m.cached_block_ids(m.prepare(PROMPT[:7]), 8)  # (7 tokens: one full block)


@pytest.mark.parametrize("n", [6, 9])
def test_a_token_count_inside_a_hash_block_is_a_request_error(n):
    m = HybridKVCacheManager([full_attention(), sliding_window(4)], 16, 4)
    m.add_request("a", PROMPT)
    with pytest.raises(RequestError, match="multiple of the hash block size 4"):
        m.cached_block_ids(PROMPT, n)
