"""``ContentIndex.check`` and ``check_request``: what ``check_invariants()`` verifies of the
index and of each live request's blocks. Builds messages only for what is wrong."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from ..core.block import NO_CHILD, Block, ContentKey, key_chunk
from ..core.request import Request
from ..core.run import Run
from ..hashing import token_bytes

if TYPE_CHECKING:
    from .lower import LowerTier


def chunk_of(b: Block) -> bytes:
    """The token bytes of a block with content (its key, or the key's middle)."""
    return key_chunk(b.key)


def check_index(by_chunk: dict[bytes, Block], by_key: dict[ContentKey, Block],
                twins: dict[int, list[Block]], hashing: bool,
                blocks: Sequence[Block], num_chained: int, tiered: bool,
                pending: Collection[Run] = ()) -> str | None:
    """The first inconsistency between a ContentIndex's maps and ``blocks``, None when sound.
    No block found may be cut off from its parent's content (an orphan: no lookup reaches
    it, yet events announce it; ``uncache`` takes a forgotten content's descendants with
    it, and blocks filled under it later record no key). ``tiered``: a tier is below,
    whose walk may reach any content: no chained block may be either. ``pending``: the
    pending runs (``pending.py``), whose contents are their records', each block the
    chained child of the one before (the first its head's ``child``), outside
    ``num_chained``."""
    n = NO_CHILD  # (a ``Block``: written to, it could pass a guess's checks)
    if (n.key, n.chained, n.twin, n.parent_cid, n.content_id, n.counted, n.starts) != (
            b"", False, False, -1, -1, None, None) or n.child is not n or n.refs:
        return f"NO_CHILD was written to: {n!r}, key {n.key!r}"
    keyed: dict[int, Block] = {}  # content id -> the block keyed in the dicts for it
    homes: tuple[dict[bytes, Block] | dict[ContentKey, Block], ...] = (by_chunk, by_key)
    for home in homes:
        for key, b in home.items():
            chunk = key_chunk(key)
            if b.key != key or b.twin or b.chained or chunk_of(b) != chunk or not b.content_id:
                return f"index entry for {b!r} does not match its content"
            if home is by_key and key != (b.parent_cid, chunk, b.extra):
                return f"index entry for {b!r} is keyed by another content"
            if hashing and b.hash is None:
                return f"block {b.block_id} is indexed without its chain hash"
            keyed[b.content_id] = b
    for cid, listed in twins.items():
        for t in listed:
            p = keyed.get(cid)
            if p is None or not t.twin or not t.ref_cnt or t.key != p.key or \
                    t.parent_cid != p.parent_cid or t.extra != p.extra or t.content_id != cid:
                return f"twin {t!r} is not a held spare of an indexed content"
    found: dict[int, Block] = {}  # content id -> the block found for it (keyed or chained)
    contents: set[tuple[int, bytes, bytes]] = set()
    chained = []
    for b in blocks:
        if b.counted is not None and b.counted.pending:
            continue  # (below)
        if b.key is None:
            if b.chained:
                return f"block {b.block_id} is chained without content"
            continue
        if b.twin:
            if not b.ref_cnt:
                return f"spare block {b.block_id} is free but keeps its content"
            continue
        if b.chained:
            if type(b.key) is not bytes or b.content_id in twins or b.parent_cid in twins or \
                    by_chunk.get(b.key) is b:
                return f"chained block {b.block_id} is keyed, or its content or parent has spares"
            chained.append(b)
        elif (by_chunk.get(b.key) if isinstance(b.key, bytes) else by_key.get(b.key)) is not b:
            return f"block {b.block_id} has content but is neither indexed nor a twin"
        content = (b.parent_cid, chunk_of(b), b.extra)
        if content in contents or b.content_id in found:
            return f"block {b.block_id} holds a content that another block is found for"
        contents.add(content)
        found[b.content_id] = b
    for run in pending:
        cid = run.pcid
        for i, b in enumerate(run.blocks):
            content = (cid, run.chunk(i + 1), run.extra)
            cid = run.cid0 + i
            if content in contents or cid in found or cid in twins:
                return f"block {b.block_id} of {run!r} holds a content another block holds"
            contents.add(content)
            found[cid] = b
    if len(chained) != num_chained:
        return f"{len(chained)} chained blocks, the index counts {num_chained}"
    for b in found.values():  # (a pending run's head: below)
        if b.parent_cid and b.parent_cid not in found and (
                b.counted is None or not b.counted.pending):
            return f"block {b.block_id} is found but its parent's content is not on the device"
    for run in pending:  # reached through its head alone
        p = found.get(run.pcid)
        if p is None or p.child is not run.blocks[0] or p.starts is not run:
            return f"pending {run!r} is not its head's run and child"
    for b in chained:  # found through the block found for its parent's content, if any
        p = found.get(b.parent_cid)
        if p is None and tiered:
            return f"chained block {b.block_id} is cut off from its parent's content"
        if p is not None and p.child is not b:
            return f"chained block {b.block_id} is not its parent's child"
    return None

def check_request(req: Request, block_size: int) -> str | None:
    """The first full scheduled block of ``req`` whose content is not its own. A block
    with no content (``uncache_blocks``: its KV turned out invalid while ``req`` holds
    it) serves no hit, so only its place in the chain is checked: the blocks after it
    name its content id as their parent's, as when it was stored."""
    keys = req.keys.of_blocks(0, req.num_scheduled // block_size)
    cid = 0
    at: dict[int, dict[int, int]] = {}  # a pending run's blocks' places, by run
    for j, extra in enumerate(keys):
        b = req.blocks[j]
        chunk = token_bytes(req.tokens[j * block_size:(j + 1) * block_size])
        r = b.counted
        if r is not None and r.pending:  # its content is its run's record
            if id(r) not in at:
                at[id(r)] = {id(x): i for i, x in enumerate(r.blocks)}
            i = at[id(r)][id(b)]
            if (r.pcid if i == 0 else r.cid0 + i - 1, r.chunk(i + 1),
                    r.extra) != (cid, chunk, extra):
                return (f"request {req.request_id!r} block {j} (id {b.block_id}) of pending "
                        f"{r!r} does not hold the request's content")
            cid = r.cid0 + i
            continue
        if b.key is None and b.ref_cnt and b.parent_cid == cid:
            cid = b.content_id
            continue
        if b.key is None or (b.parent_cid, chunk_of(b), b.extra) != (cid, chunk, extra):
            return (f"request {req.request_id!r} block {j} (id {b.block_id}) does not hold "
                    f"the request's content")
        cid = b.content_id
    return None


def check_lower_chains(lower: LowerTier, blocks: Sequence[Block],
                       pending: Collection[Run] = ()) -> str | None:
    """The tier's one rule that keeps its probes exact: no slot is chained (found only
    through its parent slot) while its parent's content is on the device (``pending``:
    the pending runs, whose blocks' contents are their records')."""
    if not lower.num_chained:
        return None
    on_device = {b.content_id for b in blocks if b.key is not None}
    for r in pending:
        on_device.update(range(r.cid0, r.cid0 + len(r.blocks)))
    for s in lower.slots:
        if s.chained and s.parent_cid in on_device:
            return f"host slot {s!r} is chained but its parent's content is on the device"
    return None
