"""``BlockPool.free(reversed(blocks), blocks)``: a request's ``free`` gives its blocks tail
first and names the list they come from (``source``), so that a run's blocks are
compared with one slice of it instead of listed from the iterator (results/
store25-r25.md). Exactly what the same call without ``source`` does: each case frees
the same blocks on two managers, one through ``source``, and compares every block's
count and links, the free order and the runs' fields. A run of 4 (``runs_store``'s A),
given tail first, in chain order (a source whose run is reversed), interleaved, cut
short, and a run of one block."""

import pytest

from prefixkv import KVCacheManager

BS = 2
A = list(range(100, 110))  # 5 full blocks: a head and a run of 4 (ids 0, then 1-4)
B = list(range(200, 204))  # 2 full blocks: a head and a run of 1


def _id(link: object) -> int | None:
    """A link's block id; None for a sentinel or no link."""
    return getattr(link, "block_id", None)


def state(m: KVCacheManager) -> list:
    pool = m._pool
    runs = {id(b.counted): b.counted for b in pool.blocks if b.counted is not None}
    return [[(b.block_id, b.ref_cnt, _id(b.prev), _id(b.next)) for b in pool.blocks],
            m.free_block_order(), pool.runs.shared, pool.runs.free,
            sorted((r.n, r.shared, r.fwd, r.linked, [x.block_id for x in r.blocks])
                   for r in runs.values())]


def freed(prompt: list[int], order: list[int], source: bool) -> KVCacheManager:
    """A manager that admitted ``prompt`` and gave its blocks back through ``free``, in the
    order of ``reversed(listed)`` where ``listed`` lists its blocks by ``order``."""
    m = KVCacheManager(8, BS, seed=0)
    m.add_request("a", prompt)
    blocks = m._requests.pop("a").blocks
    listed = [blocks[i] for i in order]
    if source:
        m._pool.free(reversed(listed), listed)
    else:
        m._pool.free(reversed(listed))
    return m


@pytest.mark.parametrize("prompt,order", [
    (A, [0, 1, 2, 3, 4]),   # a request's list, tail first: the run given reversed
    (A, [0, 4, 3, 2, 1]),   # the run in chain order, given forward
    (A, [4, 3, 2, 1, 0]),   # the run before the head
    (A, [0, 1, 3, 2, 4]),   # given otherwise: each counted alone
    (A, [2, 3, 4]),         # cut short: the span runs out at the list's start
    (A, [0, 2, 3, 4]),      # cut short after another block
    (B, [0, 1]),            # a run of one block
])
def test_free_with_its_source_list_is_free_without_it(prompt, order):
    a, b = freed(prompt, order, True), freed(prompt, order, False)
    assert state(a) == state(b)
    if len(order) == len(prompt) // BS:  # (every block given back: a sound pool)
        a.check_invariants()
    assert a.add_request("c", prompt).block_ids == b.add_request("c", prompt).block_ids
    assert state(a) == state(b)


def test_a_request_freed_gives_its_list_as_the_source():
    m = KVCacheManager(8, BS, seed=0)
    m.add_request("a", A)
    blocks = m._get("a").blocks
    seen = []
    free = m._pool.free
    m._pool.free = lambda given, source=None: (seen.append(source), free(given, source))
    m.free("a")
    assert seen == [blocks]
    assert m.free_block_order() == [5, 6, 7, 4, 3, 2, 1, 0]


def test_a_run_freed_the_other_way_than_last_time_is_linked_block_by_block():
    """Freed forward once (its links then chain it forward), claimed whole, then freed by
    a request's ``free`` (reversed): linked again one block at a time, in the order given."""
    out = []
    for source in (True, False):
        m = freed(A, [0, 4, 3, 2, 1], source)       # the run in chain order: ``fwd``
        m.add_request("b", A)                       # claimed whole: one count again
        blocks = m._requests.pop("b").blocks
        if source:
            m._pool.free(reversed(blocks), blocks)
        else:
            m._pool.free(reversed(blocks))
        m.check_invariants()
        out.append(state(m))
    assert out[0] == out[1]
    assert out[0][1][-5:] == [4, 3, 2, 1, 0]        # the tail first, as a request frees


def test_a_source_that_the_blocks_do_not_reverse_is_caught():
    m = KVCacheManager(8, BS, seed=0)
    m.add_request("a", A)
    blocks = m._requests.pop("a").blocks
    with pytest.raises(AssertionError, match="not reversed"):
        m._pool.free(iter(blocks), blocks)         # (forward: not the source reversed)
