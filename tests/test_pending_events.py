"""Pending runs (``index/pending.py``) with events on: a miss's run is recorded without
writing its blocks' content, its ``StoredRun`` built when the log is taken; an eviction
that takes a pending run whole (or cuts its tail) names its blocks in its
``BlockRemoved`` (their hashes set by the run's build, in log order); a snapshot (the
log's restatement after an overflow) settles every pending run first.

Four managers take the same ops: pending runs (the default), runs written as they are
stored (``pending_runs`` off), no runs at all (``runs`` off), events built as blocks are
stored (``lazy`` off: every hash computed then, as with a tier below). After every step the event
streams must be equal: event for event, and as the bytes a publisher puts on the wire
(``encode_batch``); so must the answers, the reference counts, the free order and each
request's blocks, and all four pass ``check_invariants``. The ops: admissions of long
chains sharing prefixes (list and prepared prompts, salts, multimodal inputs, chunked,
capped hits), frees with fewer computed tokens, preemption, forks, chunks, decoded
tokens, ``uncache_blocks``, ``rewind`` and its recompute, resets, lookups; a small pool
(evictions take pending runs whole and cut their tails), a tiny ``max_events``
(restatements), and a host tier (events built as stored there: nothing pending).
"""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager, Prompt
from prefixkv.errors import PrefixKVError
from prefixkv.extra_keys import MultiModalInput
from prefixkv.fleet.wire import encode_batch

BS = 2
UNITS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
CHAINS = [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0, 1, 2, 3, 4, 2, 2], [0, 1, 3, 3, 3, 3],
          [1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5], [2, 3, 0, 1, 2, 3]]
EXTRAS: list[ExtraKeys | None] = [None, None, ExtraKeys(cache_salt="t"),
                                  ExtraKeys(mm=(MultiModalInput("img", 3, 4),))]

KINDS = (["admit"] * 8 + ["free"] * 3 + ["preempt", "fork", "extend", "extend", "decode",
                                          "decode", "uncache", "rewind", "lookup"])


def draw(rng: random.Random) -> tuple:
    """One op, drawn by ``rng`` (weighted: mostly admissions)."""
    kind = rng.choice(KINDS) if rng.random() > 0.02 else "reset"
    if kind == "admit":
        return ("admit", rng.randrange(len(CHAINS)), rng.randint(1, 12),
                [rng.randint(1, 9) for _ in range(rng.randint(0, 3))],
                rng.choice([0, 0, 0, 1, 2, 3]), rng.random() < 0.5,
                rng.choice([None, None, rng.randint(1, 14)]),
                rng.choice([None, None, rng.randint(0, 16)]), rng.random() < 0.4,
                rng.random() < 0.1)
    if kind == "free":
        return ("free", rng.randrange(30), rng.choice([None, None, rng.randint(0, 24)]))
    if kind in ("preempt", "fork"):
        return (kind, rng.randrange(30))
    if kind == "extend":
        return ("extend", rng.randrange(30), rng.randint(1, 8))
    if kind == "decode":
        return ("decode", rng.randrange(30), [rng.randint(1, 9) for _ in range(rng.randint(1, 4))])
    if kind == "uncache":
        return ("uncache", [rng.randrange(24) for _ in range(rng.randint(0, 3))])
    if kind == "rewind":
        return ("rewind", rng.randrange(30), rng.randint(0, 24))
    if kind == "lookup":
        return ("lookup", rng.randrange(len(CHAINS)), rng.randint(1, 12))
    return ("reset",)


def each(ms: list[KVCacheManager], call: str, *args: object, **kw: object) -> object:
    """The call on each manager: the same answer, or the same exception type."""
    out: list[object] = []
    for m in ms:
        try:
            out.append(getattr(m, call)(*args, **kw))
        except PrefixKVError as e:
            out.append(type(e))
    assert all(x == out[0] for x in out), (call, args, out)
    return out[0]


