"""prefixkv's vLLM plug-in beside vLLM 0.33's own ``KVCacheManager`` (from the wheel) on
encoder-decoder layouts (a full-attention decoder group, then cross-attention groups:
Whisper's), prefix caching off as vLLM runs them: every answer, block id, free count and
the pool's free order agree after each call of a random request stream (admissions with
and without encoder tokens, chunked growth, decode steps, the whole-sequence gate,
reserved blocks and the watermark, frees, a live request's encoder tables grown), and
the layouts and calls prefixkv does not serve are refused by name. Needs vllm."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_plugin import config, cross_attention, full, request, window  # noqa: E402

BS = 16
MAX_LEN = 8 * BS


def _cross(bs: int = BS) -> Any:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    return CrossAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def _pair(num_blocks: int, num_cross: int = 1, watermark: float = 0.0) -> list[Any]:
    """prefixkv's plug-in and vLLM's manager over a full-attention group and
    ``num_cross`` cross-attention groups, caching off."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as Theirs

    from prefixkv.integrations.vllm import KVCacheManager as Ours

    specs = (full(BS), *(_cross() for _ in range(num_cross)))
    kw = dict(max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False,
              watermark=watermark)
    return [cls(config(*specs, num_blocks=num_blocks), **kw) for cls in (Ours, Theirs)]


def _free_order(m: Any) -> list[int]:
    if hasattr(m, "core"):
        return [i + m._blocks.offset for i in m.core.free_block_order()]
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def _ids(blocks: Any) -> Any:
    return None if blocks is None else [[b.block_id for b in g] for g in blocks.blocks]


def _agree(ms: list[Any], rids: list[str]) -> None:
    ours, theirs = ms
    assert _free_order(ours) == _free_order(theirs)
    assert ours.block_pool.get_num_free_blocks() == theirs.block_pool.get_num_free_blocks()
    assert ours.usage == pytest.approx(theirs.usage)
    for rid in rids:
        assert ours.get_block_ids(rid) == theirs.get_block_ids(rid), rid
        assert _ids(ours.get_blocks(rid)) == _ids(theirs.get_blocks(rid)), rid
        for n in (0, 1, BS + 1):
            assert ours.get_block_ids_for_computed_tokens(rid, n) == \
                theirs.get_block_ids_for_computed_tokens(rid, n)
        assert ours.get_num_common_prefix_blocks(rid) == theirs.get_num_common_prefix_blocks(rid)
    ours.core.check_invariants()


OP = st.tuples(st.sampled_from(["admit", "admit", "step", "step", "free", "encoder"]),
               st.integers(0, 3), st.integers(1, 3 * BS), st.integers(0, 5 * BS), st.integers(0, 7))


@pytest.mark.parametrize("num_cross", [1, 2])
@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(10, 40), watermark=st.sampled_from([0.0, 0.1]),
       ops=st.lists(OP, min_size=4, max_size=30))
