"""The core's lookahead keys (``core/lookahead.py``: vLLM 0.33's ``num_hash_lookahead_tokens``)
against the reference (tests/lookahead_model.py), driven as vLLM's plug-in would drive it:
a request's tokens known (prompt, then sampled ones) and computed (the steps that ran),
its blocks keyed up to ``min(computed, known - L)`` (scheduled, in prefixkv's terms; the
rest reserved), the caching vLLM's ``allocate_slots`` does.

After every rule: ``check_invariants()``; the hit of every prompt asked equals the
reference's (a large pool: nothing is evicted, so the reference's cached set is the
core's); trust: every block an admission serves holds KV computed from the reader's own
tokens, the ``L`` after the block included (``KVModel``). A second machine with a small
pool (blocks evicted) checks trust and that a hit is never longer than the reference's.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lookahead_model import KVModel, LookaheadModel
from machine_rules import case, prompts_over
from prefixkv.core.lookahead import LookaheadKVCacheManager
from prefixkv.errors import ConfigError, RequestError

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
            [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 1, 2, 3, 4]]
PROMPTS = prompts_over(PREFIXES, 3, 8)


class LookaheadMachine(RuleBasedStateMachine):
    """A lookahead manager and the reference side by side (module docstring)."""

    num_blocks = 4096  # (never short, nothing evicted)

    @initialize(bs=st.integers(2, 4), lookahead=st.integers(1, 5))
    def setup(self, bs, lookahead):
        self.bs, self.L = bs, lookahead
        self.m = LookaheadKVCacheManager(self.num_blocks, bs, hash_lookahead_tokens=lookahead)
        self.model = LookaheadModel(bs, lookahead)
        self.kv = KVModel(bs, lookahead)
        self.reqs: dict[int, tuple[list[int], int]] = {}  # id: (tokens known, computed)
        self.next_id = 0

    def _keyed(self, tokens, computed):
        return max(0, min(computed, len(tokens) - self.L))

    def _cache(self, rid):
        """The reference's caching at an ``allocate_slots`` of ``rid``; KV written."""
        tokens, computed = self.reqs[rid]
        for i, key in self.model.allocate(tokens, computed):
            self.kv.write(key, tokens, i, computed)

    @rule(prompt=PROMPTS, chunk=st.integers(1, 30), read=st.booleans())
    def admit(self, prompt, chunk, read):
        rid = self.next_id
        self.next_id += 1
        hit = self.m.lookup(prompt) if read else 0
        if read:
            self._check_hit(prompt, hit)
        computed = min(len(prompt), hit + chunk)
        scheduled = max(hit + 1, self._keyed(prompt, computed))
        adm = self.m.add_request(rid, prompt, num_new_tokens=scheduled - hit, read_cache=read,
                                 num_lookahead_tokens=computed - scheduled if computed > scheduled else 0)
        if adm is None:  # (the small pool's machine)
            return
        assert adm.num_cached_tokens == hit
        for i in range(hit // self.bs):  # trust: what the hit serves
            assert self.kv.served_rightly(self.model.key(prompt, i), prompt, i), (prompt, i)
        self.reqs[rid] = (list(prompt), computed)
        self._cache(rid)

    def _check_hit(self, prompt, hit):
        assert hit == self.model.hit(prompt), (prompt, hit, self.model.hit(prompt))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 12))
    def step(self, data, n):
        """A step computes up to ``n`` more known tokens; the blocks whose lookahead is
        known are keyed."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, computed = self.reqs[rid]
        computed = min(len(tokens), computed + n)
        self.reqs[rid] = (tokens, computed)
        want = self._keyed(tokens, computed)
        have = self.m.num_scheduled_tokens(rid)
        if want > have:
            if self.m.extend(rid, want - have) is None:
                return
        self._cache(rid)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def sample(self, data, new):
        """Sampled tokens become known (after the step that computed every known one)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, computed = self.reqs[rid]
        if computed < len(tokens):
            return
        self.m.add_tokens(rid, new)
        self.reqs[rid] = (tokens + new, computed)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.m.free(rid)
        del self.reqs[rid]

    @rule(prompt=PROMPTS)
    def probe(self, prompt):
        self._check_hit(prompt, self.m.lookup(prompt))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def probe_live(self, data):
        """A live request's own tokens, whole and cut."""
        tokens, _ = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        cut = data.draw(st.integers(1, len(tokens)))
        self._check_hit(tokens[:cut], self.m.lookup(tokens[:cut]))

    @invariant()
    def sound(self):
        if hasattr(self, "m"):
            self.m.check_invariants()
            for rid, (tokens, _) in self.reqs.items():
                assert self.m.num_tokens(rid) == len(tokens)


class EvictingLookaheadMachine(LookaheadMachine):
    """The same with a pool of 20 blocks: admissions and steps fall short, blocks are
    evicted; a hit may be shorter than the reference's, never longer, and trusted."""

    num_blocks = 20

    def _check_hit(self, prompt, hit):
        assert hit <= self.model.hit(prompt), (prompt, hit, self.model.hit(prompt))


TestLookaheadMachine = case(LookaheadMachine, max_examples=60, stateful_step_count=40)
TestEvictingLookaheadMachine = case(EvictingLookaheadMachine, max_examples=40, stateful_step_count=40)


def test_a_block_is_found_only_with_its_lookahead_tokens():
    """Block 1 of a 4-token block size, computed with token 8 after it, serves a reader
    whose token 8 is the same, not one whose token 8 differs (its block 0 still hits)."""
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=1)
    m.add_request("a", list(range(10)), num_new_tokens=8)
    assert m.lookup(list(range(10))) == 8
    assert m.lookup(list(range(8)) + [99, 1]) == 4
    assert m.lookup(list(range(8))) == 4  # (block 1's lookahead token is not there)


def test_keying_a_block_before_its_lookahead_tokens_is_refused():
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=2)
    with pytest.raises(RequestError, match="lookahead"):
        m.add_request("a", list(range(9)))  # block 1 needs tokens 8 and 9
    assert m.num_free_blocks == 64 and not m.lookup(list(range(12)))
    m.add_request("a", list(range(9)), num_new_tokens=7)
    with pytest.raises(RequestError, match="lookahead"):
        m.extend("a", 2)
    m.add_tokens("a", [9])
    m.extend("a", 2)
    with pytest.raises(RequestError, match="lookahead"):
        m.append_tokens("a", [10, 11, 12])
    m.check_invariants()


@pytest.mark.parametrize("options", [{"host_blocks": 4},
                                     {"hash_mode": lambda b: b[:16], "enable_events": True}])
def test_what_lookahead_keys_do_not_offer_is_refused(options):
    with pytest.raises(ConfigError, match="lookahead"):
        LookaheadKVCacheManager(16, 4, hash_lookahead_tokens=1, **options)
    with pytest.raises(ConfigError, match="hash_lookahead_tokens"):
        LookaheadKVCacheManager(16, 4, hash_lookahead_tokens=0)