def run(steps: list[tuple], num_blocks: int, host: int, max_events: int,
        pending: list[int] | None = None) -> int:
    """The ops on four managers; returns how many steps had a pending run (``pending``:
    how many runs were pending after each step, appended)."""
    ms = [KVCacheManager(num_blocks, BS, seed=0, enable_events=True, max_events=max_events,
                         host_blocks=host) for _ in range(4)]
    ms[1]._index.pending_runs = False  # type: ignore[union-attr]
    ms[2]._index.runs = False  # type: ignore[union-attr]
    ms[3]._index.lazy = False  # type: ignore[union-attr]  # (built as stored: hashes now;
    # it never takes the lean path, which hashes nothing: a Prompt is ``a``'s, whose
    # ``config`` is not its own, and a list goes to ``_admit``)
    a = ms[0]
    live: list[str] = []
    handed: list[tuple[object, list]] = []  # a's batches, built a few steps late
    pending_seen = 0
    for n, op in enumerate(steps):
        if op[0] == "admit":
            _, c, k, tail, extra, prepared, new, cap, keep, recompute = op
            tokens = [t for u in CHAINS[c][:k] for t in UNITS[u]] + tail
            e = EXTRAS[extra]
            if e is not None and e.mm is not None and len(tokens) < 7:
                e = None
            prompt: list[int] | Prompt = a.prepare(tokens, extra=e) if prepared else tokens
            kw: dict[str, object] = {} if prepared else {"extra": e}
            if new is not None:
                kw["num_new_tokens"] = new
            if cap is not None:
                kw["max_hit_tokens"] = cap
            if recompute:  # (no hit: its blocks are spares of contents held)
                kw["read_cache"] = False
            got = each(ms, "add_request", f"r{n}", prompt, **kw)
            if got is not None and not isinstance(got, type):
                live.append(f"r{n}")
                if not keep:
                    each(ms, "free", live.pop())
        elif op[0] in ("free", "preempt") and live:
            rid = live.pop(op[1] % len(live))
            if op[0] == "preempt":
                each(ms, "preempt", rid)
            else:
                done = op[2] if op[2] is None else min(op[2], a.num_scheduled_tokens(rid))
                each(ms, "free", rid, num_computed_tokens=done)
        elif op[0] == "fork" and live:
            parent = live[op[1] % len(live)]
            if a.num_scheduled_tokens(parent) == a.num_tokens(parent):
                got = each(ms, "fork", parent, f"f{n}")
                if got is not None and not isinstance(got, type):
                    live.append(f"f{n}")
        elif op[0] == "extend" and live:
            rid = live[op[1] % len(live)]
            left = a.num_tokens(rid) - a.num_scheduled_tokens(rid)
            if left:
                each(ms, "extend", rid, min(op[2], left))
        elif op[0] == "decode" and live:
            rid = live[op[1] % len(live)]
            if a.num_scheduled_tokens(rid) == a.num_tokens(rid):
                each(ms, "append_tokens", rid, op[2])
        elif op[0] == "uncache":
            each(ms, "uncache_blocks", op[1])
        elif op[0] == "rewind" and live:
            rid = live[op[1] % len(live)]
            back = min(op[2], a.num_scheduled_tokens(rid))
            if each(ms, "rewind", rid, back) is None and back < a.num_tokens(rid):
                each(ms, "extend", rid, a.num_tokens(rid) - back)  # (the recompute)
        elif op[0] == "lookup":
            tokens = [t for u in CHAINS[op[1]][:op[2]] for t in UNITS[u]]
            each(ms, "lookup_block_ids", tokens)
        elif op[0] == "reset":
            each(ms, "reset_prefix_cache")
        pending_seen += bool(a._index.run_counts.pending)  # type: ignore[union-attr]
        if pending is not None:
            pending.append(len(a._index.run_counts.pending))  # type: ignore[union-attr]
        each(ms, "take_kv_ops")  # (the step runs: its copies with it)
        want = ms[1].take_events()
        assert ms[2].take_events() == want, n
        assert ms[3].take_events() == want, n
        handed.append((a.take_pending_events(), want))
        if n % 3 == 2 or n == len(steps) - 1:  # (built late, the pool moved on meanwhile)
            for batch, expected in handed:
                got = batch.build()  # type: ignore[attr-defined]
                assert got == expected, n
                assert encode_batch(got, block_size=BS, ts=0) == \
                    encode_batch(expected, block_size=BS, ts=0), n
            handed = []
        assert [x.ref_cnt for x in a._pool.blocks] == [x.ref_cnt for x in ms[1]._pool.blocks]
        assert a.free_block_order() == ms[1].free_block_order() == ms[2].free_block_order()
        for rid in live:
            assert a.get_block_ids(rid) == ms[1].get_block_ids(rid) == ms[2].get_block_ids(rid)
        for m in ms:
            m.check_invariants()
    return pending_seen


