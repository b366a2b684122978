"""``uncache_blocks`` on blocks live requests hold (vLLM's ``evict_blocks``: KV a
connector failed to load), then those requests go on: ``check_invariants()`` holds
after every call, and no admission ever hits a block whose KV the model marks invalid
(the uncached blocks and, as the engine computed them on top, the request's blocks after
them)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager

BS = 4


def test_a_live_requests_uncached_block_keeps_the_invariants_and_is_not_found():
    m = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True)
    m.add_request("gone", list(range(9)))
    m.free("gone")
    m.add_request("a", list(range(10)))  # hits gone's two cached blocks: (0, 1, 2)
    m.uncache_blocks([1])  # before: InvariantError, request 'a' block 1 does not hold its content
    m.check_invariants()
    assert m.lookup(list(range(10))) == 4
    m.append_tokens("a", [10, 11, 12, 13, 14, 15, 16])  # blocks 2, 3 fill and are stored
    m.check_invariants()
    assert m.fork("a", "a2") is not None
    m.check_invariants()
    assert m.lookup(list(range(17))) == 4  # past the uncached block nothing is found
    m.preempt("a")
    m.free("a2")
    m.check_invariants()
    assert m.num_free_blocks == 16


PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


@settings(max_examples=50, deadline=None)
@given(prompts=st.lists(PROMPTS, min_size=2, max_size=5), data=st.data())
def test_requests_go_on_after_their_blocks_are_uncached_and_no_hit_is_invalid(prompts, data):
    m = KVCacheManager(12, BS, hash_mode="sha256", enable_events=True)
    valid: dict[int, tuple[int, ...]] = {}  # block id -> the prefix whose last block's KV it holds
    live: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        hit_ids = m.lookup_block_ids(prompt)
        for j, b in enumerate(hit_ids):
            assert valid.get(b) == tuple(prompt[:(j + 1) * BS]), f"a hit on invalid KV: block {b}"
        adm = m.add_request(rid, prompt)
        m.check_invariants()
        if adm is None:
            continue
        live[rid] = list(prompt)
        for j in range(adm.num_cached_tokens // BS, len(prompt) // BS):
            valid[adm.block_ids[j]] = tuple(prompt[:(j + 1) * BS])
        ids = m.get_block_ids(rid)
        full = len(prompt) // BS
        if full and data.draw(st.booleans()):  # a load into one of its blocks failed
            j = data.draw(st.integers(0, full - 1))
            m.uncache_blocks([ids[j]])
            for b in ids[j:full]:  # it and what was computed on top of it
                valid.pop(b, None)
            m.check_invariants()
        for other in list(live):
            op = data.draw(st.sampled_from(["keep", "grow", "free"]))
            if op == "grow":
                toks = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=5))
                before = m.num_scheduled_tokens(other)
                if m.append_tokens(other, toks) is not None:
                    live[other] += toks
                    ids = m.get_block_ids(other)
                    first = before // BS
                    broken = any(ids[k] not in valid for k in range(first))
                    for k in range(first, len(live[other]) // BS):  # computed now, on top of ids[:k]
                        if broken:
                            valid.pop(ids[k], None)
                        else:
                            valid[ids[k]] = tuple(live[other][:(k + 1) * BS])
            elif op == "free":
                m.free(other)
                del live[other]
            m.check_invariants()