def test_prefixkv_and_vllm_agree_on_encoder_decoder_layouts(num_cross, num_blocks, watermark, ops):
    from vllm.v1.request import RequestStatus

    ms = _pair(num_blocks, num_cross, watermark)
    reqs: list[dict[int, Any]] = [{}, {}]
    for serial, (op, slot, k, enc, more) in enumerate(ops):
        answers = []
        for m, rs in zip(ms, reqs, strict=True):
            r = rs.get(slot)
            if op == "admit" and r is None:
                r = rs[slot] = request(f"r{serial}", [serial * 100 + i for i in range(k + more)])
                n = min(k, r.num_tokens)  # (a first chunk, when k < the prompt)
                new = m.allocate_slots(r, n, num_encoder_tokens=enc, full_sequence_must_fit=bool(more & 1),
                                       reserved_blocks=more // 2, has_scheduled_reqs=bool(more & 2))
                answers.append(_ids(new))
                if new is None:
                    del rs[slot]
                    continue
                r.status, r.num_computed_tokens = RequestStatus.RUNNING, n
            elif op in ("step", "encoder") and r is not None:
                if r.num_computed_tokens == r.num_tokens:
                    r.append_output_token_ids(7)
                n = min(k, r.num_tokens - r.num_computed_tokens)
                e = enc if op == "encoder" else 0  # (vLLM's scheduler passes 0 once admitted)
                new = m.allocate_slots(r, n, num_encoder_tokens=e, reserved_blocks=more // 2)
                answers.append(_ids(new))
                if new is not None:
                    r.num_computed_tokens += n
            elif op == "free" and r is not None:
                m.free(r)
                del rs[slot]
        if answers:
            assert answers[0] == answers[1], (op, answers)
        assert reqs[0].keys() == reqs[1].keys()
        _agree(ms, [r.request_id for r in reqs[0].values()])


def test_a_whisper_like_stream_takes_exactly_the_encoders_blocks_and_frees_them_in_vllms_order():
    # worked example: 200 encoder tokens -> 13 cross blocks; a text-only request none;
    # the whole-sequence gate counts the cross blocks (vLLM refuses, so does prefixkv)
    ms = _pair(num_blocks=30)
    rs = [[request(rid, list(range(n))) for rid, n in (("a", 20), ("b", 5), ("c", 40))] for _ in ms]
    got = [[_ids(m.allocate_slots(r[0], 20, num_encoder_tokens=200)),
            _ids(m.allocate_slots(r[1], 5)),
            # 13 blocks free: a chunk of 16 tokens and 11 encoder blocks fit, the whole
            # 40-token sequence's 3 blocks and them do not
            _ids(m.allocate_slots(r[2], 16, num_encoder_tokens=16 * 11, full_sequence_must_fit=True)),
            _ids(m.allocate_slots(r[2], 16, num_encoder_tokens=16 * 11))]
           for m, r in zip(ms, rs, strict=True)]
    assert got[0] == got[1]
    assert [len(g) for g in got[0][0]] == [2, 13] and got[0][1] == [[16], []] and got[0][2] is None
    assert got[0][3] == [[17], list(range(18, 29))]
    _agree(ms, ["a", "b", "c"])
    for m, r in zip(ms, rs, strict=True):
        m.free(r[0])
    _agree(ms, ["b", "c"])
    # vLLM's order: group by group, each reused last-freed first (no content): the
    # decoder's 2 blocks, then the 13 encoder blocks in front of them
    assert _free_order(ms[0])[:16] == [*range(15, 0, -1), 29]


@pytest.mark.parametrize(("specs", "kw", "named"), [
    ((cross_attention, full), {"enable_caching": False}, "after every decoder group"),
    ((full, lambda: _cross(32)), {"enable_caching": False}, "block size"),
    ((full, cross_attention), {"enable_caching": True}, "prefix caching off"),
    ((full, window, cross_attention), {"enable_caching": False}, "one full-attention decoder group"),
    ((full, cross_attention), {"enable_caching": False, "metrics_collector": object()}, "metrics collector"),
])
def test_cross_attention_layouts_prefixkv_does_not_serve_are_refused_by_name(specs, kw, named):
    from prefixkv.errors import ConfigError
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match=named) as info:
        KVCacheManager(config(*(make() for make in specs), num_blocks=11), max_model_len=MAX_LEN,
                       scheduler_block_size=BS, hash_block_size=BS, **kw)
    assert isinstance(info.value, ConfigError)


def test_popping_a_request_holding_cross_attention_blocks_is_refused_before_any_change():
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    ours, _ = _pair(num_blocks=20)
    r = request("a", list(range(20)))
    assert ours.allocate_slots(r, 20, num_encoder_tokens=30) is not None
    before = ours.get_block_ids("a")
    with pytest.raises(UnsupportedByPrefixKV, match="pop_blocks_for_free"):
        ours.pop_blocks_for_free(r)
    assert ours.get_block_ids("a") == before
    ours.core.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, None])
def test_a_bad_encoder_token_count_is_refused_before_any_change(bad):
    from prefixkv.errors import RequestError

    ours, _ = _pair(num_blocks=20)
    r = request("a", list(range(20)))
    free = ours.block_pool.get_num_free_blocks()
    with pytest.raises(RequestError, match="num_encoder_tokens"):
        ours.allocate_slots(r, 20, num_encoder_tokens=bad)
    assert ours.block_pool.get_num_free_blocks() == free and ours.get_block_ids("a") == ([], [])
    ours.core.check_invariants()
