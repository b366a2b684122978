"""Lookahead keys in the hybrid manager (``hash_lookahead_tokens``, groups/lookahead.py),
by hand with exact values: hash block 2, full attention at 2, Mamba at 4 with vLLM's
fine-grained partial hits (tests/test_groups_partial.py's layout), L = 1 and 2. A Mamba
state or a block at a boundary is found only by a prompt whose L tokens after it are
those of the request that computed it; blocks whose L tokens are not known yet get their
prefix ids once ``know_tokens`` brings them; full attention's partial entry inside a block
larger than the hash block moves up with them (its own layout); and what is refused, by
name."""

import pytest

from prefixkv.errors import ConfigError, PromptError, RequestError
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba


def _manager(lookahead, num_blocks=20, **options):
    return HybridKVCacheManager([full_attention(), mamba()], num_blocks,
                                BlockSizes.of([2, 4], partial=True), hash_mode="sha256",
                                hash_lookahead_tokens=lookahead, **options)


@pytest.mark.parametrize("lookahead", [1, 2])
def test_a_mamba_state_at_the_prompts_boundary_needs_the_tokens_after_it(lookahead):
    # prompt of 9: its last boundary is (9 - max(1, L)) // 2 * 2 (8 for L 1, 6 for L 2),
    # inside a Mamba block (4..7 or 8..11); the producer's step ends there
    m = _manager(lookahead)
    prompt = [0, 0, 1, 1, 2, 2, 3, 3, 4]
    boundary = (9 - lookahead) // 2 * 2
    m.add_request("0", prompt, num_new_tokens=boundary)
    m.check_invariants()
    m.free("0")
    same = prompt[:boundary + lookahead] + [9] * 4
    assert m.lookup(same) == boundary
    for i in range(lookahead):  # (a reader parting inside the L tokens after the boundary)
        other = prompt[:boundary + i] + [9] * 6
        assert m.lookup(other) == 0  # (no Mamba state below: the step ended at the boundary only)
        assert m.lookup_per_group(other)[0] == boundary - 2  # (full attention alone: a block less)
    m.check_invariants()


def test_a_block_waits_for_its_lookahead_tokens_then_is_found():
    # L = 2: a prompt of 6 keys blocks 0 and 1 (their 2 tokens after are known), not block 2
    m = _manager(2)
    m.add_request("0", [0, 0, 1, 1, 2, 2], num_new_tokens=6)
    m.check_invariants()
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 3, 5])[0] == 4  # (block 2 has no prefix id yet)
    m.know_tokens("0", [0, 0, 1, 1, 2, 2, 3])
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 3, 5])[0] == 4  # (one token after it known: not yet)
    m.know_tokens("0", [0, 0, 1, 1, 2, 2, 3, 3])
    m.check_invariants()
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 3, 5])[0] == 6  # (now keyed with 3, 3)
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 4, 5])[0] == 4  # (not with 3, 4)
    assert m.append_tokens("0", [3, 3]) is not None  # (scheduled: block 3 waits for its tokens)
    m.check_invariants()
    m.free("0")
    m.check_invariants()


def test_know_tokens_refuses_tokens_that_are_not_the_requests():
    m = _manager(1)
    m.add_request("0", [0, 0, 1, 1, 2], num_new_tokens=4)
    with pytest.raises(RequestError):
        m.know_tokens("0", [0, 0, 1, 1, 7, 2])  # (differs from its own at token 4, past its keys)
    with pytest.raises(RequestError):
        m.know_tokens("nobody", [0])
    m.check_invariants()
    m.know_tokens("0", [0, 0, 1, 1, 2, 2, 3])
    m.check_invariants()


def test_a_prompt_prepared_without_lookahead_keys_is_refused():
    plain = HybridKVCacheManager([full_attention(), mamba()], 20, BlockSizes.of([2, 4], partial=True),
                                 hash_mode="sha256")
    m = _manager(1)
    prompt = plain.prepare([0, 0, 1, 1, 2])
    with pytest.raises(PromptError):
        m.add_request("0", prompt)
    with pytest.raises(PromptError):
        m.lookup(prompt)
    assert m.lookup(m.prepare([0, 0, 1, 1, 2])) == 0
    m.check_invariants()


def test_a_decode_step_that_would_key_a_block_before_its_tokens_is_refused():
    # append_step fills block 2 with its last token, whose lookahead token is not known:
    # refused, nothing changed (decode with know_tokens, then append_tokens)
    m = _manager(1)
    m.add_request("0", [0, 0, 1, 1, 2], num_new_tokens=5)
    before = (m.get_block_ids("0"), m.num_scheduled_tokens("0"), m.num_tokens("0"), m.num_free_blocks)
    with pytest.raises(RequestError):
        m.append_step(["0"], [2])
    assert (m.get_block_ids("0"), m.num_scheduled_tokens("0"), m.num_tokens("0"), m.num_free_blocks) == before
    m.check_invariants()


