"""The layer-groups section's accounting (counts, never timings): requests resident and
blocks held per request with a table per group against full-length tables, worked out by
hand on small pools; the hit rate of repeated questions; the stated model shapes."""

from __future__ import annotations

import pytest

from prefixkv.bench.errors import BenchError
from prefixkv.bench.layer_groups import MIXES, capacity, hit_rate, run_groups
from prefixkv.bench.suite import BenchConfig, run_bench
from prefixkv.groups import chunked_local, full_attention, sliding_window

SMALL = dict(num_blocks=41, block_size=4, chunk=8)  # 40 usable blocks beside the null block


def test_capacity_sliding_window_by_hand():
    """16-token prompts in chunks of 8, then one decoded token: 5 blocks per group. The
    window of 8 keeps blocks 2..4 when the decode step starts at 16 (first key 9): 5 + 3
    = 8 blocks a request, and no step needs more (a step's releases pay for its new
    blocks), so 40 blocks hold 5 requests; full-length tables need 10 each: 4."""
    assert capacity([full_attention(), sliding_window(8)], 16, **SMALL) == (5, 8.0)
    assert capacity([full_attention(), full_attention()], 16, **SMALL) == (4, 10.0)


def test_capacity_chunked_local_by_hand():
    """Chunks of 8: at 16 the decode reads only block 4, so 5 + 1 = 6 blocks a request;
    6 requests hold 36, the 7th is admitted (4 blocks) but its second chunk needs 4 and
    its window frees only 2: it is freed and 6 stay."""
    assert capacity([full_attention(), chunked_local(8)], 16, **SMALL) == (6, 6.0)


@pytest.mark.parametrize("groups", [[full_attention()], [full_attention(), sliding_window(8)],
                                    [chunked_local(8), full_attention()]])
def test_hit_rate_of_repeated_questions(groups):
    """One 32-token document, 5 questions of 4 tokens: every question after the first hits
    the document's 8 blocks in every group (a window's early blocks were released cached):
    4 * 32 hit tokens of 5 * 36."""
    rate = hit_rate(groups, num_blocks=64, block_size=4, docs=1, doc_len=32, questions=5,
                    question_len=4, answer_len=2)
    assert rate == pytest.approx(4 * 32 / (5 * 36))


def test_hit_rate_refuses_a_pool_too_small():
    with pytest.raises(BenchError, match="does not fit 8 blocks"):
        hit_rate([full_attention()], num_blocks=8, block_size=4, docs=1, doc_len=32, questions=1)


def test_model_shapes_and_gpt_oss_figures():
    """gpt-oss-like: a block of 16 tokens in 18 layers of 8 KV heads x 64 dims, K and V in
    bf16, is 0.5625 MiB. A 4k prompt plus one decoded token spans 257 blocks; the W=128
    window at 4096 reads from 3969, i.e. blocks 248..256: 257 + 9 = 266 blocks a request
    against 2 x 257."""
    assert MIXES["gemma3-like"].block_bytes(16) == 16 * 10 * 2 * 16 * 128 * 2 == 1_310_720
    assert MIXES["gpt-oss-like"].block_bytes(16) == 589_824
    assert [s.tokens for s in MIXES["gemma3-like"].groups] == [0] + [1024] * 5
    data = run_groups(["gpt-oss-like"])
    hybrid, full = data["rows"]
    assert (hybrid["tables"], full["tables"]) == ("hybrid", "all full")
    assert (hybrid["blocks_per_req_4096"], full["blocks_per_req_4096"]) == (266.0, 514.0)
    assert hybrid["mib_per_req_4096"] == round(266 * 0.5625, 1)
    assert hybrid["resident_4096"] > full["resident_4096"] and hybrid["hit_rate"] > 0


def test_unknown_mix_is_refused_before_any_work(tmp_path):
    with pytest.raises(BenchError, match="unknown layer mix 'gemma4'; choose from gemma3-like"):
        run_bench(BenchConfig(groups=("gemma4",), e2e=False, out=tmp_path))
    assert not list(tmp_path.iterdir())


def test_scale_multiplies_the_hit_rate_questions_and_the_note_says_how_many():
    from prefixkv.bench.layer_groups import QUESTIONS, group_note, questions_at

    assert (questions_at(1.0), questions_at(0.01), questions_at(1e-9)) == (QUESTIONS, 4, 1)  # never none
    small = run_groups(["gpt-oss-like"], scale=0.01)
    assert small["questions"] == 4 and "hit rate: 4 questions on 8 shared" in group_note(small)
