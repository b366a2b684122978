"""A spare's partial tail entry, prefixkv's plug-in beside vLLM 0.33's own
``KVCacheManager``, entry by entry (each announced or withdrawn hash, however batched).

A spare is a second block of a prefix its group holds (here: a request whose hit stops
at the lcm recomputes the prompt's last block of the full group of 16). vLLM caches and
announces a spare's entries again, its partial tail entry (``cache_partial_block``: the
hash block before the prompt's last hash boundary) included, keeps the copy cached when
it is freed, and withdraws those entries when it evicts the copy. prefixkv announces a
spare's own entries not again, counts the holders of each partial tail entry (a spare's
too: groups/tails.py) and announces one when its first holder stores it, and empties a
spare when it is freed (its tail entry withdrawn if it held the last). So a consumer that
counts stores and removals per hash holds the same entries from both streams at every
step, but from a spare's free until vLLM evicts the copy, where vLLM's holds the freed
copy's tail entry if no other block holds it (the free-duplicate difference,
docs/groups.md): the first test, whose primary holds that tail too, and the second,
whose primary's prompt is longer (its tail lies in a later block). Needs vllm."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
pytest.importorskip("torch")

from .test_vllm_block_sizes_manager import entries, learn  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_preempted_tail import HASH, _sides  # noqa: E402

GROUPS = ((8, None), (16, None))  # hash 8, scheduler 16: group 1's blocks hold two hash blocks
PROMPT = list(range(100, 132))  # 32 tokens: its tail boundary at 24, in group 1's block 1


class Pair:
    """prefixkv's plug-in and vLLM's manager, fed the same calls; each side's hashes
    learnt as the tokens they cover."""

    def __init__(self, num_blocks: int) -> None:
        self.sides = _sides(GROUPS, num_blocks)
        self.prefixes: list[dict[Any, tuple[int, ...]]] = [{}, {}]
        self.counts = [Counter(), Counter()]

    def run(self, rid: str, tokens: list[int]) -> list[Any]:
        """Admit ``rid`` on both sides and compute it whole."""
        reqs = [_request(rid, tokens, HASH) for _ in self.sides]
        learn(self.prefixes[0], self.sides[0].core.prepare(tokens).hashes, tokens, HASH)
        learn(self.prefixes[1], reqs[1].block_hashes, tokens, HASH)
        for m, r in zip(self.sides, reqs, strict=True):
            blocks, hit, *_ = m.get_computed_blocks(r)
            assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
        return reqs

    def free(self, reqs: list[Any]) -> None:
        for m, r in zip(self.sides, reqs, strict=True):
            m.free(r)

    def step(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """The entries each side announced or withdrew since the last step (prefixkv's,
        vLLM's), each counted into what that side's stream holds."""
        out = []
        for m, p, counts in zip(self.sides, self.prefixes, self.counts, strict=True):
            es = entries(m.take_events(), p, [8, 16], HASH)
            for e in es:
                counts[e[1:3]] += 1 if e[0] else -1
            out.append(es)
        return out[0], out[1]

    def held(self) -> tuple[set[Any], set[Any]]:
        """(group, prefix tokens) of each entry a consumer that counts per hash holds."""
        return tuple({k for k, n in c.items() if n} for c in self.counts)  # type: ignore[return-value]


def short(es: list[tuple[Any, ...]]) -> list[tuple[bool, int, int]]:
    """An entry as (stored, group, tokens its hash covers)."""
    return [(e[0], e[1], len(e[2])) for e in es]


SPARE_STORED = [(True, 0, 24), (True, 0, 32), (True, 1, 32), (True, 1, 24)]  # the last: its tail
SPARE_REMOVED = [(False, 0, 32), (False, 0, 24), (False, 1, 32), (False, 1, 24)]


def test_a_spares_tail_that_the_primary_holds_too_changes_no_count():
    pair = Pair(num_blocks=10)  # (the null block, 6 for a, 3 for b's spares)
    pair.run("a", PROMPT)
    ours, theirs = pair.step()
    assert ours == theirs and (True, 1, 24) in short(ours)  # a's tail, in block 1 of 16
    b = pair.run("b", PROMPT)  # hit 16: recomputes 16..32, spares in both groups
    ours, theirs = pair.step()
    assert ours == [] and short(theirs) == SPARE_STORED
    assert theirs[-1][3:] == (8, tuple(PROMPT[:16]), PROMPT[16:24])  # (size, parent, tokens)
    pair.free(b)
    assert pair.step() == ([], [])  # vLLM keeps the copy cached; prefixkv empties it
    pair.run("c", list(range(300, 316)))  # takes the 3 free blocks: vLLM evicts the copy
    ours, theirs = pair.step()
    assert short(theirs[:4]) == SPARE_REMOVED and theirs[4:] == ours != []
    mine, vllms = pair.held()
    assert mine == vllms and (1, tuple(PROMPT[:24])) in mine


def test_a_spares_tail_that_no_primary_holds_is_announced_with_the_spare():
    pair = Pair(num_blocks=13)  # (the null block, 9 for a, 3 for b's spares)
    pair.run("a", list(range(100, 148)))  # 48 tokens: its tail at 40, in block 2 of 16
    ours, theirs = pair.step()
    assert ours == theirs and (True, 1, 40) in short(ours) and (True, 1, 24) not in short(ours)
    b = pair.run("b", PROMPT)  # a's first 32 tokens: its tail at 24, in its spare
    ours, theirs = pair.step()
    assert short(ours) == [(True, 1, 24)] and short(theirs) == SPARE_STORED
    assert ours[0] == theirs[-1]
    mine, vllms = pair.held()
    assert mine == vllms and (1, tuple(PROMPT[:24])) in mine
    pair.free(b)  # prefixkv empties the spare, its tail entry's only holder: withdrawn
    ours, theirs = pair.step()
    assert short(ours) == [(False, 1, 24)] and theirs == []
    mine, vllms = pair.held()
    assert vllms - mine == {(1, tuple(PROMPT[:24]))}  # the freed copy's, still in vLLM
    pair.run("c", list(range(300, 316)))
    ours, theirs = pair.step()
    assert short(theirs[:4]) == SPARE_REMOVED and theirs[4:] == ours != []
    mine, vllms = pair.held()
    assert mine == vllms and (1, tuple(PROMPT[:24])) not in mine


def test_a_primary_evicted_while_its_spare_is_held_leaves_the_spares_tail_entry():
    pair = Pair(num_blocks=10)
    a = pair.run("a", PROMPT)
    b = pair.run("b", PROMPT)  # spares of a's last blocks, its tail (24) in its spare too
    pair.step()
    pair.free(a)
    pair.run("c", list(range(300, 316)))  # takes a's 3 freed blocks: b's spares take over
    pair.step()
    mine, vllms = pair.held()
    assert mine == vllms and (1, tuple(PROMPT[:24])) in mine
    pair.free(b)
    pair.step()
    assert pair.held()[0] == pair.held()[1]
