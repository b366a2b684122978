"""A sliding window's ``retained`` tokens (vLLM's ``SlidingWindowSpec.extra_retained_tokens``):
kept below the window on release, never asked of a hit. The spec's rules against vLLM's
formulas (written here from its ``get_num_skipped_tokens`` and ``_contiguous_blocks_for_hit``),
then a manager, step by step."""

import pytest

from prefixkv import ConfigError
from prefixkv.groups import GroupSpec, HybridKVCacheManager, full_attention, mamba, sliding_window
from prefixkv.groups.fit import least_blocks

BS = 4


@pytest.mark.parametrize("make", [
    lambda: sliding_window(4, -1), lambda: sliding_window(4, True), lambda: sliding_window(4, 2.0),
    lambda: GroupSpec("full_attention", 0, 3), lambda: GroupSpec("chunked_local_attention", 8, 1),
    lambda: GroupSpec("mamba", 0, 1),
])
def test_a_bad_retained_raises_config_error(make):
    with pytest.raises(ConfigError, match="retained"):
        make()


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("retained", [0, 1, 5, 9])
def test_release_keeps_the_retained_tokens_and_hits_ask_for_the_window_alone(window, retained):
    spec = sliding_window(window, retained)
    plain = sliding_window(window)
    for n in range(60):
        skipped = max(0, n - window + 1 - retained)  # vLLM's get_num_skipped_tokens(n)
        assert spec.num_released(n, BS) == skipped // BS
        assert spec.num_unread(n, BS) == plain.num_unread(n, BS)  # (the hit's rule)
    for hit in range(0, 40, BS):
        for first in range(hit, hit + 12):
            cut = spec.admitted_cut(hit, first, BS)
            assert cut == max(plain.num_unread(hit, BS), max(0, first - window + 1 - retained) // BS)
    assert full_attention().num_released(99, BS) == 0 and mamba().num_released(9, BS) == 2  # (8 // 4)


def _tables(m, rid):
    return [list(ids) for ids in m.get_block_ids(rid)]


@pytest.mark.parametrize("retained", [0, 2, 5, 9])
def test_a_decoding_request_releases_a_block_once_vllm_skips_it(retained):
    """Full attention beside a window of 3 that retains ``retained`` tokens: after every
    step, the window's null entries are exactly vLLM's skipped blocks at the step's start
    (``get_num_skipped_tokens``); full attention keeps all."""
    m = HybridKVCacheManager((full_attention(), sliding_window(3, retained)), 40, BS)
    null = m.null_block_id
    m.add_request("a", list(range(9)))
    for n in range(9, 40):
        m.append_tokens("a", [n])  # (a step starting at n)
        full, window = _tables(m, "a")
        assert null not in full
        skipped = max(0, n - 3 + 1 - retained) // BS
        assert window[:skipped] == [null] * skipped and null not in window[skipped:], (n, window)
        m.check_invariants()


@pytest.mark.parametrize("retained", [3, 9])
def test_a_hit_asks_for_the_window_alone_and_holds_nothing_below_it(retained):
    """A request holds the blocks its window and retained tokens need while it runs; a
    filler then evicts every free block (the window's released ones). A hit is judged by
    the window alone (a window of 3 at block size 4: the hit's last block), as vLLM's:
    the one ending on the request's first window block held is found (asking for the
    retained tokens' blocks too, it would be none), and a request admitted on it holds
    nothing below that block (vLLM's null entries: its hit leaves them out)."""
    released = max(0, 32 - 3 + 1 - retained) // BS  # (at the last step's start, 32)
    m = HybridKVCacheManager((full_attention(), sliding_window(3, retained)), 29 - released, BS)
    null = m.null_block_id
    tokens = list(range(100, 121)) + list(range(12))  # 21 prompt tokens, 12 decoded
    m.add_request("a", tokens[:21])
    for t in tokens[21:]:
        m.append_tokens("a", [t])
    held = _tables(m, "a")[1]
    assert held[:released] == [null] * released and held[released] != null
    assert m.num_free_blocks == 10 and m.add_request("filler", list(range(500, 520))) is not None
    assert m.num_free_blocks == 0
    k = released + 1
    assert m.lookup(tokens[:k * BS + 1]) == k * BS
    m.free("filler")
    adm = m.add_request("b", tokens[:k * BS + 1])
    assert adm.num_cached_tokens == k * BS
    full, window = _tables(m, "b")
    assert window[:k - 1] == [null] * (k - 1) and null not in window[k - 1:] and null not in full
    m.check_invariants()


def test_the_least_blocks_a_prompt_holds_count_the_retained_tokens():
    """``least_blocks`` (PromptTooLongError's test): a prompt's last step holds the
    retained tokens' blocks too."""
    n = 40
    for retained in (0, 4, 8):
        groups = (sliding_window(3, retained),)
        held = -(-n // BS) - max(0, n - 1 - 3 + 1 - retained) // BS
        assert least_blocks(groups, BS, n, None, 0, False, 0) >= held
        assert least_blocks(groups, BS, n, None, 0, False, 1 << 20) >= held
