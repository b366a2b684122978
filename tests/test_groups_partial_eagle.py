"""vLLM's EAGLE beside fine-grained partial hits in the sized manager
(``BlockSizes.of(..., partial=True, eagle=True)``, groups/partial_eagle.py), by hand:
full attention at the hash block (2), Mamba at 4, as vLLM 0.33's
test_mamba_partial_tail_hits_below_eagle_proof_boundary; and the refusals."""

import pytest

from prefixkv.errors import ConfigError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba

PEEK = (True, False)  # (full attention peeks; Mamba's lookup drops nothing)


def _manager(eagle=True):
    return HybridKVCacheManager([full_attention(), mamba()], 20,
                                BlockSizes.of([2, 4], partial=True, eagle=eagle, peek=PEEK if eagle else ()))


def test_the_prompts_mamba_entry_sits_one_hash_block_below_its_last_boundary():
    # 9 tokens in steps of 6 and 3: with EAGLE the Mamba entry is at 9 // 2 * 2 - 2 = 6,
    # the end of the first step (inside Mamba block 1); without, at (9 - 1) // 2 * 2 = 8,
    # which no step ends at: no entry
    for eagle, want in ((True, 6), (False, 0)):
        m = _manager(eagle)
        m.add_request("0", [7] * 9, num_new_tokens=6)
        m.extend("0", 3)
        m.release_copies(m.take_kv_ops())
        m.free("0")
        prompt = [7] * 9 + [9] * 4
        assert m.lookup(prompt) == want, eagle
        m.check_invariants()
    # EAGLE: full attention matches 8 (its 4 blocks of [7, 7]), drops one hash block: 6,
    # where the Mamba entry is (block 3 after the copy on write moved it: a hit there
    # copies it again)
    with pytest.raises(ConfigError, match="peek"):  # (the last manager: without eagle)
        m.lookup(prompt, peek=PEEK)
    m = _manager()
    m.add_request("0", [7] * 9, num_new_tokens=6)
    m.extend("0", 3)
    m.release_copies(m.take_kv_ops())
    m.free("0")
    assert m.lookup(prompt, peek=PEEK) == 6
    assert m.lookup_block_ids(prompt, peek=PEEK) == ((1, 2, 3), (m.null_block_id, 7))
    assert m.lookup_per_group(prompt, peek=True) == (8, 6)
    m.check_invariants()


def test_a_peeking_hit_drops_one_hash_block_below_full_attentions_run():
    # 8 tokens in steps of 4 and 4: Mamba states at 4 and 8 (whole blocks); a prompt of
    # those 8 and 2 more: full attention's run is 4 blocks (8), less one hash block: 6,
    # where Mamba holds nothing: its state at 4. The same prompt's own 8 tokens (cap 7):
    # the run within 7 + 2 is 4 blocks, less one: 6, again 4
    m = _manager()
    m.add_request("0", list(range(8)), num_new_tokens=4)
    m.extend("0", 4)
    m.free("0")
    assert m.lookup(list(range(8)) + [50, 51]) == 8  # (without peek: Mamba's state at 8)
    assert m.lookup(list(range(8)) + [50, 51], peek=PEEK) == 4
    assert m.lookup(list(range(8)), peek=PEEK) == 4
    assert m.lookup(list(range(8)) + [50], peek=PEEK) == 4
    m.check_invariants()


@pytest.mark.parametrize(("kw", "named"), [
    ({"partial": True, "eagle": 1}, "eagle must be a bool"),
    ({"eagle": True}, "eagle must be a bool"),  # (without partial)
    ({"partial": True, "shared_prefix": True}, "shared_prefix must be a bool"),  # (without eagle)
    ({"partial": True, "eagle": True, "shared_prefix": 1}, "shared_prefix must be a bool"),
    ({"partial": True, "peek": PEEK}, "partial must be a bool"),  # (peek without eagle)
])
def test_eagle_is_refused_where_not_served(kw, named):
    with pytest.raises(ConfigError, match=named):
        BlockSizes.of([2, 4], **kw)


