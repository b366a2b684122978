"""``ContentIndex.claim`` against plain references, on adversarial op sequences.

Before every admission two references say which blocks the claim must hand out: the
per-block match the claim was first written as (the parent's child guess verified, else
the token-bytes dict verified, else the content-triple dict; no references taken), and
a scan of the whole pool for the one findable device block of each content along the
prompt (full, not a spare, same parent content, token bytes and extra bytes). The
admission must hit exactly those blocks, take one reference on each and leave every
other block's count alone (or, refused, change nothing). The prompts share prefixes,
repeat whole blocks under other parents, are re-sent while held (spares), carry salts;
forks, chunked prefills, ``uncache_blocks``, resets and evictions (a small pool) come
between admissions.
"""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager, PromptTooLongError
from prefixkv.core.block import Block
from prefixkv.core.prompt import encode_prompt
from prefixkv.index.pending import child_of, content_id_of, content_of

BS = 4
BLOCKS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [1, 2, 3, 4][::-1]]
SALTS = [None, ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b")]


def per_block_match(index, chunks: list[bytes], base: bytes) -> list[Block]:
    """The plain per-block match: guess, probe, probe the triple, one block at a time (a
    pending run's blocks as they will be written: ``index/pending.py``)."""
    hits: list[Block] = []
    cid, parent = 0, None
    for chunk in chunks:
        c = child_of(parent) if parent is not None else None
        if c is None or content_of(c) != (cid, chunk, base) or c.twin:
            c = index._by_chunk.get(chunk)
            if c is None or c.parent_cid != cid or c.extra != base:
                c = index._by_key.get((cid, chunk, base))
                if c is None:
                    break
        hits.append(c)
        cid, parent = content_id_of(c), c
    return hits


def scan_match(blocks: list[Block], chunks: list[bytes], base: bytes) -> list[Block]:
    """The findable device block of each content along the prompt, by a scan of the pool."""
    hits: list[Block] = []
    cid = 0
    for chunk in chunks:
        found = [b for b in blocks if not b.twin and content_of(b) == (cid, chunk, base)]
        assert len(found) <= 1, f"two findable blocks of one content: {found}"
        if not found:
            break
        hits.append(found[0])
        cid = content_id_of(found[0])
    return hits


# block sequences that share prefixes and repeat a block under other parents
CHAINS = [[0, 1, 2, 3, 0], [0, 1, 3, 2], [2, 1, 0, 0], [0, 0, 0, 0], [3, 1, 2]]
admits = st.tuples(st.just("admit"), st.builds(lambda c, k: CHAINS[c][:k], st.integers(0, 4),
                                               st.integers(1, 5)),
                   st.lists(st.integers(0, 3), max_size=5), st.sampled_from([0, 0, 0, 1, 2]),
                   st.none() | st.integers(1, 12), st.booleans())
ops = st.one_of(
    admits,
    st.tuples(st.just("free"), st.integers(0, 30)),
    st.tuples(st.just("fork"), st.integers(0, 30)),
    st.tuples(st.just("uncache"), st.lists(st.integers(0, 11), max_size=3)),
    st.tuples(st.just("reset")),
)
# the previous admission's prompt again, held or not, with or without more blocks after
# it (a block-aligned prompt re-sent while held: its last block becomes a spare)
agains = st.tuples(st.just("again"), st.booleans(), st.lists(st.integers(0, len(BLOCKS) - 1),
                                                            max_size=2))


@settings(deadline=None, max_examples=50)
@example([("admit", [0, 1], [0], 0, None, True), ("again", True, []), ("uncache", [1]),
          ("again", False, [])], False, 0)  # the parent's child guess is a spare now: a miss
@given(st.lists(st.one_of(admits, agains, ops), min_size=10, max_size=40), st.booleans(),
       st.sampled_from([0, 4]))
def test_claim_hits_exactly_the_reference_blocks(steps, events, host_blocks):
    m = KVCacheManager(12, BS, seed=0, enable_events=events, host_blocks=host_blocks)
    index, blocks = m._index, m._pool.blocks
    live: list[str] = []
    last: tuple = ("admit", [], [], 0, None, False)
    for n, op in enumerate(steps):
        if op[0] == "again":
            _, keep, more = op
            op = (*last[:2], last[2] + [t for i in more for t in BLOCKS[i]], *last[3:5], keep)
        if op[0] == "admit":
            last = op
            _, picks, tail, salt, new, keep = op
            tokens = [t for i in picks for t in BLOCKS[i]] + tail
            if not tokens:
                continue
            _, keys, chunks = encode_prompt(tokens, SALTS[salt], BS, None)
            probe = chunks[:(len(tokens) - 1) // BS]
            want = per_block_match(index, probe, keys.base) if keys.mm is None else None
            if want is not None:
                assert want == scan_match(blocks, probe, keys.base)
            before = [b.ref_cnt for b in blocks]
            order = m.free_block_order()
            try:
                got = m.add_request(f"r{n}", tokens, extra=SALTS[salt], num_new_tokens=new)
            except PromptTooLongError:  # ("again" with more blocks grows the prompt)
                got = None
            if got is None:
                assert [b.ref_cnt for b in blocks] == before and m.free_block_order() == order
            else:
                if keep:  # held on: a spare, a fork or a held hit may follow
                    live.append(f"r{n}")
                if want is not None and not host_blocks:  # (a host tier may go on past it)
                    assert got.num_cached_tokens == len(want) * BS
                    assert list(got.block_ids[:len(want)]) == [b.block_id for b in want]
                    for b in want:
                        assert b.ref_cnt == before[b.block_id] + 1
                    untouched = set(range(len(blocks))) - set(got.block_ids)
                    assert all(blocks[i].ref_cnt == before[i] for i in untouched)
                if not keep:
                    m.free(f"r{n}")
        elif op[0] == "free" and live:
            m.free(live.pop(op[1] % len(live)))
        elif op[0] == "fork" and live:
            parent = live[op[1] % len(live)]
            if m.num_scheduled_tokens(parent) == m.num_tokens(parent) and m.fork(parent, f"f{n}"):
                live.append(f"f{n}")
        elif op[0] == "uncache":
            m.uncache_blocks(op[1])
        elif op[0] == "reset":
            m.reset_prefix_cache()
        m.take_pending_events() if events else None
        m.check_invariants()
