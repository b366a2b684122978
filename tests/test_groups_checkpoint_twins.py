"""A chunk-end checkpoint that caches a prefix another block already holds (hash 4, full
attention at 4, Mamba at 8; groups/checkpoints.py ``record``). It becomes a spare of
that block, as every other block caching a held key does (prefixkv's twin rule,
tests/sized_model.py ``twins``). When its request frees it, it goes to the free queue's
head, empty, and a free holder of the key moves to the tail in its place. vLLM's manager
keeps it as a second holder instead: this is the free-duplicate difference,
docs/groups.md. The manager already did this; the reference cached the checkpoint as a
second holder even with ``twins`` on. The four examples below are Hypothesis'
falsifying ones for ``CheckpointMachine``, shrunk by hand without changing the check
that fails. Each fails on the reference before the fix."""

import pytest

from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba
from sized_model import SizedModel
from test_groups_sizes_machine import CheckpointMachine


def test_a_checkpoint_of_a_held_prefix_is_a_spare_freed_empty():
    sizes = BlockSizes.of([4, 8], partial=True, checkpoints=True)
    m = HybridKVCacheManager([full_attention(), mamba()], 14, sizes)
    ref = SizedModel(((4, None), (8, "mamba")), 14, 4, sizes.align, twins=True, partial=True,
                     checkpoint=True)
    prompt = list(range(13))
    # a: the state at 12 goes into checkpoint block 5, as the prefix of 12.
    # d: hits it, and the copy on write (5 into 4) keeps 5 held until it runs.
    # c: evicts the full-attention blocks 3, 2, 1, so nothing hits 12 any more.
    for rid, tokens in (("a", prompt), ("d", prompt + [50, 51]), ("c", list(range(100, 125)))):
        m.add_request(rid, tokens)
        ref.add(rid, tokens, None)
        m.free(rid)
        ref.free_request(rid)
    assert m.lookup(prompt) == ref.hit(prompt, None)[0] == 0
    # b: computes the prompt again and checkpoints at 12 into block 11, a spare of 5
    adm = m.add_request("b", prompt)
    assert adm.group_block_ids == ((3, 12, 2, 1), (11, 10))
    assert m.lookup_block_ids(prompt + [5]) == ((3, 12, 2), (0, 5))  # (5 is found)
    ref.add("b", prompt, None)
    m.free("b")
    ref.free_request("b")
    # 11 goes empty to the head, behind the end block 10; the key's holder 5 stays held
    want = [10, 11, 1, 9, 8, 7, 6, 13, 2, 12, 3]
    assert m.free_block_order() == list(ref.free) == want
    m.check_invariants()
    ops = m.take_kv_ops()
    assert [(c.src, c.dst) for c in ops] == ref.take_copies() == [(5, 4)]
    m.release_copies(ops)
    ref.release([5, 4])
    assert m.free_block_order() == list(ref.free) == [4, *want, 5]


# CheckpointMachine steps: ("add", prefix, cut, tail) is add_known_prefix; ("free", i) and
# ("append", i, tokens) name the i-th request added
EXAMPLES = {
    # the manager's lookup hit 16 where the reference, which had evicted the block, said 0
    "lookup_count": [
        ("add", 0, 17, 0), ("add", 0, 11, 0), ("free", 0), ("free", 1), ("add", 0, 38, 2), ("free", 2),
        ("add", 0, 34, 6), ("free", 3), ("add", 2, 9, 5), ("free", 4), ("add", 0, 46, 5), ("free", 5),
        ("add", 0, 2, 4), ("add", 2, 41, 6), ("free", 7), ("add", 2, 18, 0), ("free", 8),
        ("add", 2, 27, 9), ("add", 0, 37, 2), ("append", 9, [9]), ("append", 10, [3, 5, 6])],
    # a table differed
    "tables": [
        ("add", 0, 17, 0), ("append", 0, [0, 0]), ("add", 0, 11, 0), ("add", 2, 44, 3),
        ("append", 2, [8, 3, 8, 0, 3, 0, 3, 0]), ("free", 1), ("free", 0), ("add", 0, 25, 3), ("free", 2),
        ("add", 1, 28, 3), ("add", 1, 47, 2), ("add", 0, 9, 4), ("free", 5),
        ("append", 4, [5, 6, 0, 0, 4, 0]), ("free", 6), ("free", 3), ("free", 4), ("add", 1, 47, 1),
        ("append", 7, [1, 5])],
    # a hit's block ids differed
    "hit_blocks": [
        ("add", 0, 17, 0), ("add", 0, 11, 0), ("free", 1), ("add", 0, 28, 0), ("free", 2), ("free", 0),
        ("add", 0, 16, 0), ("free", 3), ("add", 0, 42, 0), ("free", 4), ("add", 2, 47, 0), ("free", 5),
        ("add", 1, 24, 1), ("free", 6), ("add", 1, 39, 5), ("free", 7), ("add", 0, 11, 8), ("free", 8),
        ("add", 1, 35, 2), ("free", 9), ("add", 1, 21, 3), ("free", 10), ("add", 0, 30, 7),
        ("add", 2, 28, 5), ("free", 12), ("add", 1, 6, 6), ("add", 2, 31, 4), ("append", 11, [1, 1])],
    # the free queue's order differed
    "free_queue": [
        ("add", 0, 28, 0), ("free", 0), ("add", 0, 42, 0), ("free", 1), ("add", 2, 47, 0), ("free", 2),
        ("add", 0, 8, 0), ("add", 0, 31, 0), ("free", 4)],
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_checkpoint_machine_example(name):
    machine = CheckpointMachine()
    machine.setup()
    rids = []
    for step in EXAMPLES[name]:
        if step[0] == "add":
            rids.append(machine.add_known_prefix(pre=step[1], cut=step[2], tail=step[3]))
        elif step[0] == "free":
            machine.free(rid=rids[step[1]])
        else:
            machine.append(rid=rids[step[1]], toks=step[2])
        machine.consistent()
        machine.same_events()
        machine.same_hits()
        machine.same_tables_and_free_queue()
