"""``UnpinPool`` (core/pool_unpin.py) against vLLM 0.33's own ``BlockPool`` with caching off
(HiSparse's device pool), side by side on random streams of takes (``get_new_blocks``,
and ``take_one`` as a one-block take), frees (``free_blocks``), unpins (``unpin_blocks``),
forgets (a page no longer its request's: vLLM's watcher ignores it) and resets
(``reset_prefix_cache``). After each: the blocks handed out, the free order and count,
the watchers told (which blocks, in which order), and the pool's own check. Needs vllm
installed."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.core.block import Block
from prefixkv.core.pool_unpin import UnpinPool
from prefixkv.index import NoIndex

from . import skip_module_without_vllm

skip_module_without_vllm()

MASK = st.integers(0, 2**16 - 1)
OPS = st.lists(st.one_of(st.tuples(st.just("take"), st.integers(1, 6)), st.tuples(st.just("one"), st.just(0)),
                         st.tuples(st.just("free"), MASK), st.tuples(st.just("unpin"), MASK),
                         st.tuples(st.just("unpin"), MASK), st.tuples(st.just("forget"), st.integers(0, 99)),
                         st.tuples(st.just("reset"), st.just(0))), min_size=1, max_size=50)


def chosen(held: list[Any], mask: int) -> list[int]:
    return [i for i in range(len(held)) if mask >> (i % 16) & 1]


def run(num_blocks: int, ops: list[tuple[str, int]]) -> set[str]:
    """``ops`` on both pools; what happened (that a test is not vacuous)."""
    from vllm.v1.core.block_pool import BlockPool as VllmPool

    v = VllmPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=16)
    p = UnpinPool(num_blocks, NoIndex())
    null = p.take(1)  # (vLLM's null block, taken at its pool's start)
    held: list[tuple[Block, Any]] = []  # each block once: (prefixkv's, vLLM's)
    heard_p: list[int] = []
    heard_v: list[int] = []
    readers: set[int] = set()  # vLLM's unpinned blocks whose watcher still listens
    seen: set[str] = set()

    def on_reuse_v(b: Any) -> None:
        if b.block_id in readers:
            readers.discard(b.block_id)
            heard_v.append(b.block_id)

    for i, (op, arg) in enumerate(ops):
        free = p.num_free
        if op in ("take", "one"):
            n = min(arg or 1, free)
            if op == "one":
                got_p = [p.take_one()] if free else []
                assert free or p.take_one() is None
            else:
                got_p = p.take(n)
            got_v = v.get_new_blocks(n)
            assert [b.block_id for b in got_p] == [b.block_id for b in got_v], (i, op)
            held += zip(got_p, got_v, strict=True)  # type: ignore[arg-type]
        elif op == "free":
            at = chosen(held, arg)
            p.free([held[k][0] for k in at])
            v.free_blocks([held[k][1] for k in at])
            held = [h for k, h in enumerate(held) if k not in at]
        elif op == "unpin":
            at = chosen(held, arg)
            p.unpin([held[k][0] for k in at], lambda b: heard_p.append(b.block_id))
            v.unpin_blocks([held[k][1] for k in at], on_reuse_v)
            readers.update(held[k][0].block_id for k in at)
            held = [h for k, h in enumerate(held) if k not in at]
            seen.add("unpinned") if at else None
        elif op == "forget":
            if not readers:
                continue
            block_id = sorted(readers)[arg % len(readers)]
            p.forget(p.blocks[block_id])
            readers.discard(block_id)
            seen.add("forgot")
        else:  # (as the group manager resets: only with no request live, its null block
            # given back around it)
            assert v.reset_prefix_cache() == (not held), i
            if not held:
                p.release(null)
                assert p.reset()
                null = p.take(1)
                seen.add("reset")
        assert heard_p == heard_v, (i, op)
        assert p.num_free == v.get_num_free_blocks(), (i, op)
        assert p.free_order() == [b.block_id for b in v.free_block_queue.get_all_free_blocks()], (i, op)
        refs = {b.block_id: 1 for b, _ in held} | {null[0].block_id: 1}
        assert p.check(refs) is None, (i, op, p.check(refs))
    if heard_p:
        seen.add("reused")
    return seen


def test_a_stream_with_every_event_follows_vllm() -> None:
    seen = run(8, [("take", 7), ("unpin", 0b1010), ("free", 0b1), ("unpin", 0b11), ("forget", 1),
                   ("take", 2), ("one", 0), ("one", 0), ("free", 0b11111), ("reset", 0), ("take", 3),
                   ("unpin", 0b111), ("free", 0xffff), ("reset", 0), ("take", 6)])
    assert seen == {"unpinned", "forgot", "reused", "reset"}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(2, 12), ops=OPS)
def test_random_streams_follow_vllms_pool(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    run(num_blocks, ops)
