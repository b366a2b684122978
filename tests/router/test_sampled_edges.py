"""Edges of the hash check's reading of a batch (sampled.py) that the scenarios of
test_hash_check.py leave open (mutants-r28): a run longer than the sample is read past
its hashes and extra keys in map form (the fields after them still read), a block past
those compared is not read for its hash, the sample bounds a batch's runs together, and
a nil or malformed field or event is passed over, the fields and runs after it still read."""

from __future__ import annotations

import msgpack

from prefixkv.router import Router
from prefixkv.router.hash_check import SAMPLE_BLOCKS, sample_runs

BS = 4


def test_a_run_longer_than_the_sample_is_read_past_its_hashes():
    router = Router(["a"], block_size=BS)
    toks = list(range(1, (SAMPLE_BLOCKS + 8) * BS + 1))
    ev = {"type": "BlockStored", "block_hashes": router.prompt_hashes(toks),
          "parent_block_hash": None, "extra_keys": [None] * (SAMPLE_BLOCKS + 8),
          "token_ids": toks, "block_size": BS}
    router.check_hashes("a", msgpack.packb([1.0, [ev], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (SAMPLE_BLOCKS, 0)


def test_a_block_past_those_compared_is_not_read_for_its_hash():
    """Block 2's extra keys (an image's) end the run compared at 2 blocks: its hash,
    not one a replica sends, does not drop the 2 blocks compared."""
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    ev = {"type": "BlockStored", "block_hashes": [*router.prompt_hashes(toks)[:2], "x"],
          "parent_block_hash": None, "token_ids": toks, "block_size": BS,
          "extra_keys": [None, None, ["img"]]}
    router.check_hashes("a", msgpack.packb([1.0, [ev], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (2, 0)


def test_the_sample_bounds_a_batchs_runs_together():
    router = Router(["a"], block_size=BS)
    first, second = list(range(1, 13)), list(range(100, 112))
    events = [{"type": "BlockStored", "block_hashes": router.prompt_hashes(t),
               "parent_block_hash": None, "token_ids": t, "block_size": BS}
              for t in (first, second)]
    runs = sample_runs(msgpack.packb([1.0, events, 0]), BS, 5)
    assert [len(r.hashes) for r in runs] == [3, 2]
    assert list(runs[1].tokens) == second[:2 * BS]


def run_of(router, toks, **fields):
    return {"type": "BlockStored", "block_hashes": router.prompt_hashes(toks),
            "parent_block_hash": None, **fields, "token_ids": toks, "block_size": BS}


def test_a_nil_field_before_the_token_ids_is_passed_over():
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    router.check_hashes("a", msgpack.packb([1.0, [run_of(router, toks, extra_keys=None)], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (3, 0)


def test_a_run_with_a_malformed_field_leaves_the_batchs_other_runs_read():
    router = Router(["a"], block_size=BS)
    first, second = list(range(1, 13)), list(range(100, 112))
    events = [run_of(router, first, extra_keys="x"), run_of(router, second)]
    router.check_hashes("a", msgpack.packb([1.0, events, 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (3, 0)


def test_an_entry_longer_than_read_is_passed_over():
    """Block 2's extra keys, more items than the check reads, end the run compared at 2
    blocks; the token ids after them are still read."""
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    ev = run_of(router, toks, extra_keys=[None, None, ["a", "b", "c", "d", "e"]])
    router.check_hashes("a", msgpack.packb([1.0, [ev], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (2, 0)


def test_events_read_past_are_passed_over_and_the_runs_after_them_read():
    """Before a run the check compares: an event that is not a map nor an array, one of
    another type in vLLM's array form, a run of no blocks stating block size 0, and a
    run without token ids (a snapshot's)."""
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    stored = ["BlockStored", router.prompt_hashes(toks), None, toks, BS, None, "GPU", None,
              [None] * 3, 0, "full_attention", None, None, None, None, None]
    empty = {"type": "BlockStored", "block_hashes": [], "parent_block_hash": None,
             "token_ids": [], "block_size": 0}
    snapshot = {"type": "BlockStored", "block_hashes": router.prompt_hashes(toks),
                "parent_block_hash": None, "block_size": BS}  # (no token ids)
    for i, before in enumerate([5, ["BlockRemoved", [123], "GPU"], empty, snapshot]):
        router.check_hashes("a", msgpack.packb([1.0, [before, stored], 0]))
        assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (3 * (i + 1), 0)


def test_a_run_whose_hashes_are_not_hashes_is_not_compared():
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    for hashes in (["x", "y", "z"], [*router.prompt_hashes(toks)[:2], "z"]):
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
              "token_ids": toks, "block_size": BS}
        router.check_hashes("a", msgpack.packb([1.0, [ev], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (0, 0)


def test_a_batch_without_its_rank_is_read():
    router = Router(["a"], block_size=BS)
    toks = list(range(1, 13))
    router.check_hashes("a", msgpack.packb([1.0, [run_of(router, toks)]]))  # (no dp rank)
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (3, 0)


def test_a_run_with_no_block_to_compare_is_passed_over_under_lookahead():
    """A LoRA's run without extra keys has no block the check can rehash (module doc):
    passed over, its lookahead entries unread, beside a router with lookahead keys."""
    router = Router(["a"], block_size=BS, hash_lookahead_tokens=2)
    toks = list(range(1, 13))
    ev = {"type": "BlockStored", "block_hashes": router.prompt_hashes(toks + [13, 14]),
          "parent_block_hash": None, "lora_name": "ad", "token_ids": toks, "block_size": BS,
          "lookahead_token_ids": [[5, 6], [9, 10], [13, 14]]}
    router.check_hashes("a", msgpack.packb([1.0, [ev], 0]))
    assert (router.hash_checked["a"], router.hash_mismatches["a"]) == (0, 0)


def test_a_run_is_read_in_blocks_of_its_own_stated_size():
    """``sample_runs`` reads a run's token ids in blocks of the size its event states
    (the check then passes over a size other than the router's, by ``block_size``)."""
    toks = list(range(1, 25))
    ev = {"type": "BlockStored", "block_hashes": [11, 12, 13], "parent_block_hash": None,
          "token_ids": toks, "block_size": 2 * BS}
    runs = sample_runs(msgpack.packb([1.0, [ev], 0]), BS, SAMPLE_BLOCKS)
    assert [(r.block_size, r.hashes, list(r.tokens)) for r in runs] == [(2 * BS, [11, 12, 13], toks)]
