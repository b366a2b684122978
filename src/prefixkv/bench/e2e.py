"""End to end through the example engine (``prefixkv.engine``): the same multi-turn chat
with and without prefix caching, timed per turn, and the check that the generated tokens
are identical. Needs torch; on a GPU the Triton kernels run, elsewhere the torch reference.
"""

from __future__ import annotations

import random
from statistics import fmean
from typing import Any

CONVERSATIONS = 4
TURNS = 4
SYSTEM_TOKENS = 512
MESSAGE_TOKENS = 48
REPLY_TOKENS = 16


def run_e2e(seed: int = 0) -> dict[str, Any]:
    """Run the chat twice (cache off, then on) and return per-turn figures:
    ``turns[t]`` has ``prompt_tokens``/``cached_tokens`` (summed over the turn's
    requests), mean ``prefill_ms_*`` and ``ttft_ms_*``; ``identical`` compares every reply.
    Returns ``{"skipped": reason}`` when torch is missing."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install 'prefixkv[kernels]')"}
    from ..engine import LlamaConfig, SamplingParams, build_engine, run_chat, synthetic_conversations

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    cfg = LlamaConfig(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                      seed=seed, dtype=torch.bfloat16 if on_gpu else torch.float32)
    rng = random.Random(seed)
    system = [rng.randrange(1, cfg.vocab_size) for _ in range(SYSTEM_TOKENS)]
    convs = synthetic_conversations(CONVERSATIONS, TURNS, MESSAGE_TOKENS,
                                    vocab_size=cfg.vocab_size, seed=seed)
    params = SamplingParams(max_tokens=REPLY_TOKENS)
    runs = {}
    for caching in (False, True):
        engine = build_engine(cfg, num_blocks=512, block_size=16, enable_caching=caching,
                              device=device)
        engine.generate([system[:32]], SamplingParams(max_tokens=2))  # warm-up (compiles)
        engine.allocator.reset_prefix_cache()
        runs[caching] = run_chat(engine, convs, params, system_prompt=system)
    turns = []
    for t, (off, on) in enumerate(zip(runs[False].turns, runs[True].turns)):
        m_off = [o.metrics for o in off.outputs]
        m_on = [o.metrics for o in on.outputs]
        turns.append({
            "turn": t + 1,
            "prompt_tokens": sum(m.num_prompt_tokens for m in m_on),
            "cached_tokens": sum(m.num_cached_tokens for m in m_on),
            "prefill_ms_nocache": 1e3 * fmean(m.prefill_time for m in m_off),
            "prefill_ms_cache": 1e3 * fmean(m.prefill_time for m in m_on),
            "ttft_ms_nocache": 1e3 * fmean(m.ttft for m in m_off),
            "ttft_ms_cache": 1e3 * fmean(m.ttft for m in m_on),
        })
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (torch reference attention)",
        "model": f"TinyLlama {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                 f"{cfg.num_heads}/{cfg.num_kv_heads} heads, random weights",
        "workload": f"{CONVERSATIONS} chats x {TURNS} turns, {SYSTEM_TOKENS}-token system "
                    f"prompt, {MESSAGE_TOKENS}-token messages, {REPLY_TOKENS}-token replies",
        "identical": runs[False].replies == runs[True].replies,
        "prefill_tokens_nocache": runs[False].num_prefill_tokens,
        "prefill_tokens_cache": runs[True].num_prefill_tokens,
        "turns": turns,
    }