@settings(deadline=None, max_examples=50)
@example(seed=3284, n=22, num_blocks=12, host=0, max_events=1 << 20)  # (a stale run cut at a
# block that heads a pending run since: the cut's tail took its ``starts``, the claim
# that takes the stale run's part went on through its ``child``, which is pending: a miss)
@example(seed=4174, n=60, num_blocks=16, host=0, max_events=1 << 20)  # (the same, a stale run
# checked and taken whole up to such a block)
@given(st.integers(0, 1 << 32), st.integers(20, 60), st.sampled_from([8, 12, 16, 24]),
       st.sampled_from([0, 0, 0, 6]), st.sampled_from([1 << 20, 1 << 20, 1, 2]))
def test_pending_runs_announce_what_written_runs_announce(seed, n, num_blocks, host, max_events):
    rng = random.Random(seed)  # (ops drawn evenly: Hypothesis' own draws favour the edges)
    run([draw(rng) for _ in range(n)], num_blocks, host, max_events)


def test_an_eviction_names_pending_runs_blocks_whole_cut_and_beside_spares():
    """With events on, a miss records its run pending; evictions that take a pending run
    whole, cut its tail, or take it while spares are held (each content decided block by
    block) name its blocks in their ``BlockRemoved`` as the written-runs twin does."""
    def admit(c: int, k: int, keep: bool, recompute: bool = False) -> tuple:
        return ("admit", c, k, [], 0, False, None, None, keep, recompute)
    cut_and_whole = [admit(0, 10, False), admit(3, 8, True), admit(5, 6, True)]
    assert run(cut_and_whole, 16, 0, 1 << 20) >= 1
    beside_spares = [admit(2, 2, True), admit(2, 2, True, recompute=True),  # a spare held
                     admit(0, 10, False), admit(3, 8, True), admit(5, 6, True)]
    assert run(beside_spares, 20, 0, 1 << 20) >= 1


def test_a_claim_cuts_a_pending_run_into_two_pending_runs():
    """A claim that agrees with a pending run's first blocks alone cuts it without
    writing it (``split_pending``): both parts stay pending (the block at the cut
    written, counted alone); a later claim takes the first part, the block at the cut
    and the second part, each as the written-runs twin takes them, and an eviction
    names them as it does."""
    def admit(c: int, k: int, keep: bool) -> tuple:
        return ("admit", c, k, [], 0, False, None, None, keep, False)
    counts: list[int] = []
    steps = [admit(0, 10, False), admit(1, 7, False),  # 9 blocks pending; cut after 4
             admit(0, 10, True), admit(3, 8, True), admit(5, 6, True)]  # both parts, evicted
    assert run(steps, 20, 0, 1 << 20, counts) >= 1
    assert counts[:2] == [1, 2], counts  # (the cut leaves the two parts pending)
    counts = []  # cut before its last block (nothing after the block at the cut)
    last = [admit(0, 10, False), ("admit", 0, 9, [9, 9], 0, True, None, None, False, False),
            admit(0, 10, True), admit(3, 8, True), admit(5, 6, True)]
    run(last, 20, 0, 1 << 20, counts)
    assert counts[:2] == [1, 1], counts
