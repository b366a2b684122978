"""Edges of the hash check's lookahead compare (hash_check.py, sampled.py) that the
scenarios of test_lookahead_router.py leave open (mutants-r28): a run under another
lookahead spends the sample as a compared run does, every run of a batch is counted, and
an entry of exactly the widest length the check reads is compared."""

from __future__ import annotations

import logging

import msgpack

from prefixkv.router import Router
from prefixkv.router.hash_check import SAMPLE_BLOCKS

BS = 4


def stored(hashes, tokens, lookahead):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, "lookahead_token_ids": lookahead}


def batch(*events):
    return msgpack.packb([1.0, list(events), 0])


def test_runs_under_another_lookahead_spend_the_sample():
    router = Router(["a"], block_size=BS)  # no lookahead; the replica's runs have 2
    toks = list(range(1, SAMPLE_BLOCKS * BS + 1))
    run = stored(router.prompt_hashes(toks), toks, [[7, 8]] * SAMPLE_BLOCKS)
    router.check_hashes("a", batch(run))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (SAMPLE_BLOCKS, 1)
    router.check_hashes("a", batch(run))  # spent: not read
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (SAMPLE_BLOCKS, 1)


def test_every_run_of_a_batch_under_another_lookahead_is_counted():
    router = Router(["a"], block_size=BS)
    first, second = list(range(1, 13)), list(range(100, 112))
    router.check_hashes("a", batch(stored(router.prompt_hashes(first), first, [[7, 8]] * 3),
                                   stored(router.prompt_hashes(second), second, [[7, 8]] * 3)))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (6, 2)


def test_entries_of_the_widest_length_read_are_compared():
    """64 tokens after each block: the most an entry may hold and still be read."""
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=64)
    prompt = list(range(1, 3 * BS + 64 + 1))  # 3 blocks whose 64 tokens after it holds
    after = [prompt[(i + 1) * BS:(i + 1) * BS + 64] for i in range(3)]
    assert all(len(e) == 64 for e in after)
    hashes = router.prompt_hashes(prompt)
    assert len(hashes) == 3
    router.check_hashes("a", batch(stored(hashes, prompt[:3 * BS], after)))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (3, 0)
    after[2] = after[2][:-1] + [0]  # block 2's last token after it differs
    router.check_hashes("a", batch(stored(hashes, prompt[:3 * BS], after)))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (6, 1)


def test_entries_past_the_blocks_compared_are_not_read():
    """Block 2's extra keys (an image's) end the run compared at 2 blocks: its entry,
    of another width or unreadable, neither flags nor drops the 2 blocks compared."""
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=2)
    toks = list(range(1, 13))
    h = router.prompt_hashes(toks + [13, 14])
    for third in ([13, 14, 15], "x"):
        ev = stored(h, toks, [[5, 6], [9, 10], third])
        ev["extra_keys"] = [None, None, ["img"]]
        router.check_hashes("a", batch(ev))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (4, 0)


def test_an_unreadable_last_entry_leaves_the_run_uncompared():
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=2)
    toks = list(range(1, 13))
    h = router.prompt_hashes(toks + [13, 14])
    router.check_hashes("a", batch(stored(h, toks, [[5, 6], [9, 10], "x"])))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (0, 0)


def test_the_first_run_under_another_lookahead_is_warned_of_as_such(caplog):
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    with caplog.at_level(logging.WARNING, logger="prefixkv.router"):
        router.check_hashes("a", batch(stored(router.prompt_hashes(toks), toks, [[7, 8]] * 3)))
    assert router.hash_mismatches["a"] == 1
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "hashed with 2 lookahead tokens" in warned[0]
