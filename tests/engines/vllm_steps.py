"""Seeded random steps on prefixkv's plug-in and vLLM's own manager side by side, for the
tests of vLLM's object-model views (free list, free count, ``_cache``): admissions of
prompts sharing prefixes (in chunks), growth (a prefill's next chunk, or a decode step),
frees. Each step runs the same call on both sides and asserts both fit or neither did
(a side-by-side admission that fits on one side only is freed there and the step says
so). Needs vllm installed."""

from __future__ import annotations

import random
from typing import Any

from .test_vllm_reference import BS, _request


def admit(m: Any, rid: str, tokens: list[int], n: int | None = None, **kw: Any) -> Any:
    """Admit a request of ``tokens`` with its hit and ``n`` more tokens (all by default),
    noted as the engine's input thread notes it on prefixkv's side (prepared.py); the
    Request, or None where it did not fit. (The caller holds the Request while it lives,
    as the engine does: prefixkv's block hash view names content by live requests.)"""
    r = _request(rid, tokens, None)
    if hasattr(m, "prepared_prompts"):
        m.prepared_prompts.note(r)
    blocks, hit, _ = m.get_computed_blocks(r)
    n = len(tokens) - hit if n is None else min(n, len(tokens) - hit)
    if m.allocate_slots(r, n, hit, blocks, **kw) is None:
        return None
    r.num_computed_tokens = hit + n
    return r


def random_step(rnd: random.Random, sides: list[Any], live: dict[str, list[Any]], step: int) -> None:
    """One random step on both sides (``live``: request id -> its Request on each side)."""
    op = rnd.random()
    if live and op < 0.35:
        rid = rnd.choice(sorted(live))
        for m, r in zip(sides, live.pop(rid), strict=True):
            m.free(r)
    elif live and op < 0.55:
        rid, n = rnd.choice(sorted(live)), rnd.choice([1, 3, 5])
        fits = []
        for m, r in zip(sides, live[rid], strict=True):
            if r.num_computed_tokens == r.num_tokens:  # (decoding: a sampled token)
                r.append_output_token_ids(60 + step)
            k = min(n, r.num_tokens - r.num_computed_tokens)
            fits.append(m.allocate_slots(r, k) is not None)
            if fits[-1]:
                r.num_computed_tokens += k
                m.cache_blocks(r, r.num_computed_tokens)
        assert fits[0] == fits[1], f"step {step}: growth fits {fits}"
    else:
        rid = f"r{step}"
        tokens = rnd.choice([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9]]) \
            + [rnd.randrange(50) for _ in range(rnd.randrange(1, 11))]
        chunk = rnd.choice([3, BS, 20])
        made = [admit(m, rid, tokens, chunk) for m in sides]
        assert (made[0] is None) == (made[1] is None), f"step {step}: admission fits {made}"
        if made[0] is not None:
            live[rid] = made
