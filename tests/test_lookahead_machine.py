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
Both also fork, rewind (tokens stay known: a key never changes) and take decode steps
(``append_step``, refused by name when a token would key a block before its lookahead).
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lookahead_model import KVModel, LookaheadModel
from machine_rules import case, prompts_over
from prefixkv import KVCacheManager
from prefixkv.core.lookahead import LookaheadKVCacheManager
from prefixkv.errors import ConfigError, RequestError

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
            [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 1, 2, 3, 4]]
PROMPTS = prompts_over(PREFIXES, 3, 8)


class LookaheadMachine(RuleBasedStateMachine):
    """A lookahead manager and the reference side by side (module docstring)."""

    num_blocks = 4096  # (never short, nothing evicted)
    options: dict = {}  # (the manager's other options: test_lookahead_events turns events on)

    @initialize(bs=st.integers(2, 4), lookahead=st.integers(1, 5))
    def setup(self, bs, lookahead):
        self.bs, self.L = bs, lookahead
        self.m = LookaheadKVCacheManager(self.num_blocks, bs, hash_lookahead_tokens=lookahead,
                                         **self.options)
        self.model = LookaheadModel(bs, lookahead)
        self.kv = KVModel(bs, lookahead)
        self.reqs: dict[int, tuple[list[int], int]] = {}  # id: (tokens known, computed)
        self.next_id = 0

    def _keyed(self, tokens, computed):
        return max(0, min(computed, len(tokens) - self.L))

    def _cache(self, rid, upto=None):
        """The reference's caching at an ``allocate_slots`` of ``rid`` (its blocks up to
        ``upto`` tokens when given, else up to those computed); KV written."""
        tokens, computed = self.reqs[rid]
        for i, key in self.model.allocate(tokens, computed if upto is None else min(computed, upto)):
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
    def schedule_tail(self, data):
        self._make_whole(data.draw(st.sampled_from(sorted(self.reqs))))

    def _make_whole(self, rid):
        """Every known token computed and scheduled, when the last ones fill no block
        (the core allows it: no block is keyed without its lookahead); whether it is."""
        tokens, _ = self.reqs[rid]
        n, have = len(tokens), self.m.num_scheduled_tokens(rid)
        if n // self.bs > max(0, n - self.L) // self.bs:
            return False
        if have < n and self.m.extend(rid, n - have) is None:
            return False
        self.reqs[rid] = (tokens, n)
        self._cache(rid)
        return True

    def _whole(self):
        """The live requests whose known tokens are all computed and scheduled (made so
        where the core allows it)."""
        return [r for r in sorted(self.reqs) if self._make_whole(r)]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        """A child shares the parent's full blocks (its tokens, its keys)."""
        whole = self._whole()
        if not whole:
            return
        parent = data.draw(st.sampled_from(whole))
        rid = self.next_id
        self.next_id += 1
        if self.m.fork(parent, rid) is None:  # (the small pool's machine)
            return
        self.m.take_kv_ops()  # (the step's copies run: their sources are held until then)
        tokens, computed = self.reqs[parent]
        full = computed // self.bs
        assert self.m.get_block_ids(rid)[:full] == self.m.get_block_ids(parent)[:full]
        self.reqs[rid] = (list(tokens), computed)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def append_step(self, data):
        """A decode step of one token each; refused (RequestError, nothing changed) when
        a request's token would schedule a block whose lookahead is not known."""
        whole = self._whole()
        if not whole:
            return
        rids = data.draw(st.lists(st.sampled_from(whole), min_size=1, unique=True))
        new = data.draw(st.lists(st.integers(0, 3), min_size=len(rids), max_size=len(rids)))
        ends = {r: len(self.reqs[r][0]) + 1 for r in rids}
        early = [r for r in rids if ends[r] // self.bs > max(0, ends[r] - self.L) // self.bs]
        before = {r: (self.m.num_tokens(r), self.m.num_scheduled_tokens(r)) for r in rids}
        if early:
            with pytest.raises(RequestError, match="lookahead"):
                self.m.append_step(rids, new)
            assert before == {r: (self.m.num_tokens(r), self.m.num_scheduled_tokens(r)) for r in rids}
            return
        got = self.m.append_step(rids, new)
        for rid, t in zip(rids, new, strict=True):
            if rid not in got.short:
                tokens, _ = self.reqs[rid]
                self.reqs[rid] = (tokens + [t], len(tokens) + 1)
                self._cache(rid)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def rewind(self, data):
        """The request set back to ``back`` scheduled tokens (its tokens stay known): its
        full blocks from there (and their cached descendants) leave the cache, their KV
        to be computed again; refused while another request holds one of them."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, _ = self.reqs[rid]
        have = self.m.num_scheduled_tokens(rid)
        back = data.draw(st.integers(0, have))
        mine = self.m.get_block_ids(rid)[back // self.bs:have // self.bs]
        others = {b for r in self.reqs if r != rid for b in self.m.get_block_ids(r)}
        if others.intersection(mine):
            with pytest.raises(RequestError, match="held by other requests"):
                self.m.rewind(rid, back)
            assert self.m.num_scheduled_tokens(rid) == have
            return
        # the keys whose cached block is this request's (another block of equal content,
        # computed beside it, leaves the key cached) leave the cache, with their descendants
        ids = self.m.get_block_ids(rid)
        gone = [self.model.key(tokens, i) for i in range(back // self.bs, have // self.bs)
                if self.m.cached_block_id(tokens, (i + 1) * self.bs) == ids[i]]
        self.m.rewind(rid, back)
        for key in gone:
            if key is not None:
                self.model.cached.discard(key)
                self.kv.written.pop(key, None)
        self.reqs[rid] = (tokens, back)
        for other in self.reqs:  # (a block of equal content another request computed
            # serves the key again, as in vLLM's hash-to-blocks map; up to the tokens that
            # request scheduled: one computed in a lookahead slot whose lookahead tokens
            # became known since is keyed at its next step, as vLLM caches it at its next
            # allocate_slots; found with --hypothesis-seed=4242)
            self._cache(other, self.m.num_scheduled_tokens(other))
        # the descendants of a key that left go with it; those of a key another block of
        # equal content serves again stay (their blocks are other requests', their content
        # their own tokens': found by a random run in session 29, a twin computed by a
        # request admitted with read_cache=False)
        left = [k for k in gone if k is not None and k not in self.model.cached]
        for key in list(self.model.cached):
            if any(key[:len(k)] == k for k in left):
                self.model.cached.discard(key)
                self.kv.written.pop(key, None)

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


def test_a_rewind_into_a_blocks_lookahead_keeps_its_key():
    """A rewind takes back scheduled tokens, never known ones: block 0 (4 tokens, keyed
    with tokens 4 and 5 after it) stays cached when the request goes back to 5 tokens,
    found only by a reader whose tokens 4 and 5 are the same; block 1 leaves the cache
    and is keyed again, with the same tokens, once scheduled again."""
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=2)
    tokens = list(range(12))
    m.add_request("a", tokens, num_new_tokens=10)
    assert m.lookup(tokens) == 8
    m.rewind("a", 5)
    assert m.num_tokens("a") == 12 and m.num_scheduled_tokens("a") == 5
    assert m.lookup(tokens) == 4
    assert m.lookup(tokens[:5] + [99] + tokens[6:]) == 0  # (another token 5: block 0 not found)
    m.extend("a", 5)
    assert m.lookup(tokens) == 8
    m.check_invariants()


def test_a_block_computed_in_a_lookahead_slot_is_keyed_at_the_next_step():
    """The machine's example under --hypothesis-seed=4242 (its reference over-cached after
    a rewind of another request): a block whose last token was computed in a lookahead
    slot is findable once its lookahead token is known AND a step schedules it (vLLM
    caches it at its next ``allocate_slots``), not when the token becomes known."""
    m = LookaheadKVCacheManager(64, 2, hash_lookahead_tokens=1)
    m.add_request(0, [0], num_new_tokens=1, read_cache=False)
    m.add_request(1, [0, 0], num_new_tokens=1, read_cache=False, num_lookahead_tokens=1)
    m.add_tokens(1, [0, 0])  # (its block 0's lookahead token is known now)
    m.rewind(0, 0)  # (another request's rewind keys nothing of request 1's)
    assert m.lookup([0, 0, 0]) == 0
    assert m.extend(1, 1) is not None  # (the next step schedules the slot's token)
    assert m.lookup([0, 0, 0]) == 2
    m.check_invariants()


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_rewind_keeps_the_descendants_of_a_key_a_twin_serves(lookahead):
    """Request 3 hit block [1,2] that request 2 computed; request 4, reading no cache,
    computed a twin of it. 3's rewind to 0 recomputes into that block: its key moves to
    the twin, and the blocks request 2 computed after it ([3,4], [5,6], [9,9]), whose
    content is their own tokens', stay found (the machine's reference dropped them: found
    by a random run in session 29; the plain manager keeps them too)."""
    m = LookaheadKVCacheManager(100, 2, hash_lookahead_tokens=1) if lookahead else KVCacheManager(100, 2)
    a = [1, 2, 3, 4, 5, 6, 9, 9, 9]
    m.add_request("2", a, num_new_tokens=8)
    m.free("2")
    m.add_request("3", [1, 2, 3, 7], num_new_tokens=1)
    m.add_request("4", [1, 2, 3], num_new_tokens=3, read_cache=False)
    assert m.get_block_ids("3") == (0, 4) and m.get_block_ids("4") == (5, 6)
    assert m.lookup(a) == 8 and m.cached_block_id(a, 2) == 0
    m.rewind("3", 0)
    assert m.cached_block_id(a, 2) == 5  # (the twin)
    assert m.lookup(a) == 8
    m.check_invariants()
