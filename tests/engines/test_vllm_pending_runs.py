"""The vLLM plug-in with KV events off, beside vLLM 0.33's own manager: without events its
core records a miss's run pending (``index/pending.py``), which the reference test
(events on, to see evictions) never reaches. The same request stream and checks as
``test_vllm_reference`` (hits true per the model of what each request wrote, what the
scheduler reads agreeing until an eviction); prefixkv's evictions are seen where its
index loses content, not in events. Needs vllm installed."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()

from .test_vllm_plugin import config, full  # noqa: E402
from .test_vllm_reference import BS, MAX_LEN, PROMPT, SLOTS, Side, _compare, _do  # noqa: E402


def _sides(num_blocks: int) -> tuple[Side, Side]:
    """prefixkv's plug-in (events off) and vLLM's manager (events on) on one full-attention
    group; prefixkv's side is marked ``evicted`` by any call that takes content from its
    index."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    init_none_hash(sha256)
    kw: dict[str, Any] = dict(max_model_len=MAX_LEN, scheduler_block_size=BS,
                              hash_block_size=BS, log_stats=True)
    ours = Side(Ours(config(full(BS), num_blocks=num_blocks), **kw, enable_kv_cache_events=False))
    theirs = Side(Theirs(config(full(BS), num_blocks=num_blocks), **kw,
                         enable_kv_cache_events=True))
    index = ours.m.core._index
    for name in ("drop", "drop_one", "uncache", "clear"):
        call = getattr(index, name)

        def seen(*a: Any, _call: Any = call, **k: Any) -> Any:
            ours.evicted = True
            return _call(*a, **k)

        setattr(index, name, seen)
    return ours, theirs


# the reference's ops, with chunks up to the whole prompt: a run needs three new blocks
OP = st.tuples(st.sampled_from(["admit", "admit", "remote", "step", "step", "step", "free", "preempt",
                                "reset", "evict"]),
               st.integers(0, SLOTS - 1), st.sampled_from([4, 12, 20, MAX_LEN]) | st.integers(1, 12),
               PROMPT, st.integers(0, 11))
PENDING: list[int] = []  # runs recorded pending, over the examples (the test's reach)


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(MAX_LEN // BS + 1, 30), ops=st.lists(OP, min_size=8, max_size=40))
def test_the_plugin_without_events_agrees_with_vllm_and_its_hits_are_true(num_blocks, ops):
    sides = _sides(num_blocks)
    ours = sides[0]
    assert ours.m.core._index.pending_runs and not ours.m.core._index.hashing
    for serial, (op, slot, k, prompt, more) in enumerate(ops):
        strict = not (sides[0].evicted or sides[1].evicted)
        _do(sides, op, slot, k, prompt, more, serial, strict)
        sides[1].note_events()
        PENDING.append(len(ours.m.core._index.run_counts.pending))
        _compare(sides, strict)


def test_the_stream_above_records_pending_runs():
    """(The property above reaches pending runs: some step had one.)"""
    if not PENDING:
        test_the_plugin_without_events_agrees_with_vllm_and_its_hits_are_true()
    assert max(PENDING) > 0
