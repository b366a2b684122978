"""End to end through the example engine (``prefixkv.engine``): the same multi-turn chat
run twice on the tiny random-weight Llama, with prefix caching off and on, to measure
time to first token and prefill time per turn and to check that greedy decoding yields
the same tokens either way (the cached KV is exact, not approximate).

Needs torch; this module imports it (through the engine) only inside ``run_e2e``.
Attention runs through ``prefixkv.kernels``: Triton on a GPU, the torch reference on
the CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from statistics import mean, median
from typing import Any


@dataclass(frozen=True)
class E2EConfig:
    """Sizes of the end-to-end chat: kept small so that it runs in seconds on 2 CPU cores."""

    conversations: int = 4
    turns: int = 4
    system_tokens: int = 512
    message_tokens: int = 64
    max_tokens: int = 16
    repeats: int = 5
    num_blocks: int = 512
    block_size: int = 16


def run_e2e(seed: int = 0, cfg: E2EConfig | None = None) -> dict[str, Any]:
    """Run the chat without and with the cache, ``cfg.repeats`` times each on fresh
    engines; return per-turn timings (ms, the median over repeats of the mean over the
    turn's requests), token counts, and ``identical`` (every run's greedy replies equal). Returns ``{"skipped": why}``
    when torch or the engine cannot be imported. Raises whatever the engine raises."""
    cfg = cfg or E2EConfig()
    try:
        import torch
        from ..engine import LlamaConfig, SamplingParams, build_engine, run_chat, synthetic_conversations
    except ImportError as exc:
        return {"skipped": f"needs torch and prefixkv.engine ({exc})"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaConfig(seed=seed)
    params = SamplingParams(max_tokens=cfg.max_tokens)
    rng = random.Random(f"e2e/{seed}")
    system = [rng.randrange(1, model.vocab_size) for _ in range(cfg.system_tokens)]
    convs = synthetic_conversations(cfg.conversations, cfg.turns, cfg.message_tokens,
                                    vocab_size=model.vocab_size, seed=seed)

    def engine(caching: bool):
        return build_engine(model, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                            enable_caching=caching, device=device)

    engine(False).generate([system[:64]], params)  # warm-up: first-call costs, not measured
    runs = {False: [], True: []}
    for _ in range(cfg.repeats):  # alternate, so drift on a shared machine hits both
        for caching in (False, True):
            runs[caching].append(run_chat(engine(caching), convs, params, system_prompt=system))

    def ms(caching: bool, t: int, metric: str) -> float:
        return 1e3 * median(mean(getattr(o.metrics, metric) for o in run.turns[t].outputs)
                            for run in runs[caching])

    turns = []
    for t, (off, on) in enumerate(zip(runs[False][0].turns, runs[True][0].turns)):
        turns.append({
            "turn": t + 1,
            "prompt_tokens": sum(o.metrics.num_prompt_tokens for o in on.outputs),
            "cached_tokens": sum(o.metrics.num_cached_tokens for o in on.outputs),
            "prefill_tokens_nocache": off.num_prefill_tokens,
            "prefill_tokens_cache": on.num_prefill_tokens,
            "prefill_ms_nocache": ms(False, t, "prefill_time"),
            "prefill_ms_cache": ms(True, t, "prefill_time"),
            "ttft_ms_nocache": ms(False, t, "ttft"),
            "ttft_ms_cache": ms(True, t, "ttft"),
        })
    replies = [run.replies for run in runs[False] + runs[True]]
    name = (f"tiny Llama ({model.num_layers} layers, hidden {model.hidden_size}, random "
            f"weights), {cfg.conversations} chats x {cfg.turns} turns, {cfg.system_tokens}-token "
            f"system prompt, {cfg.message_tokens}-token messages, {cfg.max_tokens} tokens/reply")
    backend = "Triton kernels" if device == "cuda" else "torch reference attention"
    return {"device": f"{device}, {backend}", "model": name, "config": cfg.__dict__,
            "identical": all(r == replies[0] for r in replies), "turns": turns}
