"""Checked mode (``checked=True``): read the metadata values and name the first bad one.

The default path never looks at the values inside ``slot_mapping``, ``block_table``,
``cu_seqlens_q`` or ``seqused_k`` on the host (that would synchronise with the device and
break CUDA graphs); the kernels instead keep every access inside the given tensors
(docs/kv_layout.md, "Untrusted metadata"). Checked mode is the debugging switch: it copies
what it needs to the host, synchronising, and raises :class:`MetadataError` naming the
request (or token) and the value, before anything is written. The checks of ``validation.py``
call it last, for both backends, once every check on shapes has passed.
"""

from __future__ import annotations

import torch

from .errors import MetadataError, TensorValueError

__all__ = ["check_slot_values", "check_attention_values", "check_scale_sink_values"]


def _first(bad: torch.Tensor) -> list[int] | None:
    """Index of the first True entry of ``bad`` (row-major), or None."""
    hits = bad.nonzero()
    return hits[0].tolist() if hits.shape[0] else None


def check_slot_values(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot is -1 or in ``[0, num_blocks * block_size)``, and no slot but -1 is
    given twice (two tokens into one slot: which one the cache keeps is undefined).

    Raises:
        MetadataError: naming the first token whose slot is outside that range, or the
            first token whose slot an earlier token has.
    """
    capacity = num_blocks * block_size
    hit = _first((slot_mapping < -1) | (slot_mapping >= capacity))
    if hit is not None:
        t = hit[0]
        raise MetadataError(
            f"token {t}: slot_mapping[{t}] = {int(slot_mapping[t])} outside [-1, {capacity}) "
            f"({num_blocks} blocks x {block_size} slots; -1 skips a token)"
        )
    first: dict[int, int] = {}
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0 and first.setdefault(slot, t) != t:
            raise MetadataError(f"token {t}: slot_mapping[{t}] = {slot} is token {first[slot]}'s slot too "
                                "(which token the cache keeps would be undefined)")


def _check_cu_seqlens(cu_seqlens_q: torch.Tensor, total_q: int) -> None:
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0:
        raise MetadataError(f"request 0: cu_seqlens_q[0] = {cu[0]}, must be 0")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise MetadataError(
                f"request {i}: cu_seqlens_q[{i + 1}] = {cu[i + 1]} < cu_seqlens_q[{i}] = {cu[i]} "
                "(must be non-decreasing)"
            )
    if cu[-1] != total_q:
        raise MetadataError(
            f"cu_seqlens_q[{len(cu) - 1}] = {cu[-1]}, must be total_q = {total_q}: "
            "every row of q belongs to a request"
        )


def check_attention_values(
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    total_q: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """The metadata of a validated attention call describe a batch inside its tensors.

    ``cu_seqlens_q`` runs from 0 to ``total_q`` without decreasing; ``seqused_k[i]`` is in
    ``[0, max_blocks * block_size]``; the block ids request i reads (its first
    ``ceil(seqused_k[i] / block_size)`` entries) are in ``[0, num_blocks)``; padding past
    them is not read and may hold anything. ``q_len > seqused_k[i]`` stays allowed.

    Raises:
        MetadataError: naming the request and the first value that breaks this.
    """
    _check_cu_seqlens(cu_seqlens_q, total_q)
    capacity = block_table.shape[1] * block_size
    hit = _first((seqused_k < 0) | (seqused_k > capacity))
    if hit is not None:
        i = hit[0]
        raise MetadataError(
            f"request {i}: seqused_k[{i}] = {int(seqused_k[i])} outside [0, {capacity}] "
            f"(block_table rows hold {block_table.shape[1]} blocks x {block_size} slots)"
        )
    n_blocks = (seqused_k.to(torch.int64) + block_size - 1) // block_size  # [batch] blocks read
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < n_blocks[:, None]
    hit = _first(used & ((block_table < 0) | (block_table >= num_blocks)))
    if hit is not None:
        i, j = hit
        raise MetadataError(
            f"request {i}: block_table[{i}, {j}] = {int(block_table[i, j])} outside [0, {num_blocks}) "
            f"(one of the {int(n_blocks[i])} blocks its {int(seqused_k[i])} keys use)"
        )


def check_scale_sink_values(k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            sinks: torch.Tensor | None = None) -> None:
    """fp8 scales are finite and >= 0 (0 is an all-zero head's ``amax / 448``); sinks are
    not NaN or ``+inf`` (``-inf`` is no sink).

    Raises:
        TensorValueError: naming the tensor, the entry and its value.
    """
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None:
            hit = _first(~((t >= 0) & (t < float("inf"))).reshape(-1))
            if hit is not None:
                raise TensorValueError(
                    f"{name}[{hit[0]}] = {float(t.reshape(-1)[hit[0]])}: an fp8 scale must be finite "
                    "and >= 0 (without checked mode it would act as 0)"
                )
    if sinks is not None:
        hit = _first(torch.isnan(sinks) | (sinks == float("inf")))
        if hit is not None:
            raise TensorValueError(
                f"sinks[{hit[0]}] = {float(sinks[hit[0]])}: a sink must not be NaN or +inf "
                "(without checked mode NaN is no sink and +inf makes the row's output 0)"
            )
