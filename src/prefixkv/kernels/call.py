"""One ``paged_prefill_attention`` call's arguments as one value, for the checks that every
backend runs on it (``validation.check_attention``): the backends' entry points spell the
contract's parameters, and hand them on as one :class:`AttentionCall` instead of as
eighteen parameters again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .workspace import SplitWorkspace

__all__ = ["AttentionCall"]


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """The arguments of one :func:`prefixkv.kernels.paged_prefill_attention` call as the
    caller gave them (unchecked: a field may hold anything; the checks name it), but for
    ``backend``. Shapes and meaning as that function's docstring."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    softmax_scale: float | None = None
    causal: bool = True
    window_size: tuple[int, int] | None = None
    softcap: float = 0.0
    out: torch.Tensor | None = None
    return_lse: bool = False
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    checked: bool = False
    split_workspace: SplitWorkspace | None = None

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The call's tensor arguments by name, ``out`` included and the workspace's
        aside: what an ``out`` or a workspace must share no memory with."""
        return {"q": self.q, "k_cache": self.k_cache, "v_cache": self.v_cache,
                "block_table": self.block_table, "cu_seqlens_q": self.cu_seqlens_q,
                "seqused_k": self.seqused_k, "out": self.out, "sinks": self.sinks,
                "k_scale": self.k_scale, "v_scale": self.v_scale}
