"""What the saved prefill would have cost on a real model: an estimate, to set the
allocator's own time against it.

The replay counts prompt tokens served from the cache and, for attention, the (query,
key) pairs of their causal prefill (``ReplayResult.prefill_saved_pairs``). A model shape
turns both into FLOPs; an assumed throughput turns FLOPs into seconds. Nothing here
runs a model: the figure is an estimate and is reported as one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """A decoder-only transformer's prefill at a fixed throughput.

    Defaults: a Llama-3-8B-like shape (32 layers, hidden 4096, 32 query / 8 KV heads of
    128, MLP 14336, gated) at 400 TFLOP/s, about 40% of an H100 SXM's dense bf16 peak
    (989 TFLOP/s). A faster GPU makes the saved prefill cheaper, so this assumption
    makes the allocator's share look larger, not smaller.
    """

    name: str = "Llama-3-8B-like"
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    tflops: float = 400.0

    @property
    def linear_params(self) -> int:
        """Weights multiplied per token: q, k, v, o projections and the gated MLP (the
        LM head runs for the last prompt token only and is left out)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer

    def flops(self, tokens: int, pairs: int) -> float:
        """FLOPs of prefilling ``tokens`` tokens whose causal attention spans ``pairs``
        (query, key) pairs: 2 per weight per token, and per pair and head 2 for QK^T and
        2 for PV."""
        return 2.0 * self.linear_params * tokens + 4.0 * self.layers * self.heads * self.head_dim * pairs

    def seconds(self, tokens: int, pairs: int) -> float:
        """``flops(tokens, pairs)`` at ``tflops``, in seconds."""
        return self.flops(tokens, pairs) / (self.tflops * 1e12)

    def describe(self) -> str:
        return (f"{self.name} ({self.layers} layers, hidden {self.hidden}, {self.heads}/"
                f"{self.kv_heads} heads of {self.head_dim}, MLP {self.intermediate}; "
                f"{2 * self.linear_params / 1e9:.1f} GFLOP/token + attention) at an assumed "
                f"{self.tflops:g} TFLOP/s")


def allocator_share(result: dict[str, Any], cost: PrefillCost) -> float | None:
    """The allocator's own time in a replay (admissions + decode appends) over the
    estimated prefill time of the tokens it served from the cache; None when it saved
    nothing. ``result``: ``ReplayResult.to_dict()``."""
    if not result.get("prefill_saved"):
        return None
    own: float = (result["admit_ns"] + result["decode_ns"]) / 1e9
    return own / cost.seconds(result["prefill_saved"], result["prefill_saved_pairs"])
