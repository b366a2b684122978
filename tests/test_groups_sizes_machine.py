"""Hypothesis drives prefixkv's hybrid manager over layer groups of DIFFERENT block sizes
(``block_size`` a ``BlockSizes``) beside tests/sized_model.py's reference of vLLM 0.33's
manager (itself checked against vLLM's: tests/engines/test_vllm_sized_model.py).

After every call the two must hold the same block ids in every group's table (each group
at its own size, the null block where a window released), the same free queue (ids, in
order: vLLM's plain free order), give the same hit (a multiple of the lcm) with the same
blocks, refuse the same calls (a refused call changes nothing), and announce the same
keys: each ``BlockStored`` of group g under the fine hash at its blocks' last boundaries,
with the group's own ``block_size``; ``check_invariants()`` holds throughout. The EAGLE
machines peek (``peek``, vLLM's EAGLE: its hit rule and what a peeking group caches) in
every lookup and admission, and cache for it (``BlockSizes.peek``), as vLLM's manager
with ``use_eagle`` does. A request rewinds (prefixkv's ``rewind``, the reference's:
its blocks past the point lose their content, longer prefixes are forgotten) and gives
its forgotten tokens again in steps, or both refuse (ConfigError: beside Mamba, over
what a window released).
"""

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, multiple, rule

from machine_rules import LIVE, SharedRules, case, prompts_over
from prefixkv import AllBlocksCleared, BlockRemoved, BlockStored, ConfigError, ExtraKeys
from prefixkv.groups import BlockSizes, HybridKVCacheManager, full_attention, mamba, sliding_window
from prefixkv.hashing import chain, encode_tokens, make_hash_fn, token_bytes
from sized_model import SizedModel

MAX_LEN = 64  # (no request grows past it)
PREFIXES = [[1 + k % 7 for k in range(48)], [1 + k % 7 for k in range(20)] + [9] * 28,
            [9 - k % 5 for k in range(48)]]

prompts = prompts_over(PREFIXES, 9, 10)
salts = st.sampled_from([None, ExtraKeys(cache_salt="a")])


