"""``uncache_blocks`` on blocks live requests hold (vLLM's ``evict_blocks``: KV a
connector failed to load), then those requests go on: ``check_invariants()`` holds
after every call, and no admission ever hits a block whose KV the model marks invalid
(the uncached blocks and, as the engine computed them on top, the request's blocks after
them)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import BlockLoads, BlockOffloads, KVCacheManager
from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window
from test_index import Mirror

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



def test_a_block_no_request_holds_is_left_as_it_is():
    # (mutants-r22: ``ref_cnt >= 0`` in the held filter took free cached blocks too, and
    # left them keyless in the cached tier: InvariantError)
    m = KVCacheManager(8, BS)
    prompt = list(range(1, 10))
    a = m.add_request("a", prompt)
    m.free("a")
    before = m.free_block_order()
    assert before == [2, 3, 4, 5, 6, 7, 1, 0]
    m.uncache_blocks([a.block_ids[0], a.block_ids[1], 5])  # cached and free, free and empty
    m.check_invariants()
    assert m.lookup(prompt) == 8 and m.free_block_order() == before


def test_with_a_host_tier_the_blocks_after_an_uncached_one_are_cut_off_from_it():
    # before: InvariantError, block 1 is found but its parent's content is not on the device
    m = KVCacheManager(12, BS, hash_mode="sha256", host_blocks=6)
    m.add_request("a", [0] * 8)
    m.uncache_blocks([m.get_block_ids("a")[0]])
    m.check_invariants()
    assert m.lookup([0] * 9) == 0
    m.free("a")
    m.check_invariants()
    assert m.add_request("b", [0] * 9).num_cached_tokens == 0


def test_the_hybrid_manager_uncaches_a_live_requests_blocks_in_their_group():
    # before: the hybrid manager had no uncache_blocks (vLLM's evict_blocks on a hybrid
    # model raised AttributeError in the plug-in)
    m = HybridKVCacheManager([full_attention(), sliding_window(8)], 24, BS, hash_mode="sha256",
                             enable_events=True)
    m.add_request("gone", list(range(13)))
    m.free("gone")
    m.add_request("a", list(range(13)))  # hits gone's 3 full blocks in both groups
    assert m.lookup(list(range(13))) == 12
    full_ids, window_ids = m.get_block_ids("a")
    m.uncache_blocks([*full_ids[1:3], *window_ids[1:3]])  # block 1 and after, as vLLM evicts
    m.check_invariants()
    assert m.lookup(list(range(13))) == 4
    m.append_tokens("a", [13, 14, 15])
    m.check_invariants()
    m.free("a")
    m.check_invariants()
    assert m.add_request("b", list(range(17))).num_cached_tokens == 4


PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class Plan:
    """The engine's copies (the manager's plan) on a model of the KV: block id -> the
    prefix whose last block's KV it holds, if valid; the same for host slots."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.valid: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}

    def run(self) -> None:
        for op in self.m.take_kv_ops():
            if isinstance(op, BlockOffloads):
                for src, dst in zip(op.src, op.dst, strict=True):
                    self._put(self.host, dst, self.valid.get(src))
            else:
                assert isinstance(op, BlockLoads), op
                for src, dst in zip(op.src, op.dst, strict=True):
                    self._put(self.valid, dst, self.host.get(src))

    @staticmethod
    def _put(where: dict[int, tuple[int, ...]], i: int, kv: tuple[int, ...] | None) -> None:
        if kv is None:
            where.pop(i, None)
        else:
            where[i] = kv


@settings(max_examples=50, deadline=None)
@given(host_blocks=st.sampled_from([0, 6]), prompts=st.lists(PROMPTS, min_size=2, max_size=6),
       recompute=st.booleans(), data=st.data())
def test_requests_go_on_after_their_blocks_are_uncached_and_no_hit_is_invalid(host_blocks, prompts,
                                                                              recompute, data):
    """``recompute``: the engine keeps a request whose load failed, rewinds it to the
    failed block and recomputes from there (``rewind``, ``extend``), after dropping the
    requests that hit that KV: the recomputed blocks are found again (before ``rewind``,
    never while the request lived). Every live request whose blocks all hold valid KV
    is found whole. The events describe what ``lookup`` finds, for every prompt seen
    (before: blocks computed on top of an uncached one, or cached under it, stayed
    announced, and a recomputation of it made the events count them)."""
    m = KVCacheManager(12, BS, hash_mode="sha256", enable_events=True, host_blocks=host_blocks)
    mirror = Mirror(m, "sha256", None)
    kv = Plan(m)
    live: dict[str, list[int]] = {}
    seen: set[tuple[int, ...]] = set()
    for i, prompt in enumerate(prompts):
        seen.add(tuple(prompt))
        rid = f"r{i}"
        adm = m.add_request(rid, prompt)
        m.check_invariants()
        kv.run()  # offloads, then the loads of host hits
        if adm is None:
            continue
        for j, b in enumerate(adm.block_ids[:adm.num_cached_tokens // BS]):
            assert kv.valid.get(b) == tuple(prompt[:(j + 1) * BS]), f"a hit on invalid KV: block {b}"
        live[rid] = list(prompt)
        for j in range(adm.num_cached_tokens // BS, len(prompt) // BS):
            kv.valid[adm.block_ids[j]] = tuple(prompt[:(j + 1) * BS])
        ids = m.get_block_ids(rid)
        full = len(prompt) // BS
        if full and data.draw(st.booleans()):  # a load into one of its blocks failed
            j = data.draw(st.integers(0, full - 1))
            m.uncache_blocks([ids[j]])
            for b in ids[j:full]:  # it and what was computed on top of it
                kv.valid.pop(b, None)
            m.check_invariants()
            if recompute:
                for r in [r for r in live if r != rid and set(m.get_block_ids(r)) & set(ids[j:full])]:
                    m.free(r, num_computed_tokens=j * BS)  # (they read KV never valid from j)
                    del live[r]
                m.rewind(rid, j * BS)
                assert m.extend(rid, len(prompt) - j * BS) is not None  # (the blocks are held)
                kv.run()
                for k in range(j, full):
                    kv.valid[ids[k]] = tuple(prompt[:(k + 1) * BS])
                m.check_invariants()
        for other in list(live):
            op = data.draw(st.sampled_from(["keep", "grow", "free"]))
            if op == "grow":
                toks = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=5))
                before = m.num_scheduled_tokens(other)
                if m.append_tokens(other, toks) is not None:
                    kv.run()
                    live[other] += toks
                    seen.add(tuple(live[other]))
                    ids = m.get_block_ids(other)
                    first = before // BS
                    broken = any(ids[k] not in kv.valid for k in range(first))
                    for k in range(first, len(live[other]) // BS):  # computed now, on top of ids[:k]
                        if broken:
                            kv.valid.pop(ids[k], None)
                        else:
                            kv.valid[ids[k]] = tuple(live[other][:(k + 1) * BS])
            elif op == "free":
                m.free(other)
                del live[other]
            m.check_invariants()
        for r, toks in live.items():
            held = m.get_block_ids(r)[:len(toks) // BS]
            if all(kv.valid.get(b) == tuple(toks[:(k + 1) * BS]) for k, b in enumerate(held)):
                assert m.lookup(toks + [0]) >= len(held) * BS, (r, held)
        mirror.drain()
        for toks in seen:
            assert mirror.predict([*toks, 0]) == m.lookup([*toks, 0]), toks
