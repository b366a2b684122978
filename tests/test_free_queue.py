from prefixkv.core.block import UNLINKED, Block
from prefixkv.core.free_queue import FreeBlockQueue


def ids(q):
    return [b.block_id for b in q]


def test_append_pop_remove_keep_lru_order():
    q = FreeBlockQueue()
    blocks = [Block(i) for i in range(5)]
    for b in blocks:
        q.append(b)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and not q.contains(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert ids(q) == [1, 3, 4, 0] and len(q) == 4
    for _ in range(4):
        q.popleft()
    assert ids(q) == [] and len(q) == 0


def test_popleft_and_remove_clear_the_links_contains_reads():
    # (mutants-r22: the link clearing of popleft or remove_all dropped)
    q = FreeBlockQueue()
    a, b, c = Block(0), Block(1), Block(2)
    q.extend([a, b, c])
    assert q.contains(a) and q.contains(c)
    assert q.popleft() is a
    assert not q.contains(a) and a.prev is UNLINKED and a.next is UNLINKED
    q.remove(c)
    assert not q.contains(c) and c.prev is UNLINKED and c.next is UNLINKED
    assert ids(q) == [1] and q.broken_link() is None
    d, e = Block(3), Block(4)
    q.extend([d, e])
    q.remove_all([b, e])
    assert not any(q.contains(x) or x.prev is not UNLINKED or x.next is not UNLINKED for x in (b, e))
    assert ids(q) == [3] and len(q) == 1 and q.broken_link() is None


def test_broken_link_names_each_kind_of_break():
    # (mutants-r22: the tail sentinel's check dropped)
    q = FreeBlockQueue()
    blocks = [Block(i) for i in range(3)]
    q.extend(blocks)
    assert q.broken_link() is None
    _, tail = q.ends()
    tail.prev = blocks[1]  # the last block unlinked from the tail's side only
    assert q.broken_link() == "tail sentinel does not point at the last block"
    tail.prev = blocks[2]
    blocks[2].prev = blocks[0]
    assert q.broken_link() == "broken prev link at block 2"
    blocks[2].prev = blocks[1]
    q.size = 4
    assert q.broken_link() == "cached tier length 4 != 3 linked"