@pytest.mark.parametrize(("options", "message"), [
    ({"hash_lookahead_tokens": -1}, "hash_lookahead_tokens"),
    ({"hash_lookahead_tokens": 1.0}, "hash_lookahead_tokens"),
    ({"hash_lookahead_tokens": 1, "enable_events": True}, "events"),
])
def test_what_lookahead_keys_refuse(options, message):
    with pytest.raises(ConfigError, match=message):
        HybridKVCacheManager([full_attention(), mamba()], 20, BlockSizes.of([2, 4], partial=True), **options)
    with pytest.raises(ConfigError, match="events"):  # (at one size too)
        HybridKVCacheManager([full_attention(), mamba()], 20, 4, hash_lookahead_tokens=1, enable_events=True)


@pytest.mark.parametrize(("lookahead", "prompt", "hits"), [
    (1, [0, 0, 0, 0, 1, 1, 1, 1, 2, 3], [8, 0, 0, 0]),
    (2, [0, 0, 0, 0, 1, 1, 1, 1, 2], [4, 4, 4, 0]),
])
def test_at_one_size_a_checkpoint_needs_the_tokens_after_it(lookahead, prompt, hits):
    # full attention and Mamba at 4 (the hash block) with a checkpoint block (served by
    # the sized calls), the prompt in one step: its checkpoint is at (p - L) // 4 * 4, in
    # entry cdiv(p, 4) - 2. L = 1, p = 10: at 8, entry 1's own end; L = 2, p = 9: at 4,
    # entry 0's end held in entry 1's block (vLLM's cache_partial_block at 4). Readers
    # parting at tokens 9, 8, 6 and 5 hit as vLLM's manager (test_vllm_lookahead_one_size.py)
    m = HybridKVCacheManager([full_attention(), mamba()], 20, BlockSizes.of([4, 4], checkpoints=True),
                             hash_mode="sha256", hash_lookahead_tokens=lookahead)
    m.add_request("0", prompt, num_new_tokens=len(prompt))
    assert m.get_block_ids("0") == ((1, 2, 3), (0, 4, 5))
    m.check_invariants()
    m.free("0")
    m.check_invariants()
    assert [m.lookup(prompt[:n] + [9] * 4) for n in (9, 8, 6, 5)] == hits


def test_full_attentions_partial_entry_moves_up_as_the_tokens_after_the_prompt_become_known():
    # full attention at 8 beside Mamba at 16 (hash 4), L = 2, a prompt of 13: keyed with
    # it, 2 hash blocks ((13 - 2) // 4), so full attention's partial tail (vLLM's
    # min((p - 1) // h, len(block_hashes)) * h) is at 8, a block end: no entry. A sampled
    # token known, 3 hash blocks: the entry at 12 = (13 - 1) // 4 * 4 goes into full
    # attention's block 1. Mamba's state stays at (13 - 2) // 4 * 4 = 8, where the first
    # step ended, so the hit is 8 and full attention alone finds 12
    sizes = BlockSizes.of([8, 16], hash_size=4, partial=True)
    m = HybridKVCacheManager([full_attention(), mamba()], 40, sizes, hash_mode="sha256",
                             hash_lookahead_tokens=2)
    prompt = list(range(13))
    reader = prompt + [50, 99, 98, 97]
    m.add_request("a", prompt, num_new_tokens=8)
    m.extend("a", 5)
    m.check_invariants()
    assert (m.lookup(reader), m.lookup_per_group(reader)[0]) == (8, 8)
    m.append_tokens("a", [50])
    m.know_tokens("a", prompt + [50])
    m.check_invariants()
    assert (m.lookup(reader), m.lookup_per_group(reader)[0]) == (8, 12)
    assert m.lookup_per_group(prompt + [51, 99, 98, 97])[0] == 8  # (another token there: not its entry)
    m.free("a")
    m.check_invariants()
    assert (m.lookup(reader), m.lookup_per_group(reader)[0]) == (8, 12)


def test_know_tokens_without_lookahead_finds_the_request_and_changes_nothing():
    """Without lookahead keys (L = 0) ``know_tokens`` only finds the request (an unknown id
    is refused by name): what a lookup finds stays as it was. (mutants-r30)"""
    m = _manager(0)
    m.add_request("0", [0, 0, 1, 1, 2, 2], num_new_tokens=4)
    before = m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 3, 5])
    assert m.know_tokens("0", [0, 0, 1, 1, 2, 2, 3, 3]) is None
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 3, 5]) == before == (4, 4)
    with pytest.raises(RequestError):
        m.know_tokens("x", [0, 0])
    m.check_invariants()


def test_know_tokens_given_a_prefix_of_the_requests_own_changes_nothing():
    """L = 2: a prompt of 6 keys blocks 0 and 1; told fewer tokens than its own (a prefix
    of them: its block 2's first token only), the request keeps its keys, nothing is
    refused, and a lookup finds what it found. (mutants-r30: the comparison of the known
    tokens with the request's own, cut to the shorter.)"""
    m = _manager(2)
    m.add_request("0", [0, 0, 1, 1, 2, 2], num_new_tokens=6)
    assert m.know_tokens("0", [0, 0, 1, 1, 2]) is None
    assert m.lookup_per_group([0, 0, 1, 1, 2, 2, 3, 3, 5])[0] == 4
    m.check_invariants()