@pytest.mark.parametrize(("sizes", "peek"), [
    ((2, 4, 4), (True, True, False)),  # (full attention of two sizes)
    ((2, 2, 4), (False, False, True)),  # (peek on the Mamba group)
])
def test_the_manager_refuses_eagle_beside_other_sizes(sizes, peek):
    with pytest.raises(ConfigError, match="full-attention groups only, all of one size"):
        HybridKVCacheManager([full_attention(), full_attention(), mamba()], 20,
                             BlockSizes.of(sizes, 2, 4, peek=peek, partial=True, eagle=True))


def test_full_attention_larger_than_the_hash_block_drops_one_hash_block_inside_its_blocks():
    # Full attention and Mamba at 4, hash block 2, full attention peeking: 16 tokens in
    # steps ending at 4, 8, 12, 14 (the Mamba entry, one hash block below 16) and 16
    # (the entry moves to a copy, 8 -> 9). A prompt of 17 matches 4 whole blocks, drops
    # one hash block: 14, inside block 7 (whole), where Mamba holds the entry; without
    # peek it hits 16. One of 15 (cap 14): 3 blocks, no entry inside the next, less one:
    # 10, Mamba's state at 8; full attention alone serves 12 (before the drop). Admitted,
    # the 17 copies block 7 into 10 and Mamba's 9 into 12 (exact ids as vLLM's manager:
    # tests/engines/test_vllm_eagle_mamba.py).
    m = HybridKVCacheManager([full_attention(), mamba()], 30,
                             BlockSizes.of([4, 4], 2, 4, peek=PEEK, partial=True, eagle=True))
    m.add_request("a", list(range(16)), num_new_tokens=4)
    for n in (4, 4, 2, 2):
        m.extend("a", n)
    assert m.get_block_ids("a") == ((1, 3, 5, 7), (0, 0, 0, 8))
    assert [(c.src, c.dst) for c in m.take_kv_ops()] == [(8, 9)]
    prompt = list(range(16)) + [99]
    assert (m.lookup(prompt, peek=PEEK), m.lookup_block_ids(prompt, peek=PEEK)) == \
        (14, ((1, 3, 5, 7), (0, 0, 0, 9)))
    assert m.lookup(prompt) == 16
    assert m.lookup(list(range(15)), peek=PEEK) == 8
    assert m.lookup_per_group(list(range(15)), peek=True) == (12, 14)
    assert m.add_request("c", prompt, max_hit_tokens=16, peek=PEEK).num_cached_tokens == 14
    assert m.get_block_ids("c") == ((1, 3, 5, 10, 11), (0, 0, 0, 12, 13))
    assert [(c.src, c.dst) for c in m.take_kv_ops()] == [(7, 10), (9, 12)]


def test_a_step_ending_at_the_junction_records_mambas_shared_prefix_checkpoint():
    # shared_prefix (vLLM's enable_mamba_shared_prefix_checkpoint): full attention at the
    # hash block (2), Mamba at 8; a prompt of 20 admitted with junction 6 computes 6 then
    # the rest: Mamba's state at 6 (inside its block 0) is recorded, a sibling sharing
    # the first 8 tokens (full attention's 4 hash blocks, less the one EAGLE drops) hits
    # 6. Without shared_prefix nothing is recorded there: 0.
    for shared, want in ((True, 6), (False, 0)):
        m = HybridKVCacheManager([full_attention(), mamba()], 40, BlockSizes.of(
            [2, 8], partial=True, eagle=True, peek=PEEK, shared_prefix=shared))
        m.add_request("a", list(range(20)), num_new_tokens=6, junction=6)
        m.extend("a", 14)
        m.release_copies(m.take_kv_ops())
        m.free("a")
        assert m.lookup(list(range(8)) + [99] * 10, peek=PEEK) == want, shared
