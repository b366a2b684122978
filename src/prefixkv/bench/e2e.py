"""End to end through the example engine (``prefixkv.engine``): the same multi-turn chat
run with prefix caching off and on, to measure each turn's time to first token and to
check that greedy decoding yields the same tokens either way (the cached KV is exact,
not approximate).

Timing that load on a shared machine cannot flip: a turn's time to first token is taken
on two clocks, process CPU time (what the work costs, whoever else runs) and wall time,
and each is the best (minimum) of ``repeats`` runs alternating without and with the
cache. On the CPU the model runs on one torch thread, so that CPU time is not inflated by
threads spinning while the other one waits for a core.

Needs torch; this module imports it (through the engine) only inside ``run_e2e``.
Attention runs through ``prefixkv.kernels``: Triton on a GPU, the torch reference on
the CPU.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import check_sizes

if TYPE_CHECKING:
    from ..engine import ChatResult, Engine


@dataclass(frozen=True)
class E2EConfig:
    """Sizes of the end-to-end chat: kept small so that it runs in seconds on 2 CPU cores.
    Each an int >= 1 (``num_blocks`` at most ``limits.MAX_POOL_BLOCKS``, ``block_size``
    at most ``limits.MAX_BLOCK_SIZE``): BenchError otherwise, when the config is made."""

    conversations: int = 4
    turns: int = 4
    system_tokens: int = 512
    message_tokens: int = 64
    max_tokens: int = 16
    repeats: int = 5
    num_blocks: int = 512
    block_size: int = 16

    def __post_init__(self) -> None:
        check_sizes(self)


def turn_ttfts(turns: Sequence[Any], marks: Sequence[float]) -> list[float]:
    """Per turn, the time from its start to the end of its last step that computed
    prefill tokens: when every chat of the turn has its first token.

    ``turns``: the chat's GenerateResults in order (``.steps``, each with
    ``num_prefill_tokens``). ``marks``: one clock reading before the first step, then one
    after each step, in order (``len(marks) == 1 + all steps``)."""
    out, first = [], 0
    for turn in turns:
        last = max(k for k, step in enumerate(turn.steps) if step.num_prefill_tokens)
        out.append(marks[first + last + 1] - marks[first])
        first += len(turn.steps)
    return out


def run_e2e(seed: int = 0, cfg: E2EConfig | None = None) -> dict[str, Any]:
    """Run the chat without and with the cache, ``cfg.repeats`` times each on fresh
    engines, alternating; return per-turn time to first token (ms, best of the repeats,
    on process CPU time and on wall time), token counts, and ``identical`` (every run's
    greedy replies equal). Returns ``{"skipped": why}`` when torch or the engine cannot
    be imported. Raises whatever the engine raises."""
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

    def engine(caching: bool) -> Engine:
        return build_engine(model, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                            enable_caching=caching, device=device)

    def timed_chat(caching: bool) -> tuple[ChatResult, list[list[float]]]:
        eng = engine(caching)
        marks = [(time.process_time(), time.perf_counter())]
        result = run_chat(eng, convs, params, system_prompt=system,
                          on_step=lambda rec: marks.append((time.process_time(), time.perf_counter())))
        clocks = [turn_ttfts(result.turns, [m[k] for m in marks]) for k in (0, 1)]
        return result, clocks

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        engine(False).generate([system[:64]], params)  # warm-up: first-call costs, not measured
        runs: dict[bool, list[tuple[ChatResult, list[list[float]]]]] = {False: [], True: []}
        for _ in range(cfg.repeats):  # alternate, so drift on a shared machine hits both
            for caching in (False, True):
                runs[caching].append(timed_chat(caching))
    finally:
        torch.set_num_threads(threads)

    def best_ms(caching: bool, clock: int, t: int) -> float:
        return 1e3 * min(clocks[clock][t] for _, clocks in runs[caching])

    turns = []
    for t, (off, on) in enumerate(zip(runs[False][0][0].turns, runs[True][0][0].turns, strict=True)):
        turns.append({
            "turn": t + 1,
            "prompt_tokens": sum(o.metrics.num_prompt_tokens for o in on.outputs),
            "cached_tokens": sum(o.metrics.num_cached_tokens for o in on.outputs),
            "prefill_tokens_nocache": off.num_prefill_tokens,
            "prefill_tokens_cache": on.num_prefill_tokens,
            "ttft_cpu_ms_nocache": best_ms(False, 0, t),
            "ttft_cpu_ms_cache": best_ms(True, 0, t),
            "ttft_wall_ms_nocache": best_ms(False, 1, t),
            "ttft_wall_ms_cache": best_ms(True, 1, t),
        })
    replies = [result.replies for result, _ in runs[False] + runs[True]]
    name = (f"tiny Llama ({model.num_layers} layers, hidden {model.hidden_size}, random "
            f"weights), {cfg.conversations} chats x {cfg.turns} turns, {cfg.system_tokens}-token "
            f"system prompt, {cfg.message_tokens}-token messages, {cfg.max_tokens} tokens/reply")
    backend = "Triton kernels" if device == "cuda" else "1 torch thread, torch reference attention"
    return {"device": f"{device}, {backend}", "model": name, "config": cfg.__dict__,
            "identical": all(r == replies[0] for r in replies),
            "turns": turns}
