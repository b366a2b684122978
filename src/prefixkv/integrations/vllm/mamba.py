"""What a Mamba group (``prefixkv.groups.mamba``, vLLM's ``mamba_cache_mode="align"``)
adds to ``manager.KVCacheManager``: the calls it refuses, and vLLM's rule that a new
request does not start from a Mamba state cached in the same step.

vLLM's ``MambaManager`` answers "more blocks than the pool has" for a new request whose
hit ends on a Mamba block whose content (its chain hash, in that group) was cached since
the step began (``new_step_starts``): that state is written by the step's own forward
pass, so the request waits for the next step (``allocate_slots`` returns None).
``StepCache`` keeps those hashes: the ``request.block_hashes`` of the blocks each Mamba
group made findable in this step, by any request; with vLLM's fine-grained partial hits
(groups/partial.py) also the hash of each partial entry recorded in this step, and of
each entry that moved to a copy in it (the copy is filled by this step's copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.request import Request

from prefixkv.groups import BlockSizes, GroupSpec

from . import checkpoints
from .layout import UnsupportedByPrefixKV
from .offloads import BoundaryOffers, hand_tails, inside, offer, tails
from .slots import admission_prompt

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["StepCache", "allocating", "check_call", "check_landing", "junction", "noting"]


def check_call(m: KVCacheManager, num_lookahead_tokens: int, num_external_computed_tokens: int) -> None:
    """Raises UnsupportedByPrefixKV, before any change, for what prefixkv does not offer
    beside a Mamba group: lookahead slots (vLLM's align mode leaves them out of its
    Mamba group only), and tokens a connector loads beside EAGLE, lookahead hashing,
    Mamba's chunk-end checkpoints, its sparse retention or speculative blocks or full
    attention larger than the hash block (its copies on write: hit_caps.py; loads are served beside
    the rest: the Mamba group takes the block where the load ends, groups/loads.py)."""
    if not m._mamba.groups:
        return
    if num_lookahead_tokens:
        raise UnsupportedByPrefixKV(f"prefixkv does not offer lookahead slots beside a Mamba group "
                                    f"(num_lookahead_tokens={num_lookahead_tokens})")
    if num_external_computed_tokens and (m.use_eagle or m._serves_lookahead or m._mamba.checkpoints
                                         or m._mamba.kept or m.reprefill_tokens or m._hit_caps
                                         or getattr(m.core, "_ahead", None) is not None):
        raise UnsupportedByPrefixKV(f"prefixkv does not offer connector-loaded tokens beside a Mamba "
                                    f"group with EAGLE, lookahead hashing, Mamba's chunk-end checkpoints, "
                                    f"its sparse retention, multi-module MTP's re-prefillable tokens, "
                                    f"its speculative blocks or full attention larger than the hash block "
                                    f"(num_external_computed_tokens={num_external_computed_tokens})")


def check_landing(m: KVCacheManager, request: Request, num_computed_tokens: int) -> None:
    """``cache_blocks`` of a request whose load lands now (``StepCache.loading``):
    raises UnsupportedByPrefixKV, nothing changed, unless it caches up to where the
    load ends (a load that failed beside a Mamba group: the state where vLLM's
    scheduler resumes it was never written, and vLLM's manager holds no block there);
    else the request is no longer loading."""
    end = m._mamba.loading.get(request.request_id)
    if end is None:
        return
    if num_computed_tokens != end:
        raise UnsupportedByPrefixKV(f"prefixkv does not offer a failed load beside a Mamba group "
                                    f"(cache_blocks of {num_computed_tokens} tokens, the load ends at "
                                    f"{end}: no block holds the state there)")
    del m._mamba.loading[request.request_id]


class StepCache:
    """The chain hashes each Mamba group cached since the step began (module docstring)."""

    def __init__(self, groups: tuple[int, ...], first: int = 0, sizes: BlockSizes | None = None,
                 specs: Sequence[GroupSpec] = ()) -> None:
        self.groups = groups
        """The Mamba groups' indices."""
        self.kept = [specs[g] for g in groups if specs[g].retention is not None] if specs else []
        """The Mamba groups' specs when they have a ``retention`` (vLLM's sparse retention:
        ``note`` notes only the blocks they record), else empty."""
        self.sizes = sizes
        """Each group's block size and the hash block's (None: one size, that of the
        blocks ``note`` and ``defers`` are given in, the hash block's too)."""
        self.partial = sizes is not None and sizes.partial
        """vLLM's fine-grained partial hits are on (groups/partial.py)."""
        self.checkpoints = sizes is not None and sizes.checkpoints
        """Mamba's chunk-end checkpoint blocks are on (checkpoints.py)."""
        self.first = first
        """The group vLLM's coordinator looks a hit up in first (full attention's, if
        any, else group 0): its own hit is ``junction``'s."""
        self.offers = BoundaryOffers()
        """The blocks offered to a connector, until taken (offloads.py)."""
        self.loading: dict[str, int] = {}
        """Requests admitted with a load that lands later (``delay_cache_blocks``): the
        tokens it ends at, until ``cache_blocks`` there (``check_landing``)."""
        self._cached: set[tuple[int, Any]] = set()

    def clear(self) -> None:
        """A step begins."""
        self._cached.clear()

    def note(self, request: Request, rows: tuple[list[int], ...], first: int, last: int,
             null: int) -> list[tuple[int, int, int]]:
        """The request's full blocks in tokens ``first .. last - 1`` were made findable
        now (with ``sizes``, ``first`` and ``last`` are tokens; else blocks): note those a
        Mamba group holds (``rows``: its vLLM block ids per group; ``null``: the null
        block's id, an entry the step jumped over) under their keys (the hash at each
        block's last hash boundary, as vLLM keys them); with a retention (``kept``), only
        those ``BlockSizes.caches`` records (vLLM notes no block its sparse retention
        leaves uncached). Returns those blocks, ``(group, block index, block id)``,
        group after group in index order."""
        hashes, sizes, got = request.block_hashes, self.sizes, []
        marks = (request.num_prompt_tokens - 1, request.shared_prefix_boundary) if self.kept else ()
        for k, g in enumerate(self.groups):
            row, lo, hi = rows[g], first, last
            if sizes is not None:
                lo, hi = first // sizes.sizes[g], last // sizes.sizes[g]
            for j in range(lo, min(hi, len(row))):
                i = j if sizes is None else sizes.key_index(g, j)
                if row[j] != null and i < len(hashes) and (
                        not marks or sizes is None or sizes.caches(self.kept[k], g, last, j, marks)):
                    self._cached.add((g, hashes[i]))
                    got.append((g, j, row[j]))
        return got

    def note_tail(self, request: Request, num_tokens: int) -> None:
        """The partial entries at ``num_tokens`` (the request's prompt's last hash
        boundary, inside the Mamba blocks) were recorded, or moved to a copy, now."""
        assert self.sizes is not None
        i = num_tokens // self.sizes.hash_size - 1
        if 0 <= i < len(request.block_hashes):
            self._cached.update((g, request.block_hashes[i]) for g in self.groups)

    def defers(self, request: Request, num_hit_tokens: int, block_size: int) -> bool:
        """Whether a new request with a hit of ``num_hit_tokens`` must wait a step: its
        hit ends on a block some Mamba group cached in this step (``block_size``: the
        hash block's; a hit is a whole number of every group's blocks)."""
        j = num_hit_tokens // block_size - 1
        if j < 0 or not self._cached or j >= len(request.block_hashes):
            return False
        h = request.block_hashes[j]
        return any((g, h) in self._cached for g in self.groups)


def allocating(m: KVCacheManager, request: Request, hit: int, run: Any) -> Any:
    """``noting(m, request, hit, run)`` for ``allocate_slots``: for
    a running request, the blocks it returns hold, in a Mamba group, its table past its
    length before, the null entries the step jumped over included, as vLLM's
    ``MambaManager`` returns them (the worker appends them to its block table). Called
    for steps of two tokens or more (one jumps no entry)."""
    key = m._keys.get(request.request_id)
    if key is None:
        return noting(m, request, hit, run)
    lengths = [len(ids) for ids in m.core.get_block_ids(key)]
    out = noting(m, request, hit, run)
    if out is None or not any(out.get_block_ids()[g] for g in m._mamba.groups):
        return out
    now, k = m.core.get_block_ids(key), m._blocks.offset
    return m._blocks.of(tuple(now[g][lengths[g]:] if g in m._mamba.groups else [i - k for i in ids]
                              for g, ids in enumerate(out.get_block_ids())))


def noting(m: KVCacheManager, request: Request, hit: int, run: Any) -> Any:
    """``run()`` (an allocation or caching call on ``request``, whose new request has a
    hit of ``hit`` tokens), with the Mamba groups' cached blocks noted; None without
    running it when a new request's hit must wait a step (``StepCache.defers``)."""
    if m._mamba.partial:
        return _noting_partial(m, request, hit, run)
    bs, key = m.block_size, m._keys.get(request.request_id)  # (bs: the alignment of caching)
    if key is None and hit and m._mamba.defers(request, hit, m.hash_block_size):
        return None
    unit = 1 if (sizes := m._mamba.sizes) is not None else bs  # (tokens with different sizes, else blocks)
    first = hit // unit if key is None else m.core.num_scheduled_tokens(key) // bs * bs // unit
    rows = _before(m, key) if sizes is not None and sizes.eagle else ()  # (EAGLE's checkpoints at one size)
    start = (hit if key is None else m.core.num_scheduled_tokens(key)) if rows else 0
    out = run()
    key = m._keys.get(request.request_id)
    if key is not None and m.enable_caching:
        last = m.core.num_scheduled_tokens(key) // bs * bs // unit
        if last > first:
            if rows:
                now, kept = _checkpointed(m, request, rows, start, m.core.num_scheduled_tokens(key))
                offer(m, request, m._mamba.note(request, now, first, last, 0), kept)
            else:
                offer(m, request, m._mamba.note(request, m.get_block_ids(request.request_id), first, last, 0))
    return out


def _noting_partial(m: KVCacheManager, request: Request, hit: int, run: Any) -> Any:
    """``noting`` with vLLM's fine-grained partial hits: caching at the hash block (in
    tokens), and the partial entries recorded or moved to a copy by ``run()`` noted too."""
    h, key = m.hash_block_size, m._keys.get(request.request_id)
    if key is None and hit and m._mamba.defers(request, hit, h):
        return None
    before = hit if key is None else m.core.num_scheduled_tokens(key)
    moves = 0 if key is None else m.core.num_pending_copies(key)
    owned = tails(m, key) if moves and key is not None else []  # (its partial tails: offloads.py)
    rows = _before(m, key) if m._mamba.checkpoints else ()  # (checkpoints.py)
    out = run()
    key = m._keys.get(request.request_id)
    if key is not None and m.enable_caching:
        after, p = m.core.num_scheduled_tokens(key), request.num_prompt_tokens
        tail = m.core.sizes.replay_at(p, m._tail_gap)  # (the core's partial.tail: EAGLE's, lookahead's)
        pending = m.core.num_pending_copies(key)
        if moves or pending:  # (tails moved to a copy, or recorded: offloads.py)
            hand_tails(m, request, key, owned, after)
        if after // h > before // h:
            now, kept = _checkpointed(m, request, rows, before, after)
            offer(m, request, m._mamba.note(request, now, before // h * h, after // h * h, 0), kept)
        if moves > pending or (before < tail == after and pending):  # (moved to its copy; recorded)
            m._mamba.note_tail(request, tail)
        elif pending and m.mamba_shared_prefix_checkpoint and \
                before < request.shared_prefix_boundary == after:
            m._mamba.note_tail(request, after)  # (recorded at the junction: partial.tail)
    return out


def _checkpointed(m: KVCacheManager, request: Request, rows: Any, before: int,
                  after: int) -> tuple[Any, list[tuple[int, int, int]]]:
    """The request's tables after a step from ``before`` to ``after`` tokens (``rows``:
    before it, with checkpoints; else empty), with its checkpoints that hold no state at
    their block's end taken out (``checkpoints.inner``), and those recorded as entries,
    offered at their position (noted too)."""
    now = m.get_block_ids(request.request_id)
    kept: list[tuple[int, int, int]] = []
    if rows and (sizes := m._mamba.sizes) is not None:  # (a checkpoint in a block: its entry)
        sparse = [g in m._mamba.groups for g in range(len(now))]
        ids, now = now, tuple(list(row) for row in now)
        c = checkpoints.inner(sizes, sparse, rows, before, after, now, request.num_prompt_tokens,
                              request.shared_prefix_boundary,
                              checkpoints.prefill_end(m.retention_interval, request), m._tail_gap,
                              [s.retention for s in m.core.groups] if sizes.eagle else ())
        if c:
            m._mamba.note_tail(request, c)
            kept = inside(m._mamba.groups, ids, now, c)
    return now, kept


def junction(m: KVCacheManager, request: Request, hit: int, max_cache_hit_length: int | None) -> int:
    """vLLM's ``shared_prefix_boundary`` (``get_computed_blocks``' third value) beside a
    Mamba group or a window's retention (retention.py): the prefix the first group of
    vLLM's lookup (``StepCache.first``: full attention there) alone could serve, capped
    at ``max_cache_hit_length``, when longer than the ``hit`` all groups serve (a shared
    prefix whose Mamba state no block holds: vLLM's scheduler ends the request's chunk
    there, so that its state is cached; a window's tail there stays cached); else 0."""
    if not m._junctions or not m.prefix_cache_lookup_enabled(request):
        return 0
    prompt, extra = admission_prompt(m, request)
    first, unit = m._mamba.first, m.cache_unit  # (vLLM aligns hits to the lcm, or the hash block)
    if m.eagle_groups and m.eagle_groups[first]:
        alone = _eagle_alone(m, request, prompt, extra, max_cache_hit_length)
    else:
        alone = m.core.lookup_per_group(prompt, extra=extra)[first] // unit * unit
        if max_cache_hit_length is not None:
            alone = min(alone, max_cache_hit_length // unit * unit)
    return alone if alone > hit else 0


def _eagle_alone(m: KVCacheManager, request: Request, prompt: Any, extra: Any, cap: int | None) -> int:
    """``junction``'s prefix when the first group is EAGLE's (``options.eagle_layout``):
    as vLLM's lookup finds it there, its run of cached blocks within the cap
    (``num_tokens - 1`` by default) plus one block (a hash block with partial hits) and
    the request's full blocks, less that block."""
    b: int = m.cache_unit  # (what EAGLE drops: a block at one size, else a hash block)
    n: int = request.num_tokens
    run: int = m.core.lookup_per_group(prompt, extra=extra, peek=True)[m._mamba.first]
    cap = n - 1 if cap is None else cap
    if not m.core.sizes.partial:  # (vLLM: its blocks within the cap and one block, less one, aligned)
        fb = m.group_sizes[m._mamba.first]
        run = min(run, min(cap + fb, n // m.hash_block_size * m.hash_block_size) // fb * fb)
        hit = run - min(b, fb) if run else 0
        return hit - hit % b
    return max(0, min(run, cap // b * b + b, n // b * b) - b)


def _before(m: KVCacheManager, key: int | None) -> Any:
    """The tables of the request ``key`` before its step (none for a new request)."""
    if key is None:
        return ((),) * m.num_kv_cache_groups
    return checkpoints.running(m.core.get_block_ids(key), [s.ahead for s in m.core.groups])
