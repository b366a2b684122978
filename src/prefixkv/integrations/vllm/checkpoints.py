"""Mamba's chunk-end checkpoint blocks (vLLM's ``MambaSpec.num_prefill_checkpoint_blocks``)
through the plug-in: which layouts get them (``read_checkpoints``), the blocks a step
takes for them (``step_blocks``: vLLM's ``get_num_blocks_to_allocate`` counts them) and
the entries a step records inside a block (``inner``: vLLM notes their hashes as cached
in the step, ``mamba.StepCache``).

prefixkv's hybrid manager takes them (``BlockSizes.checkpoints``, groups/checkpoints.py,
docs/groups.md "Chunk-end checkpoints") beside vLLM's fine-grained partial hits, with
any ``prefix_cache_retention_interval`` (retention.py gives it to the Mamba groups: with
0, vLLM's default, only a step reaching vLLM's ``prefill_end`` checkpoints,
``prefill_end``), beside Mamba's speculative blocks (a checkpoint on a block ahead keeps
it there: ``running``), and no EAGLE (refused by ``options.check_options``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from prefixkv.groups import BlockSizes
from prefixkv.groups.checkpoints import evicted, position, retained

from .layout import UnsupportedByPrefixKV

__all__ = ["inner", "prefill_end", "read_checkpoints", "reserved", "running", "step_blocks"]


def read_checkpoints(kv_cache_config: KVCacheConfig, partial: bool, one_size: bool = False) -> int | None:
    """The alignment of the Mamba groups' checkpoints (their ``prefill_checkpoint_alignment``),
    or None when they take none (no checkpoint blocks, or no alignment: vLLM's
    ``is_mamba_prefill_checkpoint_valid`` is then never true). Raises
    UnsupportedByPrefixKV for checkpoint blocks prefixkv does not serve: without vLLM's
    fine-grained partial hits (``partial``) but where every group, the hash block and
    the scheduler's are of one size (``one_size``: a checkpoint then ends its block), or
    not the same in every Mamba group."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if type(g.kv_cache_spec) is MambaSpec]
    got = {(s.num_prefill_checkpoint_blocks > 0, s.prefill_checkpoint_alignment) for s in specs}
    if not any(on for on, _ in got):
        return None
    what = "prefixkv offers Mamba's chunk-end checkpoint blocks (num_prefill_checkpoint_blocks)"
    if len(got) > 1:
        raise UnsupportedByPrefixKV(f"{what} alike in every Mamba group only, got {sorted(got, key=str)}")
    if not partial and not one_size:
        raise UnsupportedByPrefixKV(f"{what} with vLLM's fine-grained partial hits (a Mamba block "
                                    f"larger than the hash block beside full attention of the hash "
                                    f"block's size) or at one block size (every group, the hash "
                                    f"block and the scheduler's) only; docs/groups.md")
    alignment: int | None = next(iter(got))[1]
    return alignment


def prefill_end(retention_interval: int | None, request: Any) -> int:
    """vLLM's ``prefill_end`` for a step of ``request`` (a vLLM ``Request``) under
    ``retention_interval``: with 0, ``max(num_prompt_tokens, num_tokens - 1)``, the end a
    step must reach to checkpoint (its prompt's last chunk); else 0, as vLLM's
    coordinator passes it (any step)."""
    return max(request.num_prompt_tokens, request.num_tokens - 1) if retention_interval == 0 else 0


def _taken(sizes: BlockSizes, sparse: Sequence[bool], rows: Sequence[Sequence[Any]], start: int,
           end: int, null: Any, last: int = 0, gap: int = 1) -> list[tuple[int, int, int]]:
    """The Mamba groups (``sparse``) a step from ``start`` to ``end`` checkpoints in, with
    each one's position and entry: those whose table (``rows``, before the step, vLLM's block ids
    or none; ``null`` its null entry) is empty where the checkpoint goes, when ``end`` is
    not below ``last`` (``prefill_end``); ``gap``: ``position``'s (lookahead hashing's)."""
    got = []
    for g, is_sparse in enumerate(sparse):
        ck = position(sizes, sizes.sizes[g], start, end, last, gap) if is_sparse else None
        if ck is not None and (ck[1] >= len(rows[g]) or rows[g][ck[1]] == null):
            got.append((g, *ck))
    return got


def running(rows: Sequence[Sequence[Any]], ahead: Sequence[int]) -> list[Sequence[Any]]:
    """A live request's ``rows`` (its tables, vLLM's ids) without each group's ``ahead``
    blocks at their end (Mamba's speculative blocks): where a checkpoint lands on one,
    vLLM's ``_needs_internal_checkpoint`` takes the entry as empty, as ``_taken`` must."""
    return [row[:len(row) - a] for row, a in zip(rows, ahead, strict=True)]


def step_blocks(sizes: BlockSizes, sparse: Sequence[bool], rows: Sequence[Sequence[Any]], start: int,
                end: int, null: Any, last: int = 0, gap: int = 1) -> int:
    """How many checkpoint blocks a step from ``start`` to ``end`` takes (``_taken``)."""
    return len(_taken(sizes, sparse, rows, start, end, null, last, gap)) if sizes.checkpoints else 0


def inner(sizes: BlockSizes, sparse: Sequence[bool], before: Sequence[Sequence[int]], start: int, end: int,
          after: tuple[list[int], ...], prompt: int, junction: int, last: int = 0, gap: int = 1,
          retention: Sequence[int | None] = ()) -> int:
    """The checkpoints of a step from ``start`` to ``end`` (``_taken``, its tables
    ``before`` and ``after`` it, vLLM's ids, 0 the null block's) of a request whose prompt
    has ``prompt`` tokens and whose junction is ``junction``: each one inside a block is
    set to 0 in ``after`` (vLLM notes no whole block there: it holds the state at the
    checkpoint); the one recorded as an entry (at the prompt's last hash boundary or the
    junction, the same in every group), or 0; ``last``: ``prefill_end``; ``gap``: the
    tokens the prompt's last boundary leaves (1; lookahead hashing's L: ``position``);
    ``retention``: each group's (none: dense), for one vLLM evicts (groups/checkpoints.py
    ``evicted``), set to 0 too."""
    got, tail = 0, sizes.replay_at(prompt, gap)
    for g, c, j in _taken(sizes, sparse, before, start, end, 0, last, gap):
        if retention and evicted(sizes, retention[g], sizes.sizes[g], c, j, tail, (junction,)):
            after[g][j] = 0
        elif c != (j + 1) * sizes.sizes[g]:  # (inside its block, or EAGLE's at one size: entry j - 1's)
            after[g][j] = 0
            if c in (tail, junction) or c == j * sizes.sizes[g] and retained(
                    retention[g] if retention else None, sizes.sizes[g], c):
                got = c
    return got


def reserved(manager: Any, group: int) -> dict[str, tuple[int, int]]:
    """vLLM's ``MambaManager._checkpoints`` of ``group``: live vLLM request id -> the
    checkpoint ``(c, j)`` its last step reserved there (the position the worker writes
    the state at, the table entry of its block), from the hybrid manager's notes
    (groups/checkpoints.py ``note``); a note of an earlier step than the request's last
    is not its step's (vLLM pops it at the next step that reserves none). A fresh dict."""
    steps = getattr(manager.core, "_checkpoints", None)
    if not steps:
        return {}
    core, got = manager.core, {}
    for rid, key in manager._keys.items():
        note = steps.get(key)
        if note is None or note[0] != core.num_scheduled_tokens(key):
            continue
        for g, c, j in note[1]:
            if g == group:
                got[rid] = (c, j)
    return got