class SizedMachine(SharedRules, RuleBasedStateMachine):
    """Full attention at 4 beside a 10-token window at 8 (hash 4, lcm 8)."""

    groups = ((4, None), (8, 10))
    retained: tuple[int, ...] = ()  # per group, tokens kept below its window (default: none)
    extra_blocks = 4  # past one longest request's blocks (constant eviction)
    live = LIVE
    peek: bool | tuple[bool, ...] = False  # (the EAGLE machines': the groups that peek)
    partial = False  # (vLLM's fine-grained partial hits)
    checkpoints = False  # (vLLM's chunk-end checkpoint blocks, with partial hits)
    checkpoint_alignment: int | None = None  # (theirs, vLLM's prefill_checkpoint_alignment; None: hash)
    retention: int | None = None  # (every window's and Mamba group's: vLLM's prefix_cache_retention_interval)
    hash_size: int | None = None  # (default: BlockSizes.of's)

    @initialize()
    def setup(self):
        sizes = BlockSizes.of([b for b, _ in self.groups], self.hash_size, peek=self.peek or (),
                              partial=self.partial, checkpoints=self.checkpoints,
                              checkpoint_alignment=self.checkpoint_alignment)
        retained = self.retained or (0,) * len(self.groups)
        specs = [full_attention() if w is None else mamba(retention=self.retention) if w == "mamba" else
                 sliding_window(w, e, retention=self.retention)
                 for (_, w), e in zip(self.groups, retained, strict=True)]
        windows = any(w is not None for _, w in self.groups)
        num_blocks = sum(-(-MAX_LEN // b) for b, _ in self.groups) + windows + self.extra_blocks
        self.m = HybridKVCacheManager(specs, num_blocks, sizes, hash_mode="sha256", seed=1,
                                      enable_events=True, max_events=1 << 12)
        self.model = SizedModel(self.groups, num_blocks, sizes.hash_size, sizes.align, null=windows,
                                twins=True, peek=self.peek or None, retained=retained, partial=self.partial,
                                checkpoint=self.checkpoints, retention=self.retention,
                                ck_align=self.checkpoint_alignment)
        self.hash_fn, self.root = make_hash_fn("sha256", 1)
        self.h = sizes.hash_size
        self.names: dict[bytes, tuple] = {}  # a fine hash -> (extra, the tokens it chains over)
        self.tokens: dict[str, list[int]] = {}
        self.last = None
        self.next_id = 0

    def _name(self, tokens, extra):
        n = len(tokens) // self.h
        base = extra.base_bytes() if extra else b""
        data = token_bytes(encode_tokens(tokens[:n * self.h]))
        hashes, _ = chain(self.hash_fn, self.root, data, [base] * n)
        for i, h in enumerate(hashes):
            self.names[h] = (extra, tuple(tokens[:(i + 1) * self.h]))

    def _forget(self, rid):
        del self.tokens[rid]
        if rid in self.model.reqs:
            self.model.free_request(rid)

    def _same_hit(self, prompt, extra):
        end, ids = self.model.hit(prompt, extra)
        assert self.m.lookup(prompt, extra=extra, peek=self.peek) == end, (prompt, end)
        got = self.m.lookup_block_ids(prompt, extra=extra, peek=self.peek)
        assert [list(g) for g in got] == ids, (prompt, ids)
        return end

    # ---- rules -------------------------------------------------------------------

    @rule(target=live, prompt=prompts, extra=salts, chunk=st.none() | st.integers(1, 30))
    def add(self, prompt, extra, chunk):
        rid = self._new_id()
        end = self._same_hit(prompt, extra)
        n = len(prompt) - end if chunk is None else min(chunk, len(prompt) - end)
        junction = self._junction(prompt, extra, end)
        adm = self.m.add_request(rid, prompt, extra=extra, num_new_tokens=n, peek=self.peek,
                                 junction=junction)
        want = self.model.add(rid, prompt, extra, n)
        assert (adm is None) == (want is None), (adm, want)
        if adm is None:
            return multiple()
        assert adm.num_cached_tokens == end and adm.num_new_tokens == n
        assert [list(g) for g in adm.group_block_ids] == self.model.reqs[rid].tables
        self.tokens[rid] = list(prompt)
        self._name(prompt, extra)
        return rid

    def _junction(self, prompt, extra, end):
        """With a retention or checkpoints, vLLM's shared-prefix junction as the vLLM
        plug-in finds it (the first full-attention group's own hit, ``lookup_per_group``,
        rounded down to the lcm, or the hash block with partial hits, when longer than
        the hit ``end``), the reference's; else 0."""
        if self.retention is None and not self.checkpoints:
            return 0
        first = next(g for g, (_, w) in enumerate(self.groups) if w is None)
        unit = self.h if self.partial else self.m.block_size
        alone = self.m.lookup_per_group(prompt, extra=extra)[first] // unit * unit
        junction = alone if alone > end else 0
        assert junction == self.model.junction(prompt, extra, end), (prompt, junction)
        return junction

    @rule(target=live, pre=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 48), tail=st.integers(0, 9))
    def add_known_prefix(self, pre, cut, tail):
        return self.add(PREFIXES[pre][:cut] + [tail], None, None)

    @rule(rid=live, n=st.integers(1, 30))
    def extend(self, rid, n):
        if rid not in self.tokens:
            return
        r = self.model.reqs[rid]
        n = min(n, len(r.tokens) - r.computed)
        if not n:
            return
        got = self.m.extend(rid, n)
        assert (got is not None) == self.model.grow(rid, n), got

    @rule(rid=live)
    def extend_to_tail(self, rid):
        """A chunk ending at the prompt's last hash boundary before its last token (where
        vLLM's partial hits cache a Mamba state inside its block)."""
        if rid in self.tokens:
            r = self.model.reqs[rid]
            tail = (r.prompt - 1) // self.h * self.h
            if tail > r.computed:
                self.extend(rid, tail - r.computed)

    @rule(target=live, rid=live, more=st.lists(st.integers(0, 9), min_size=1, max_size=9),
          chunk=st.none() | st.integers(1, 12))
    def add_sibling(self, rid, more, chunk):
        """A prompt sharing a live request's tokens up to its prompt's last hash boundary
        (a partial hit there, with partial hits)."""
        if rid not in self.tokens:
            return multiple()
        r = self.model.reqs[rid]
        return self.add(r.tokens[:(r.prompt - 1) // self.h * self.h] + more, r.extra, chunk)

    @rule(rid=live, toks=st.lists(st.integers(0, 9), min_size=1, max_size=12))
    def append(self, rid, toks):
        if rid not in self.tokens:
            return
        r = self.model.reqs[rid]
        if r.computed != len(r.tokens) or len(r.tokens) + len(toks) > MAX_LEN:
            return
        got = self.m.append_tokens(rid, toks)
        assert (got is not None) == self.model.grow(rid, len(toks), toks), got
        if got is not None:
            self.tokens[rid] += toks
            self._name(self.tokens[rid], r.extra)

    @rule(rid=live, back=st.integers(0, 24), cuts=st.lists(st.integers(1, 12), max_size=3),
          other=st.none() | st.lists(st.integers(0, 9), max_size=6))
    def rewind(self, rid, back, cuts, other=None):
        # back ``back`` tokens (a load whose last token vLLM recomputes, a failed load),
        # then the tokens it forgot given again in steps of ``cuts`` (the rest last):
        # prefixkv's rewind (tests/sized_model.py), or the same ConfigError refusal;
        # with ``other``, drafted tokens rejected: only the pinned ones (in blocks
        # another request shares, pins.py) are given again, then ``other`` (empty: the
        # request waits, its tables longer than its tokens)
        if rid not in self.tokens:
            return
        r = self.model.reqs[rid]
        p = max(0, r.computed - back)
        gone, owed = r.tokens[p:], r.computed - p  # (owed: those it had scheduled)
        if other is not None:
            owed = self._pinned(r, p) - p
            gone = gone[:owed] + other
        if not self.model.rewind(rid, p):
            with pytest.raises(ConfigError):
                self.m.rewind(rid, p)
            return
        self.m.rewind(rid, p)
        self.tokens[rid] = self.tokens[rid][:p]
        self.m.check_invariants()
        self.same_tables_and_free_queue()
        # (the scheduled ones first, in the cuts, up to ``owed``: the tables cover them,
        # and those in blocks another request shares are pinned (pins.py); then the
        # prompt's unscheduled rest, which may find no room)
        steps = []
        for cut in [*cuts, owed]:
            if sum(steps) < owed:
                steps.append(min(cut, owed - sum(steps)))
        for cut in [*steps, len(gone)]:
            toks, gone = gone[:cut], gone[cut:]
            if not toks:
                break
            got = self.m.append_tokens(rid, toks)
            assert (got is not None) == self.model.grow(rid, len(toks), toks), got
            if got is None:
                break
            self.tokens[rid] += toks
            self._name(self.tokens[rid], r.extra)
            self.m.check_invariants()

    def _pinned(self, r, p):
        """The end of the last whole block of ``r`` from ``p`` on that another request
        holds too, over the groups (pins.py ``_shared_end``); ``p`` when none."""
        end = p
        for (b, _), ids in zip(self.groups, r.tables, strict=True):
            for j in range(p // b, r.computed // b):
                if ids[j] != self.model.null and self.model.refs[ids[j]] > 1:
                    end = max(end, (j + 1) * b)
        return end

    @rule()
    def run_copies(self):
        """The copies on write queued (none without partial hits) run; their blocks go back."""
        ops = self.m.take_kv_ops()
        want = self.model.take_copies()
        assert [(c.src, c.dst) for c in ops] == want
        if ops:
            self.m.release_copies(ops)
            self.model.release([x for pair in want for x in pair])

    @rule()
    def reset(self):
        assert self.m.reset_prefix_cache() == self.model.reset()

    # ---- invariants --------------------------------------------------------------

    @invariant()
    def same_tables_and_free_queue(self):
        for rid in self.tokens:
            assert [list(g) for g in self.m.get_block_ids(rid)] == self.model.reqs[rid].tables, rid
        assert self.m.free_block_order() == list(self.model.free)
        assert self.m.num_free_blocks == len(self.model.free)

    @invariant()
    def same_events(self):
        got = []
        for ev in self.m.take_events():
            if isinstance(ev, AllBlocksCleared):
                got.append(("cleared",))
                continue
            assert isinstance(ev, BlockStored | BlockRemoved), ev
            if isinstance(ev, BlockStored):  # (a partial tail entry: one hash block)
                tail = len(self.names[ev.block_hashes[0]][1]) % self.groups[ev.group_idx][0]
                assert ev.block_size == (self.h if tail else self.groups[ev.group_idx][0]), ev
            kind = "stored" if isinstance(ev, BlockStored) else "removed"
            got += [(kind, (ev.group_idx, *self.names[h])) for h in ev.block_hashes]
        want, self.model.events = self.model.events, []
        assert Counter(got) == Counter(want), (got, want)

    @invariant()
    def same_hits(self):
        for prompt in PREFIXES:
            self._same_hit(prompt, None)
        for rid, tokens in self.tokens.items():
            self._same_hit(tokens + [0], self.model.reqs[rid].extra)


class WindowsBesideFullMachine(SizedMachine):
    """A 6-token window at 4, full attention at 8, an 18-token window at 16 (lcm 16)."""

    groups = ((4, 6), (8, None), (16, 18))
    extra_blocks = 6


class RetentionMachine(SizedMachine):
    """WindowsBesideFullMachine's groups, each window caching only the blocks a hit
    reads at the replay boundary and the shared-prefix junction (vLLM's
    ``prefix_cache_retention_interval=0``)."""

    groups = ((4, 6), (8, None), (16, 18))
    extra_blocks = 6
    retention = 0


class RetentionSegmentsMachine(SizedMachine):
    """A 10-token window at 8 beside full attention at 4 (lcm 8), caching the blocks a
    hit reads every 32 tokens besides the marks (vLLM's retention interval 32)."""

    groups = ((8, 10), (4, None))
    extra_blocks = 3
    retention = 32


class RetainedMachine(SizedMachine):
    """WindowsBesideFullMachine's groups, each window keeping tokens below it (vLLM's
    ``extra_retained_tokens``): 5 at 4, 7 at 16."""

    groups = ((4, 6), (8, None), (16, 18))
    retained = (5, 0, 7)
    extra_blocks = 6


class LcmOfNeitherMachine(SizedMachine):
    """A 10-token window at 8 beside full attention at 12: hash 4, lcm 24."""

    groups = ((8, 10), (12, None))
    extra_blocks = 3


class FullOnlyMachine(SizedMachine):
    """Full attention at 4 and at 12: no group releases, no null block."""

    groups = ((4, None), (12, None))
    extra_blocks = 2


class MambaBesideFullMachine(SizedMachine):
    """Full attention at 8 beside Mamba at 4 (hash 4, lcm 8): a Mamba state cached at
    every block end a step reaches, hits only at multiples of 8."""

    groups = ((8, None), (4, "mamba"))
    extra_blocks = 3


class MambaBesideWindowMachine(SizedMachine):
    """A 10-token window at 8, full attention at 4, Mamba at 8 (hash 4, lcm 8; vLLM's
    fine-grained partial hits are off beside such a window)."""

    groups = ((8, 10), (4, None), (8, "mamba"))
    extra_blocks = 3
class PartialMachine(SizedMachine):
    """Full attention at 4 beside Mamba at 8 (hash 4): vLLM's fine-grained partial hits,
    a Mamba state found inside its block and copied on write."""

    groups = ((4, None), (8, "mamba"))
    extra_blocks = 4
    partial = True


class PartialWideMachine(SizedMachine):
    """Mamba at 12 and at 12 beside full attention at 4 (hash 4): partial hits two hash
    blocks deep into a Mamba block, two Mamba groups copied on write together."""

    groups = ((12, "mamba"), (4, None), (12, "mamba"))
    extra_blocks = 5
    partial = True


class Junctions:
    """A rule of the checkpoint machines: a prompt's first chunk ends just past its
    junction (vLLM's ``shared_prefix_boundary``), so that it checkpoints there (which
    vLLM then caches, transient or not: groups/checkpoints.py)."""

    @rule(target=LIVE, pre=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 48),
          more=st.lists(st.integers(0, 9), max_size=20), over=st.integers(1, 4))
    def add_past_junction(self, pre, cut, more, over):
        prompt = PREFIXES[pre][:cut] + more + [0]
        end = self.model.hit(prompt, None)[0]
        junction = self.model.junction(prompt, None, end)
        return self.add(prompt, None, junction - end + over if junction else None)


class CheckpointMachine(Junctions, PartialMachine):
    """``PartialMachine`` with a chunk-end checkpoint block (groups/checkpoints.py)."""

    checkpoints = True


class CheckpointWideMachine(Junctions, PartialWideMachine):
    """``PartialWideMachine`` with chunk-end checkpoint blocks, two Mamba groups each."""

    checkpoints = True
    extra_blocks = 7


class CheckpointAlignedMachine(Junctions, PartialWideMachine):
    """``CheckpointWideMachine`` with checkpoints two hash blocks apart from a step's
    start (vLLM's ``prefill_checkpoint_alignment`` 8 beside hash blocks of 4)."""

    checkpoints = True
    checkpoint_alignment = 8
    extra_blocks = 7


class EagleWindowMachine(SizedMachine):
    """EAGLE on a 14-token window at 4 beside full attention at 8, which does not peek
    (hash 4, lcm 8): vLLM's layout of a draft model's window group (a peeking hit needs 5
    cached blocks of the window, or a run from block 0: then it falls a span lower)."""

    groups = ((8, None), (4, 14))
    extra_blocks = 4
    peek = (False, True)


class EagleEveryGroupMachine(SizedMachine):
    """EAGLE on full attention at 4 and a 10-token window at 8 (hash 4, lcm 8)."""

    peek = (True, True)


class EagleFullMachine(SizedMachine):
    """EAGLE on full attention at 4 beside full attention at 12, which does not peek
    (lcm 12: a peeking run drops its block and falls to the span below)."""

    groups = ((4, None), (12, None))
    extra_blocks = 3
    peek = (True, False)


TestSizedMachine = case(SizedMachine, max_examples=60, stateful_step_count=40)
TestWindowsBesideFullMachine = case(WindowsBesideFullMachine, max_examples=60, stateful_step_count=40)
TestRetentionMachine = case(RetentionMachine, max_examples=60, stateful_step_count=40)
TestRetentionSegmentsMachine = case(RetentionSegmentsMachine, max_examples=60, stateful_step_count=40)
TestRetainedMachine = case(RetainedMachine, max_examples=60, stateful_step_count=40)
TestLcmOfNeitherMachine = case(LcmOfNeitherMachine, max_examples=60, stateful_step_count=40)
TestFullOnlyMachine = case(FullOnlyMachine, max_examples=60, stateful_step_count=40)
TestMambaBesideFullMachine = case(MambaBesideFullMachine, max_examples=60, stateful_step_count=40)
TestMambaBesideWindowMachine = case(MambaBesideWindowMachine, max_examples=60, stateful_step_count=40)
TestEagleWindowMachine = case(EagleWindowMachine, max_examples=60, stateful_step_count=40)
TestEagleEveryGroupMachine = case(EagleEveryGroupMachine, max_examples=60, stateful_step_count=40)
TestEagleFullMachine = case(EagleFullMachine, max_examples=60, stateful_step_count=40)
TestPartialMachine = case(PartialMachine, max_examples=60, stateful_step_count=40)
TestPartialWideMachine = case(PartialWideMachine, max_examples=60, stateful_step_count=40)
TestCheckpointMachine = case(CheckpointMachine, max_examples=60, stateful_step_count=40)
TestCheckpointWideMachine = case(CheckpointWideMachine, max_examples=60, stateful_step_count=40)
TestCheckpointAlignedMachine = case(CheckpointAlignedMachine, max_examples=60, stateful_step_count=40)
