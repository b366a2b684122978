"""A lookup with per-block extra keys (multimodal inputs) while runs are pending
(``index/pending.py``): it wrote every pending run first (``settle_all``: ~360 bytecodes a
run of 8 blocks, benchmarks/results/mm_lookup_opcodes.md); it writes only the runs its
walk reaches (``ContentIndex._walk``), and finds what it found with all of them written."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager
from prefixkv.extra_keys import ExtraKeys, MultiModalInput

BS = 4


def pending(m: KVCacheManager) -> list[list[int]]:
    return sorted([b.block_id for b in r.blocks] for r in m._index.run_counts.pending)  # type: ignore[attr-defined]


def test_a_multimodal_lookup_writes_only_the_pending_run_it_reaches():
    """Two text prompts, each a miss (its run pending: an admission with images records
    its blocks one by one); then the first one's text with an image after it: its lookup
    reaches the first run alone, which is written; the other stays pending. A lookup of
    an unrelated image prompt writes none."""
    m = KVCacheManager(64, BS, seed=0)
    a = list(range(1, 8 * BS + 1))
    b = list(range(500, 500 + 8 * BS))
    m.add_request("a", a + [7])
    m.add_request("b", b + [7])
    runs = pending(m)
    assert runs == [list(range(1, 8)), list(range(10, 17))]
    m.check_invariants()
    other = ExtraKeys(mm=(MultiModalInput("other", 0, 4),))
    assert m.lookup(list(range(900, 933)), extra=other) == 0
    assert pending(m) == runs
    image = ExtraKeys(mm=(MultiModalInput("img", 8 * BS, BS),))  # the block after a's text
    prompt = a + list(range(2000, 2000 + BS)) + [7]
    assert m.lookup_block_ids(prompt, extra=image) == tuple(range(8))
    assert pending(m) == [list(range(10, 17))]
    m.check_invariants()
    assert m.lookup(b + [7]) == 32 and m.lookup(prompt, extra=image) == 32
    m.add_request("c", prompt, extra=image)  # (its image block recorded after a's run)
    m.free("c")
    m._index.settle_all()  # type: ignore[attr-defined]
    assert m.lookup_block_ids(prompt + [8] * BS, extra=image) == tuple(range(8)) + (18,)
    m.check_invariants()


# Prompts from a few block patterns (so that prefixes are shared); an image over some of
# their blocks (one of two hashes), always for a lookup, now and then for an admission; a
# lookup of an admitted text (an int: which one) with an image somewhere, or of another.
BLOCKS = [[100 + 10 * p + t for t in range(BS)] for p in range(6)]
texts = st.tuples(st.lists(st.integers(0, 5), min_size=2, max_size=7), st.integers(1, 3))
images = st.tuples(st.sampled_from(["x", "y"]), st.integers(0, 7), st.integers(1, 2))


def build(text: tuple[list[int], int], img: tuple[str, int, int] | None
          ) -> tuple[list[int], ExtraKeys | None]:
    pattern, tail = text
    tokens = [t for k in pattern for t in BLOCKS[k]] + [7] * tail
    if img is None:
        return tokens, None
    name, first, count = img
    first = min(first, len(pattern)) * BS  # (at most the partial block's)
    length = min(count * BS, len(tokens) - first)
    return tokens, ExtraKeys(mm=(MultiModalInput(name, first, length),))


ops = st.lists(st.one_of(st.tuples(st.just("add"), texts, st.none() | images),
                         st.tuples(st.just("add"), texts, st.none()),
                         st.tuples(st.just("free"), st.integers(0, 9), st.none()),
                         st.tuples(st.just("look"), st.integers(0, 9), images),
                         st.tuples(st.just("look"), texts, images)), min_size=1, max_size=30)


@settings(deadline=None, max_examples=50)
@given(ops=ops, host=st.sampled_from([0, 6]))
def test_a_multimodal_lookup_finds_what_it_finds_with_every_run_written(ops, host):
    """Two managers take the same calls; one of them writes every pending run after each
    call (what every multimodal lookup did). Admissions (some with images) leave runs
    pending in the other; there a lookup of an image prompt writes no run it does not
    reach (with a host tier: every run, as before), and every answer, the lookups' block
    ids and the admissions', is the same in both."""
    m, ref = (KVCacheManager(40, BS, seed=0, host_blocks=host) for _ in range(2))
    live: list[str] = []
    sent: list[tuple[list[int], int]] = []
    for n, (op, arg, img) in enumerate(ops):
        if isinstance(arg, int) and op == "look":
            if not sent:
                continue
            arg = sent[arg % len(sent)]
        if op == "free":
            if live:
                rid = live.pop(arg % len(live))
                m.free(rid)
                ref.free(rid)
        else:
            tokens, extra = build(arg, img)
            if op == "add":
                sent.append(arg)
                got = m.add_request(str(n), tokens, extra=extra)
                assert got == ref.add_request(str(n), tokens, extra=extra)
                if got is not None:
                    live.append(str(n))
            else:
                before = pending(m)
                found = m.lookup_block_ids(tokens, extra=extra)
                assert found == ref.lookup_block_ids(tokens, extra=extra)
                assert m.lookup(tokens, extra=extra) == ref.lookup(tokens, extra=extra)
                if not host:
                    assert set(map(tuple, pending(m))) <= set(map(tuple, before))
        ref._index.settle_all()  # type: ignore[attr-defined]
        m.check_invariants()
        ref.check_invariants()
