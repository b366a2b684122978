"""The tiny model and its runner: the paged path equals dense recomputation."""

import pytest

torch = pytest.importorskip("torch", reason="the example engine needs torch")

from prefixkv.engine import LlamaConfig, ModelRunner, SeqBatchEntry, TinyLlama, dense_causal_attention  # noqa: E402
from prefixkv.results import BlockCopy  # noqa: E402

from .helpers import CONFIG  # noqa: E402


def dense_logits(model, tokens):
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)),
                       dense_causal_attention([0, len(tokens)]))
        return model.logits(hidden)  # [len, vocab]


def test_weights_are_seeded():
    a, b = TinyLlama(CONFIG), TinyLlama(CONFIG)
    c = TinyLlama(LlamaConfig(seed=CONFIG.seed + 1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_config_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="even"):
        LlamaConfig(head_dim=63)


def test_tied_head_uses_the_embedding(model):
    tied = TinyLlama(LlamaConfig(tie_embeddings=True, num_layers=1))
    h = torch.randn(3, tied.cfg.hidden_size)
    assert torch.allclose(tied.logits(h), h @ tied.embed.weight.t())


def test_paged_chunks_match_dense(model):
    """Prefill in two chunks into scattered blocks of 5 slots, then two decode steps:
    every step's last logits equal the dense model's at that position."""
    tokens = [int(t)
              for t in torch.randint(1, CONFIG.vocab_size, (23,), generator=torch.Generator().manual_seed(0))]
    runner = ModelRunner(model, num_blocks=12, block_size=5, poison=True)
    blocks = [7, 2, 9, 0, 11]  # 25 slots for 23 tokens
    want = dense_logits(model, tokens)
    steps = [(0, 9), (9, 21), (21, 22), (22, 23)]  # | chunk | chunk | decode | decode |
    for lo, hi in steps:
        got = runner.execute([SeqBatchEntry(blocks, lo, tokens[lo:hi])])
        torch.testing.assert_close(got[0], want[hi - 1], rtol=1e-4, atol=1e-4)
    assert runner.num_forward_tokens == 23


def test_batch_of_two_with_shared_prefix_blocks(model):
    """Request b reuses a's first block (computed in an earlier step) and computes only
    its own suffix; both rows match dense recomputation."""
    a = list(range(10, 26))  # exactly one block of 16 ... plus more below
    a_full = a + [40, 41, 42]
    b_full = a + [50, 51, 52, 53]
    runner = ModelRunner(model, num_blocks=8, block_size=16, poison=True)
    runner.execute([SeqBatchEntry([3, 4], 0, a_full)])
    got = runner.execute([SeqBatchEntry([3, 6], 16, b_full[16:]), SeqBatchEntry([3, 4], 19, [60])])
    torch.testing.assert_close(got[0], dense_logits(model, b_full)[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], dense_logits(model, a_full + [60])[-1], rtol=1e-4, atol=1e-4)


def test_copy_blocks_copies_every_layer(model):
    runner = ModelRunner(model, num_blocks=4, block_size=4)
    runner.k_cache[:, 1] = 1.0
    runner.v_cache[:, 1] = 2.0
    runner.copy_blocks([BlockCopy(1, 3)])
    assert bool((runner.k_cache[:, 3] == 1.0).all()) and bool((runner.v_cache[:, 3] == 2.0).all())
    assert bool((runner.k_cache[:, 2] == 0.0).all())


def test_copy_blocks_runs_a_fork_of_a_fork_in_order(model):
    """``take_kv_ops()`` may plan 1 -> 2 then 2 -> 3 in one step: block 3 gets block 1's
    content, not block 2's content from before the step."""
    runner = ModelRunner(model, num_blocks=4, block_size=4)
    runner.k_cache[:, 1] = 1.0
    runner.v_cache[:, 1] = 2.0
    runner.k_cache[:, 2] = 7.0
    runner.v_cache[:, 2] = 8.0
    runner.copy_blocks([BlockCopy(1, 2), BlockCopy(2, 3)])
    for block in (2, 3):
        assert bool((runner.k_cache[:, block] == 1.0).all()), block
        assert bool((runner.v_cache[:, block] == 2.0).all()), block


def test_execute_rejects_empty_work(model):
    runner = ModelRunner(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="at least one sequence"):
        runner.execute([])
    with pytest.raises(ValueError, match="at least one new token"):
        runner.execute([SeqBatchEntry([0], 0, [])])
