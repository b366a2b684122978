"""End to end with the host tier: the example engine on the CPU, a device pool too small
to keep the shared prefixes between their uses, run without a cache, with device-only
caching and with a host tier of 16x the pool. Every step runs the allocator's plan
(``take_kv_ops``) through ``kernels.run_kv_ops``; the greedy tokens must be identical in
the three runs.

Times are process CPU time (one torch thread), best of ``repeats`` runs alternating the
three set-ups. Needs torch; imported only inside ``run_e2e_host``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import check_sizes

if TYPE_CHECKING:
    from ..engine import RequestOutput


@dataclass(frozen=True)
class E2EHostConfig:
    """Sizes of the run: ``prefixes`` shared prefixes asked ``rounds`` times in rotation,
    one request at a time in ``num_blocks`` device blocks (two requests' worth). Each an
    int >= 1, as ``E2EConfig``'s (BenchError when the config is made)."""

    prefixes: int = 4
    rounds: int = 3
    prefix_tokens: int = 256
    suffix_tokens: int = 16
    max_tokens: int = 4
    num_blocks: int = 40
    host_factor: int = 16
    block_size: int = 16
    repeats: int = 2

    def __post_init__(self) -> None:
        check_sizes(self)


def run_e2e_host(seed: int = 0, cfg: E2EHostConfig | None = None) -> dict[str, Any]:
    """Run the three set-ups; return per set-up the prefill tokens computed, host hits,
    mean TTFT (CPU ms, best of the repeats) and ``identical``. Returns ``{"skipped":
    why}`` when torch or the engine cannot be imported."""
    cfg = cfg or E2EHostConfig()
    try:
        import torch

        from ..engine import LlamaConfig, SamplingParams, build_engine
    except ImportError as exc:
        return {"skipped": f"needs torch and prefixkv.engine ({exc})"}
    model = LlamaConfig(seed=seed)
    rng = random.Random(f"e2e-host/{seed}")
    heads = [[rng.randrange(1, model.vocab_size) for _ in range(cfg.prefix_tokens)]
             for _ in range(cfg.prefixes)]
    prompts = [heads[i % cfg.prefixes] + [rng.randrange(1, model.vocab_size)
                                          for _ in range(cfg.suffix_tokens)]
               for i in range(cfg.prefixes * cfg.rounds)]
    params = SamplingParams(max_tokens=cfg.max_tokens)
    setups: dict[str, dict[str, Any]] = {"no cache": dict(enable_caching=False),
              "device only": dict(enable_caching=True),
              f"host tier {cfg.host_factor}x": dict(host_blocks=cfg.host_factor * cfg.num_blocks)}

    def run(kwargs: dict[str, Any]) -> tuple[list[RequestOutput], float]:
        engine = build_engine(model, num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                              max_num_seqs=1, **kwargs)
        ttfts: list[float] = []
        for p in prompts:  # one at a time: a request's TTFT is its first step
            t0 = time.process_time()
            engine.add_request(p, params)
            engine.step()
            ttfts.append(time.process_time() - t0)
            while engine.has_unfinished():
                engine.step()
        outs = [o for o in engine.take_finished()]
        return outs, sum(ttfts) / len(ttfts)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        build_engine(model, num_blocks=cfg.num_blocks).generate([prompts[0][:32]], params)  # warm-up
        best: dict[str, float] = {}
        outs: dict[str, list[RequestOutput]] = {}
        for _ in range(cfg.repeats):
            for name, kwargs in setups.items():
                outs[name], ttft = run(kwargs)
                best[name] = min(best.get(name, ttft), ttft)
    finally:
        torch.set_num_threads(threads)
    tokens = {name: [o.token_ids for o in out] for name, out in outs.items()}
    rows = [{"setup": name, "prefill_tokens": sum(o.metrics.num_prefill_tokens for o in out),
             "cached_tokens": sum(o.metrics.num_cached_tokens for o in out),
             "ttft_cpu_ms": 1e3 * best[name]} for name, out in outs.items()]
    desc = (f"tiny Llama ({model.num_layers} layers, hidden {model.hidden_size}, random weights) "
            f"on the CPU, 1 torch thread; {cfg.prefixes} prefixes of {cfg.prefix_tokens} tokens "
            f"asked {cfg.rounds} times in rotation (+{cfg.suffix_tokens} tokens each), one "
            f"request at a time, {cfg.num_blocks} device blocks of {cfg.block_size}")
    return {"model": desc, "config": cfg.__dict__, "rows": rows,
            "identical": all(t == tokens["no cache"] for t in tokens.values())}
