"""The vLLM plug-in beside vLLM's own manager with fine-grained partial hits and a
full-attention group larger than the hash block (groups/partial_full.py): after every
step the same tables, free counts, hits (a hit inside a full-attention block, found by
its partial entry or whole, copied on write), junctions and copies with their held
blocks, up to the first spare (tests/engines/test_vllm_mamba_sizes.py's ``Sides``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()

torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_mamba_sizes import OP, Sides  # noqa: E402
from .test_vllm_sized_model import MAX_LEN, PARTIAL, PARTIAL_FULL, PROMPT, STEMS  # noqa: E402

# full attention of two sizes beside Mamba: one larger than the hash block, one of its
# size (vLLM looks them up one after the other, in the order of their first groups, as
# its test_lookahead_checkpoint_has_available_hash's full 128 + Mamba 512 + full 64)
TWO_FULL = {
    "full8+mamba32+full4, hash 4": (((8, None), (32, "mamba"), (4, None)), 4),
    "full4+mamba8+full16, hash 4": (((4, None), (8, "mamba"), (16, None)), 4),
    "full16+mamba8+full4+full16, hash 4": (((16, None), (8, "mamba"), (4, None), (16, None)), 4),
}


def same_block_hashes(sides: Sides) -> None:
    """Every live request's blocks read the same ``block_hash`` and
    ``block_hash_num_tokens`` on both sides (the plug-in's, block_hash_view.py: a
    partial entry is the hash at its boundary while its block holds no whole prefix)."""
    for r in sides.reqs[1].values():  # (as if built with the plug-in's block hasher)
        sides.ms[1].prepared_prompts.note(r)
    got = [{rid: [[(b.block_id, b.block_hash, b.block_hash_num_tokens) for b in g]
                  for g in m.get_blocks(rid).blocks] for rid in reqs}
           for m, reqs in zip(sides.ms, sides.reqs, strict=True)]
    assert got[0] == got[1]


def same_hits_per_group(sides: Sides, tokens: list[int]) -> None:
    """vLLM's ``coordinator.find_longest_cache_hit_per_group`` gives the same blocks and
    hits on both sides for the block hashes of a request of ``tokens``, under caps from
    none to past its hashes (each group alone: a Mamba group's longest state within the
    cap, full attention's run of whole blocks and the partial entry after it)."""
    got = []
    for m in sides.ms:
        r = sides.make_request(m, f"per{sides.serial}", tokens)  # (kept alive while asked)
        if hasattr(m, "prepared_prompts"):  # (as if built with the plug-in's block hasher)
            m.prepared_prompts.note(r)
        top = len(r.block_hashes) * sides.h
        per_group = m.coordinator.find_longest_cache_hit_per_group
        got.append([(hits, [[b.block_id for b in g] for g in blocks])
                    for cap in sorted({0, sides.h, top // 2, max(0, top - 1), top, top + sides.h})
                    for blocks, hits in [per_group(r.block_hashes, cap)]])
    assert got[0] == got[1], got


def _run(groups: Any, small: bool, h: int | None, ops: Any, probe: list[int], hashes: bool = False,
         events: bool = False) -> None:
    """``ops`` on both sides (the pool large, or a little over one longest request:
    refusals and evictions), compared after each, block hashes too where served (not
    with a hash block ``h`` below full attention's, unless a group of ``h`` is there
    too, ``hashes``: every block reads None there, as before), and with ``events`` the
    KV events of each step (``Sides.same_events``), up to the first spare."""
    sides = Sides(groups, sum(-(-MAX_LEN // b) for b, _ in groups) + 3 if small else 400, partial=True,
                  hash_size=h, events=events)

    def each(sides: Sides) -> None:
        if events and not any(sides.ms[1].core._index.twins):  # (a spare announces nothing: twin_model.py)
            sides.same_events(groups)
        if h is None or hashes:
            same_block_hashes(sides)
        for r in sides.reqs[0].values():
            same_hits_per_group(sides, list(r.all_token_ids) + [0])
        same_hits_per_group(sides, probe)
    sides.drive(ops, probe, each)


@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL_FULL) + list(TWO_FULL))
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugin_gives_vllms_tables_hits_and_copies_with_full_attention_larger_than_the_hash_block(
        layout, small, events, ops, probe):
    # (events: vLLM's KV events on, the same entries stored and removed in each step, a
    # full-attention partial entry once per block that gets it)
    groups, h = {**PARTIAL_FULL, **TWO_FULL}[layout]
    _run(groups, small, h, ops, probe, layout in TWO_FULL, events)


def test_a_hit_inside_a_block_found_whole_is_admitted_under_its_lookups_cap():
    # full16+mamba8, hash 4: r1 computes 8 of 13 tokens (Mamba's state at 8), r2 caches
    # 0..15 whole in one full block; r3's hit is 8 (full attention's block found whole
    # under the cap 16, Mamba's state at 8), which a cap of 8 does not find again (vLLM's
    # phase 1 takes no block past the cap): admission looks it up under the lookup's cap
    groups, h = PARTIAL_FULL["full16+mamba8, hash 4"]
    sides = Sides(groups, 400, partial=True, hash_size=h)
    for op in [("add", list(range(13)), 8), ("add", STEMS[0][:17], None), ("add", STEMS[0][:17], None)]:
        sides.do(*op)
        sides.compare([7])
    assert sides.copies == 1 and [list(g) for g in sides.ms[1].get_block_ids("r3")] == [[6, 7], [2, 0, 8]]


def test_full_attention_of_the_hash_blocks_size_looked_up_first_caps_the_larger_ones_hit():
    # full4+mamba8+full16, hash 4: r1 caches 0..43 (full16: 0..31 whole, the entry at 44
    # in its block 2; Mamba the state at 44); freed, full4 (group 0, freed first) loses
    # its block 11 (tokens 40..43) to r3. A probe of r1's prompt: full4 finds 40, under
    # which full16 finds 32 (no entry at 36 or 40), Mamba no state: hit 0, the junction
    # 40, as vLLM (a lookup without full4 found 44: a row past full4's blocks)
    groups, h = TWO_FULL["full4+mamba8+full16, hash 4"]
    sides = Sides(groups, 30, partial=True, hash_size=h)
    for op in [("add", STEMS[0][:45], None), ("free", 0, 0), ("add", STEMS[1][:44], None)]:
        sides.do(*op)
        sides.compare(STEMS[0][:45])
    assert [list(g) for g in sides.ms[1].get_block_ids("r3")] == \
        [list(range(16, 27)), [0, 0, 0, 0, 0, 27], [28, 29, 11]]
    probe = _request("p", STEMS[0][:45], h)
    assert [m.get_computed_blocks(probe)[1:] for m in sides.ms] == [(0, 40), (0, 40)]


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("layout", list(PARTIAL))
@settings(max_examples=30, deadline=None)
@given(ops=st.lists(OP, min_size=4, max_size=30), probe=PROMPT)
def test_the_plugins_blocks_read_vllms_hashes_beside_mamba_with_partial_hits(layout, small, ops, probe):
    # (full attention of the hash block's size: a Mamba block's partial entry is its hash
    # while the block holds no whole prefix, moved to its copy with the entry)
    _run(PARTIAL[layout], small, None, ops, probe)


def test_delay_cache_blocks_on_a_hit_at_the_prompts_last_boundary_inside_a_full_block():
    # full4+mamba4, hash 2 (vLLM's test_hybrid_partial_hit_cow_target_starts_uncached):
    # r0 caches the partial entries at 6; r9's hit of 6 is its prompt's last hash
    # boundary inside full attention's block 1, copied on write. Admitted with
    # delay_cache_blocks (vLLM's cache_blocks does not run), the copy holds no entry on
    # either side: once a filler evicts r0's source, no hit of 6 is left. The same
    # tables, hits and copies after each step (session 28 refused the delay; holding
    # the entry at admission hit 6 after the eviction where vLLM's hits 0)
    from vllm.v1.request import RequestStatus

    groups, h = PARTIAL_FULL["full4+mamba4, hash 2"]
    sides = Sides(groups, 16, partial=True, hash_size=h)
    sides.do("add", [0, 0, 1, 1, 2, 2, 3], 6)
    sides.do("free", 0, 0)
    tokens = [0, 0, 1, 1, 2, 2, 3, 3]
    got = []
    for m, reqs in zip(sides.ms, sides.reqs, strict=True):
        m.new_step_starts()
        r = _request("r9", tokens, h)
        blocks, hit, r.shared_prefix_boundary = m.get_computed_blocks(r)
        assert hit == 6
        out = m.allocate_slots(r, 2, hit, blocks, delay_cache_blocks=True)
        assert out is not None
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, 8
        reqs["r9"] = r
        got.append([list(g) for g in out.get_block_ids()])
    assert got[0] == got[1] == [[4], [5]]
    vllm_copy = sides.ms[0].get_blocks("r9").blocks[0][1]
    assert vllm_copy.block_hash is None and vllm_copy.block_hash_num_tokens is None
    assert sides.ms[1].core._index.fine.get(4) is None  # (prefixkv's copy: no partial entry)
    sides.compare(tokens)
    sides.do("add", list(range(100, 140)), None)  # (a filler: r0's blocks evicted)
    sides.compare(tokens)
    probe = _request("p", tokens + [9], h)
    assert [m.get_computed_blocks(probe)[1] for m in sides.ms] == [0, 0]


def test_each_block_holding_a_partial_entry_announces_it_as_vllm_does():
    # full16+mamba8, hash 4: r1 and r2 both compute 200..207 (r2 no hit: Mamba holds no
    # state at 8, r1's is at 9), their prompts' last boundary 8 inside their full blocks
    # 1 and 3, which both get the entry: vLLM announces it for each block
    # (cache_partial_block), as the plug-in now (session 27 announced an entry once, by
    # its first holder, so KV events were refused here)
    groups, h = PARTIAL_FULL["full16+mamba8, hash 4"]
    sides = Sides(groups, 400, partial=True, events=True, hash_size=h)
    for op in [("add", STEMS[2][:8] + [0], None), ("add", STEMS[2][:9] + [1, 2], None)]:
        sides.do(*op)
        sides.compare([7])
        sides.same_events(groups)
    assert [[list(g) for g in sides.ms[1].get_block_ids(r)] for r in ("r1", "r2")] == \
        [[[1], [0, 2]], [[3], [0, 4]]]
    assert sides.partial_entries == 2 and sides.copies == 0


def test_a_spares_partial_entry_is_not_announced_again_when_its_request_decodes():
    # full8+mamba16, hash 4 (tests/test_groups_fine_machine.py's seed, session 30): r1
    # and r2 each compute the same 8 tokens whole (no hit: Mamba holds no state at 8),
    # then r2 decodes 4 tokens. Each step's events, (kind, group, the prefix's tokens,
    # the size announced), exactly: vLLM announces r2's block 3 whole again (a consumer
    # counting holders holds the 8-token key twice, prefixkv's once: its spare rule,
    # tests/twin_model.py), the entry at 4 on both sides for each block; the decode
    # caches nothing new on either side, so neither announces anything (a consumer's
    # index keeps both keys; the reference model had withdrawn and stored the entry
    # at 4 again)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import RequestStatus

    groups, h = PARTIAL_FULL["full8+mamba16, hash 4"]
    sides = Sides(groups, 400, partial=True, events=True, hash_size=h)
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    got: list[list[list[Any]]] = [[], []]

    def step(rid: str, decoded: list[int]) -> None:
        for side, (m, reqs) in enumerate(zip(sides.ms, sides.reqs, strict=True)):
            m.new_step_starts()
            if decoded:
                r = reqs[rid]
                r.append_output_token_ids(decoded)
                assert m.allocate_slots(r, len(decoded)) is not None
            else:
                r = reqs[rid] = sides.make_request(m, rid, tokens)
                blocks, hit, r.shared_prefix_boundary = m.get_computed_blocks(r)
                assert hit == 0 and m.allocate_slots(r, len(tokens), hit, blocks) is not None
                r.status = RequestStatus.RUNNING
            r.num_computed_tokens = r.num_tokens
            names = {_key(x): t for x, t in _names(sides, m, r)}
            got[side] += [[(type(e).__name__, e.group_idx, names[_key(x)], e.block_size)
                           for x in e.block_hashes] for e in m.take_events()]

    def _key(x: Any) -> Any:  # (vLLM's events carry an int, prefixkv's bytes)
        return x if isinstance(x, int) else maybe_convert_block_hash(x)

    step("r1", [])
    step("r2", [])
    step("r2", [0, 0, 0, 0])
    whole, entry = ("BlockStored", 0, (1, 2, 3, 4, 5, 6, 7, 1), 8), ("BlockStored", 0, (1, 2, 3, 4), 4)
    assert got[0] == [[whole], [entry], [whole], [entry]]
    assert got[1] == [[whole], [entry], [entry]]
    assert [[list(g) for g in m.get_block_ids("r2")] for m in sides.ms] == [[[3, 5], [4]]] * 2


def _names(sides: Sides, m: Any, r: Any) -> list[tuple[Any, tuple[int, ...]]]:
    """Each chain hash of ``r``'s tokens on ``m``'s side, with the prefix it names."""
    tokens = list(r.all_token_ids)
    hashes = r.block_hashes if m is sides.ms[0] else m.core.prepare(tokens).hashes
    return [(x, tuple(tokens[:(i + 1) * sides.h])) for i, x in enumerate(hashes)]
