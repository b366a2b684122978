"""A tiny Llama-style decoder with seeded random weights, for the example engine.

It knows nothing about paging: each layer's attention is delegated to a callable that the
caller supplies (the model runner passes one that writes K/V into the paged cache and calls
``paged_prefill_attention``; tests pass a dense causal one). Tokens of many sequences are
flattened into one batch of ``num_tokens`` rows, each with its absolute position::

    input_ids [num_tokens] -> embed -> L x (RMSNorm -> attn -> + -> RMSNorm -> SwiGLU -> +)
                           -> RMSNorm -> hidden [num_tokens, hidden_size] -> lm head
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attn(layer, q, k, v) -> out`` with ``q, out: [num_tokens, num_heads, head_dim]`` and
``k, v: [num_tokens, num_kv_heads, head_dim]`` (RoPE already applied to q and k)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the tiny model. ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA)."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [num_tokens, size]``; normalised in fp32, returned in x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [max_position, head_dim // 2]`` fp32 for rotary embeddings."""
    inv = cfg.rope_theta ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [num_tokens, heads, head_dim]`` (halves layout) by ``cos, sin:
    [num_tokens, head_dim // 2]`` taken at each token's absolute position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """``h: [num_tokens, hidden_size]`` -> same shape."""
        cfg = self.cfg
        n = h.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.qkv(self.input_norm(h)).split((q_size, kv_size, kv_size), dim=-1)
        q = apply_rope(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        h = h + self.o(attn(layer, q, k, v).reshape(n, q_size))
        gate, up = self.gate_up(self.post_norm(h)).chunk(2, dim=-1)
        out: torch.Tensor = h + self.down(nn.functional.silu(gate) * up)
        return out


class TinyLlama(nn.Module):
    """The model, its weights drawn from ``torch.Generator().manual_seed(cfg.seed)``.

    Weights are scaled so activations stay O(1) and logits are well spread: greedy argmax
    is then robust to the last-bit differences between batch shapes, which is what lets
    tests demand identical outputs with caching on and off.
    """

    cos: torch.Tensor  # [max_position, head_dim // 2] (buffers: typed for the reader and mypy)
    sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        gen = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                std = 1.0 if name == "embed.weight" else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        cos, sin = rope_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.to(cfg.dtype)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """``input_ids, positions: [num_tokens]`` int64 -> final hidden states
        ``[num_tokens, hidden_size]``. Raises IndexError for a position >= max_position."""
        cos, sin = self.cos[positions], self.sin[positions]
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(i, h, cos, sin, attn)
        out: torch.Tensor = self.norm(h)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [n, hidden_size]`` -> ``[n, vocab_size]`` fp32."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return (hidden @ weight.t()).float()


def dense_causal_attention(cu_seqlens: list[int]) -> AttentionFn:
    """An attention callable without any cache: sequence i owns rows ``cu_seqlens[i] :
    cu_seqlens[i+1]`` (its whole text from position 0) and attends causally within them.
    The oracle the paged path is compared with."""

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for lo, hi in pairwise(cu_seqlens):
            qi = q[lo:hi].transpose(0, 1).float()  # [heads, len, head_dim]
            ki = k[lo:hi].repeat_interleave(group, 1).transpose(0, 1).float()
            vi = v[lo:hi].repeat_interleave(group, 1).transpose(0, 1).float()
            o = nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
            out[lo:hi] = o.transpose(0, 1).to(q.dtype)
        return out

    return attn
