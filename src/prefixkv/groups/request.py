"""Per-request state of a hybrid manager: one block table per group.

    | cached prefix (hits) | scheduled, computed by the engine | known, not scheduled |
    0                num_cached                       num_scheduled          len(tokens)

Each group's table covers ``[0, max(num_scheduled, num_reserved))`` (``num_reserved``:
slots reserved past the scheduled tokens, whose tokens are not known yet); entry j is
the block holding positions ``j*bs .. (j+1)*bs - 1`` in that group, or None where the
group released it (no query of the request reads it any more): a prefix of the table,
``cut[g]`` entries long, in groups whose spec releases (a ``sparse`` group, Mamba, also
has None past its cut: the positions steps jumped over, and reserved slots).
``nodes[j]`` is the prefix id of full block j (every full scheduled block has one); the
request holds a reference on the last. After a lost one (KV found invalid:
``PrefixTable.forget``) every later one is lost, and its blocks hold no prefix, unless a
request sharing one recomputed it (the same tokens, under a new prefix id).
``step_start``: where the last scheduled step began (its queries sit at and after it);
after a ``rewind``, which undoes no release, it may lie past ``num_scheduled``.
``next_release``: the first step start at which some group releases a block.
``release_bound``: None, or a position no window release goes past (``bound_release``).
``tainted_from``: None, or the first position whose KV the request computes from a
context it lost (a recompute after a ``rewind`` past what a window released: taint.py);
no full block holding a position at or after it is cached.
``sound_from``: beside an uncached window (``GroupSpec.cached``), per group, the first
position whose KV its blocks hold since admission (0 in the others): those a load wrote
(from the hit on) and those the engine rebuilt (from ``first_needed`` of the first query's
position), so a recompute reading below them reads lost KV (taint.py); else None.
``states``: with groups of different sizes (groups/sized.py), the entries ``(g, j)`` of
sparse groups whose block holds the state at its own end (a step ended there: the only
ones recorded); None until one does.
``losses``: the index's ``GroupIndex.losses`` when the request was admitted (a fork: its
parent's), -1 if unknown. While the index's count is still that and the request is not
tainted, every full-attention group finds each of its ``nodes`` (``free_runs.finder``
counts on it; ``free_runs.unfound`` checks it): its hits were found at admission, the
blocks it computes are recorded (primaries or spares), and a held block loses its
content only through ``uncache``, which counts.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Hashable, Sequence

from ..core.block import Block, blocks_for
from ..core.lookahead import LookaheadKeys
from ..core.prompt import Prompt
from ..core.request import RequestKeys
from ..hashing import token_bytes
from . import spec_states
from .prefixes import Prefix
from .sizes import BlockSizes
from .spec import GroupSpec


class GroupRequest:
    __slots__ = ("request_id", "tokens", "keys", "tables", "cut", "nodes", "num_cached",
                 "num_scheduled", "num_reserved", "step_start", "next_release", "release_bound",
                 "prompt", "tainted_from", "losses", "num_prompt", "states", "sound_from", "marks")

    def __init__(self, request_id: Hashable, tokens: array[int], keys: RequestKeys, num_groups: int) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.keys = keys
        self.tables: list[list[Block | None]] = [[] for _ in range(num_groups)]
        self.cut = [0] * num_groups
        self.nodes: list[Prefix] = []
        self.num_cached = 0
        self.num_scheduled = 0
        self.num_reserved = 0
        self.step_start = 0
        self.next_release = 0
        self.release_bound: int | None = None
        self.prompt: Prompt | None = None  # a prepared prompt, until its prefill is scheduled
        self.tainted_from: int | None = None
        self.losses = -1
        self.num_prompt = len(tokens)  # (vLLM's num_prompt_tokens: where a partial tail is cached)
        self.states: set[tuple[int, int]] | None = None  # (groups/sized.py ``_mark``)
        self.sound_from: list[int] | None = None
        # positions whose window blocks a group's retention keeps cached (``BlockSizes.caches``):
        # the prompt's replay boundary and the shared-prefix junction (``add_request``)
        self.marks: tuple[int, ...] = ()

    def release(self, going: Sequence[Sequence[Block | None]]) -> list[Block]:
        """Replace each group's blocks in ``going`` (the next ones after its cut) by None
        and return them in release order: group by group, each group's last block first,
        as vLLM's ``remove_skipped_blocks`` frees them (so the same ones are evicted
        first: by position over all groups, a chunked group's blocks 0..2 outlived the
        window's block 1 that the hit at 12 reads, which vLLM keeps)."""
        out: list[Block] = []
        for g, part in enumerate(going):
            if part:
                cut = self.cut[g]
                out += [b for b in reversed(part) if b is not None]  # (a sparse group's
                self.tables[g][cut:cut + len(part)] = [None] * len(part)  # jumped-over entries)
                self.cut[g] = cut + len(part)
        return out

    def plan_release(self, specs: Sequence[GroupSpec], sizes: Sequence[int]) -> None:
        """Set ``next_release`` from the groups' cuts (``sizes``: each group's block size)."""
        self.next_release = min(s.release_at(c, b) for s, c, b in zip(specs, self.cut, sizes, strict=True))

    def check(self, specs: Sequence[GroupSpec], sizes: BlockSizes,
              marked: Collection[tuple[int, int]] = ()) -> str | None:
        """The first way the tables disagree with the tokens and the specs, None when
        sound (``sizes``: the manager's; ``nodes`` are at ``sizes.hash_size``, group g's
        block j holds ``nodes[sizes.key_index(g, j)]``, but the (g, j) ``marked``: a
        checkpoint holding a shorter prefix, groups/checkpoints.py)."""
        h, rid = sizes.hash_size, self.request_id
        keyed = self.num_scheduled // h  # (under lookahead keys, the blocks whose keys are known)
        if isinstance(self.keys, LookaheadKeys):
            keyed = min(keyed, len(self.keys.mm))  # type: ignore[arg-type]
        if len(self.nodes) != keyed or self.num_scheduled > len(self.tokens):
            return (f"request {rid!r}: {len(self.nodes)} prefix ids for {self.num_scheduled} "
                    f"scheduled of {len(self.tokens)} tokens")
        parent = 0
        for j, node in enumerate(self.nodes):
            chunk = token_bytes(self.tokens[j * h:(j + 1) * h])
            if node.key != (parent, chunk, self.keys.of_blocks(j, j + 1)[0]):
                return f"request {rid!r}: prefix id of block {j} does not hold its content"
            parent = node.pid
        for g, (spec, table, bs) in enumerate(zip(specs, self.tables, sizes.sizes, strict=True)):
            want, cut = blocks_for(max(self.num_scheduled, self.num_reserved), bs) + spec.ahead, self.cut[g]
            if len(table) != want or (not spec.sparse and any(b is None for b in table[cut:])) or \
                    any(b is not None for b in table[:cut]):
                return f"request {rid!r} group {g}: table {table} for {want} blocks, cut {cut}"
            if spec.sparse and spec.ahead and (why := spec_states.check(table, spec.ahead)):
                return f"request {rid!r} group {g}: {why}"
            if cut > spec.num_unread(self.step_start, bs):
                return (f"request {rid!r} group {g}: {cut} blocks released, but a query at "
                        f"{self.step_start} still reads block {spec.num_unread(self.step_start, bs)}")
            for j in range(cut, min(self.num_scheduled, keyed * h) // bs):
                b, node = table[j], self.nodes[sizes.key_index(g, j)]
                if b is None or (g, j) in marked:
                    continue
                if b.key is not None and (  # (a lost prefix's block, which
                        b.key[1:] != node.key[1:] if node.lost  # a sharer recomputed: the
                        else b.key is not node.key):  # same tokens under a new prefix)
                    return f"request {rid!r} group {g}: block {j} holds another prefix"
            if self.tainted_from is not None:
                for j in range(self.tainted_from // bs, self.num_scheduled // bs):
                    if (b := table[j]) is not None and b.key is not None:
                        return (f"request {rid!r} group {g}: block {j} is cached, but its KV "
                                f"was computed from {self.tainted_from} on over lost KV")
        return None

