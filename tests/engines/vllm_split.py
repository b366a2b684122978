"""vLLM's own scheduler's cut of a chunk beside Mamba groups, for side-by-side tests."""

from __future__ import annotations

from types import SimpleNamespace


def vllm_mamba_chunk(step: int, h: int, start: int, n: int, total: int, prompt: int, *,
                     eagle: bool = False, lookahead: int = 0, align: int = 0, partial: bool = True) -> int:
    """``n`` tokens from ``start`` as vLLM's scheduler cuts them (its own
    ``Scheduler._mamba_block_aligned_split``) with Mamba blocks of ``step``, hash block
    ``h``, vLLM's partial hits on (off: not ``partial``), EAGLE's block drop when ``eagle``, lookahead hashing
    of ``lookahead`` tokens and checkpoint blocks aligned to ``align`` (0: none), the
    request's junction 0; but a chunk starting inside a Mamba block ends at its end
    (vLLM would cache that block as the state at its end, which prefixkv never does)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=step), block_size=step, hash_block_size=h,
        mamba_partial_cache_hit=partial,
        use_eagle=eagle, use_eagle_block_drop=eagle, num_hash_lookahead_tokens=lookahead,
        mamba_has_prefill_checkpoint_blocks=bool(align), mamba_prefill_checkpoint_alignment=align or None,
        mamba_shared_prefix_checkpoint=False, max_num_scheduled_tokens=8192,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))
    req = SimpleNamespace(num_computed_tokens=start, num_prompt_tokens=prompt, num_tokens=total,
                          shared_prefix_boundary=0)
    n = max(1, Scheduler._mamba_block_aligned_split(sched, req, n))  # type: ignore[arg-type]
    return min(n, step - start % step) if start % step else n
