from prefixkv.core.block import Block
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
