"""A store start whose eviction loses contents (every host slot pinned) while a pinned
slot is under one of them: ``SlotOffload._withdraw_orphans`` withdraws that slot, and
finds the lost contents by id (``Keyless.among``), not by reading each block of the
pending run it evicts (``Keyless.content`` per block: 4.5 ms at 8,192 blocks,
results/store25-r27.md section 9). Twin managers over one store, one as shipped, one
whose tier reads the lost blocks one by one (the reading before, below), run
``store_pair.py``'s cycle (start, fetch, landing, re-admission, free, step) on four
prompts of ``n`` blocks: the same answers, plans, host slots and free order after every
call, the same contents withdrawn, and no block read alone while withdrawing. Block
size 4, 8-byte payloads, fetches run when the test says."""

import types

import pytest

from prefixkv import KVCacheManager, StoreWait
from prefixkv.core.block import key_chunk
from prefixkv.core.keyless import Keyless
from prefixkv.store import SharedStore
from prefixkv.tiers.host import HostTier
from waiting import LIVE

from .conftest import always
from .test_shared_store import computed
from .test_store_fetch import Manual


def per_block(self, blocks, at, step, keyless, under):
    """``_withdraw_orphans`` reading ``blocks[at:]`` one by one (a pending run's block
    through ``Keyless.content``): the lost contents it finds, then the shipped call's
    withdrawal of them (handed the found ids, which it looks up again)."""
    found = set()
    for i in range(at, len(blocks)):
        b = blocks[i]
        if b.step >= step:
            continue
        if b.key is not None:
            content = (b.parent_cid, key_chunk(b.key), b.extra, b.content_id)
        elif keyless is not None:
            content = keyless.content(i)
        else:
            continue
        if content[3] in under and self.find(*content[:3]) is None:
            found.add(content[3])
    if found:
        HostTier._withdraw_orphans(self, blocks, at, step, keyless, found)


def prompt_of(n, salt):
    return [(i * 7919 + salt * 104729) % 50000 + 1 for i in range(4 * n + 1)]


def state(m):
    host = m._host
    return ([(s.block_id, s.key, s.refs, s.parent_cid) for s in host.slots],
            m._pool.free_order(), m.num_free_blocks, host.num_free)


@pytest.mark.parametrize("n", [3, 8, 21])
def test_a_lost_runs_orphans_are_found_by_id_as_block_by_block(backend, layout, monkeypatch, n):
    prompts = [prompt_of(n, 7000 + r) for r in range(4)]
    for r, ids in enumerate(prompts):
        computed(KVCacheManager(n + 2, 4, hash_mode="sha256", host_blocks=1,
                                store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
                 backend, f"w{r}", ids)
    withdrawing, read_alone, gone = [False], [0], []
    content, withdraw, under = Keyless.content, HostTier._withdraw_orphans, HostTier.withdraw_under

    def spy_content(self, i):
        read_alone[0] += withdrawing[0]
        return content(self, i)

    def spy_withdraw(self, *args):
        withdrawing[0] = True
        try:
            return withdraw(self, *args)
        finally:
            withdrawing[0] = False

    def spy_under(self, ids):
        gone.append((self, sorted(ids)))
        return under(self, ids)

    monkeypatch.setattr(Keyless, "content", spy_content)
    monkeypatch.setattr(HostTier, "_withdraw_orphans", spy_withdraw)
    monkeypatch.setattr(HostTier, "withdraw_under", spy_under)
    sides = []
    for reference in (False, True):
        ex = Manual()
        m = KVCacheManager(2 * n + 2, 4, hash_mode="sha256", host_blocks=n + 1, store=SharedStore(
            backend, layout, max_fetch=n, cost=always(), timeout=LIVE, executor=ex))
        if reference:
            m._host._withdraw_orphans = types.MethodType(per_block, m._host)
        sides.append((m, ex))
    (new, _), (ref, _) = sides
    for r in range(10):
        prompt = prompts[r % 4]
        out = []
        for m, ex in sides:
            calls = [m.add_request("r", prompt), m.take_kv_ops(), ex.run(), m.poll_store()]
            calls.append(state(m))
            calls += [m.add_request("r", prompt), m.take_kv_ops(), m.free("r"), m.take_kv_ops()]
            calls.append(state(m))
            assert isinstance(calls[0], StoreWait)
            m.check_invariants()
            out.append(calls)
        assert out[0] == out[1], r
    assert read_alone == [0]  # (the shipped side's: the reference reads outside the spy)
    news = [ids for tier, ids in gone if tier is new._host]
    assert news and news == [ids for tier, ids in gone if tier is ref._host]  # (withdrawn)
