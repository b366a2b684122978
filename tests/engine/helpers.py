"""Shared pieces of the engine tests (the fixtures in conftest.py build on them). Needs torch:
every test module calls importorskip before importing this, so that the folder skips cleanly
(a conftest.py raising Skipped would break `pytest tests/engine` at startup)."""

import pytest

pytest.importorskip("torch", reason="the example engine needs torch (pip install prefixkv[kernels])")

import torch  # noqa: E402

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.engine import Engine, LlamaConfig, ModelRunner, TinyLlama, dense_causal_attention  # noqa: E402

CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64, intermediate_size=512, seed=1234)


def make_engine(model: TinyLlama, num_blocks=128, block_size=16, *, caching=True, allocator=None,
                events=False, **kw):
    """An engine on ``model`` and its allocator (a ``KVCacheManager`` unless ``allocator`` is
    given), the runner's cache poisoned with NaN; the ``make_engine`` fixture binds ``model``."""
    if allocator is None:
        allocator = KVCacheManager(num_blocks, block_size, enable_caching=caching,
                                   enable_events=events, vocab_size=CONFIG.vocab_size)
    runner = ModelRunner(model, allocator.num_blocks, allocator.block_size, poison=True)
    return Engine(runner, allocator, **kw), allocator


def checker(allocator):
    """An ``on_step`` callback running the allocator's full invariant check."""

    def on_step(record):
        allocator.check_invariants()

    return on_step


def dense_greedy(model: TinyLlama, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by recomputing the whole sequence densely for every token."""
    toks = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids = torch.tensor(toks)
            hidden = model(ids, torch.arange(len(toks)), dense_causal_attention([0, len(toks)]))
            toks.append(int(model.logits(hidden[-1:]).argmax()))
    return toks[len(prompt):]
