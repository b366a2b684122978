"""The prefix cache's index: full blocks found by their content.

A block's key is its content: ``(parent content id, token bytes, extra-key bytes)``.
Content ids are handed out per process, one per distinct content (blocks holding equal
content share one), so a key names a whole prefix exactly: a probe that finds a key has
found the same parent, the same tokens and the same extra keys. A hit is one dict probe
(Python's own string hashing, keyed per process) and no call into the chain hash; a
collision of chain hashes, accidental or crafted, cannot make a hit.

The chain hash is the identity outside the process (events, tiers, stores). It is
computed only for blocks newly stored, and only when someone needs it (``hashing``):

    id(block 0) = H(root || tokens[0:bs] || extra_0),  id(block i) = H(id(i-1) || ...)

Equal content in two blocks (a block-aligned prompt re-sent while cached, identical
greedy requests) makes the later one a *spare* (a twin): the index keeps one entry per
key, the primary, and remembers the held twins, so when the primary is evicted a twin
takes its place and the content (and every child keyed under it) stays findable. A twin
whose last reference goes holds nothing of value (its content is still cached) and
returns empty. So: a content is findable exactly while some block holds it, and events
announce a hash once (first block) and withdraw it once (last block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ..core.block import Block, Key
from ..core.request import Request
from ..errors import ConfigError
from ..events import BlockRemoved, BlockStored, Event
from ..hashing import token_bytes

HashFn = Callable[[bytes], bytes]


class Hasher:
    """The chain hash: ``fn`` and the chain's ``root``. ``checked``: results of ``fn``
    are verified (a caller's callable); the built-in modes are trusted."""

    __slots__ = ("fn", "root", "checked")

    def __init__(self, fn: HashFn, root: bytes, checked: bool) -> None:
        self.fn, self.root, self.checked = fn, root, checked

    def chain(self, parent: bytes, chunks: Sequence[bytes], extras: Sequence[bytes]) -> list[bytes]:
        fn, out, h = self.fn, [], parent
        try:
            for c, e in zip(chunks, extras):
                h = fn(h + c + e)
                if self.checked and (type(h) is not bytes or not h):
                    raise ConfigError(f"the hash_mode callable returned {h!r}, not non-empty bytes")
                out.append(h)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"the hash_mode callable raised {exc!r}") from exc
        return out


class ContentIndex:
    """Satisfies ``Index``. ``hasher``/``sink``: chain hashes are computed, and events
    written to ``sink``, only when ``sink.active`` (or a tier asks, ``hashing=True``)."""

    def __init__(self, hasher: Hasher, sink, block_size: int, *, hashing: bool = False) -> None:
        self._map: dict[Key, Block] = {}
        self._twins: dict[Key, list[Block]] = {}
        self._next_id = 1
        self._hasher = hasher
        self._sink = sink
        self._bs = block_size
        self.hashing = hashing or sink.active

    def __len__(self) -> int:
        return len(self._map)

    def match(self, data: bytes, step: int, base: bytes, mm: Sequence[bytes] | None,
              limit: int) -> list[Block]:
        get = self._map.get
        hits: list[Block] = []
        cid = o = 0
        if mm is None:  # the common case: the same extra bytes on every block
            for _ in range(limit):
                b = get((cid, data[o:o + step], base))
                if b is None:
                    break
                hits.append(b)
                cid = b.content_id
                o += step
        else:
            for i in range(limit):
                b = get((cid, data[o:o + step], mm[i] if i < len(mm) else base))
                if b is None:
                    break
                hits.append(b)
                cid = b.content_id
                o += step
        return hits

    def prepare(self, req: Request, first: int, last: int, parent: Block | None) -> tuple:
        bs4 = self._bs * 4
        data = req.prompt_bytes
        if data is None or len(data) < last * bs4:
            data = token_bytes(req.tokens[first * self._bs:last * self._bs])
            off = 0
        else:
            off = first * bs4
        chunks = [data[o:o + bs4] for o in range(off, off + (last - first) * bs4, bs4)]
        extras = req.keys.of_blocks(first, last)
        hashes = None
        if self.hashing:
            root = parent.hash if parent is not None else self._hasher.root
            hashes = self._hasher.chain(root, chunks, extras)  # type: ignore[arg-type]
        return chunks, extras, hashes

    def store(self, req: Request, first: int, prepared: tuple) -> None:
        chunks, extras, hashes = prepared
        index, blocks = self._map, req.blocks
        cid = blocks[first - 1].content_id if first else 0
        j = first
        for chunk, extra in zip(chunks, extras):
            b = blocks[j]
            key = (cid, chunk, extra)
            held = index.get(key)
            b.key = key
            if held is None:
                cid = b.content_id = self._next_id
                self._next_id += 1
                index[key] = b
                if hashes is not None:
                    self._announce(req, b, j, hashes[j - first])
            else:
                cid = b.content_id = held.content_id
                b.twin = True
                b.hash, b.event = held.hash, held.event
                self._twins.setdefault(key, []).append(b)
            j += 1

    def _announce(self, req: Request, b: Block, j: int, h: bytes) -> None:
        bs = self._bs
        parent = req.blocks[j - 1].hash if j else None
        b.hash = h
        b.event = ev = BlockStored(h, parent, tuple(req.tokens[j * bs:(j + 1) * bs]),
                                   b.block_id, req.keys.for_event(j, bs))
        if self._sink.active:
            self._sink.append(ev)

    def drop(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            self._unindex(b)
            b.clear_content()

    def uncache(self, blocks: Sequence[Block]) -> None:
        """Make held ``blocks`` unfindable: their KV was never computed. A block that
        another request holds too (it hit the block in the same step) keeps its content
        id, as a spare that is never found, so that request's later blocks still key
        under the right parent; the rest lose their content."""
        for b in blocks:
            if b.key is None:
                continue
            self._unindex(b)
            if b.ref_cnt > 1:
                b.twin = True
            else:
                b.clear_content()

    def _unindex(self, b: Block) -> None:
        """Take ``b`` out of the index: unlist a twin; replace a primary by a held twin,
        or remove its key (and announce it) when it was the last block holding it."""
        key, twins = b.key, self._twins
        if b.twin:
            listed = twins.get(key)  # type: ignore[arg-type]
            if listed is not None and b in listed:
                self._unlist(b)
        elif twins and key in twins:
            heir = self._unlist(twins[key][-1])  # type: ignore[index]
            heir.twin = False
            self._map[key] = heir  # type: ignore[index]
        elif self._map.get(key) is b:  # type: ignore[arg-type]
            del self._map[key]  # type: ignore[arg-type]
            if self._sink.active:
                self._sink.append(BlockRemoved(b.hash, b.block_id))  # type: ignore[arg-type]

    def _unlist(self, b: Block) -> Block:
        listed = self._twins[b.key]  # type: ignore[index]
        listed.remove(b)
        if not listed:
            del self._twins[b.key]  # type: ignore[arg-type]
        return b

    def release_spare(self, block: Block) -> Block | None:
        primary = self._map.get(block.key)  # type: ignore[arg-type]
        self.drop((block,))
        return primary if primary is not None and primary.ref_cnt == 0 else None

    def snapshot(self) -> list[Event]:
        events = [b.event if b.event.block_id == b.block_id else replace(b.event, block_id=b.block_id)
                  for b in self._map.values() if b.event is not None]
        return events  # type: ignore[return-value]

    def clear(self) -> None:
        self._map.clear()
        self._twins.clear()

    def check(self, blocks: Sequence[Block]) -> str | None:
        index = self._map
        for key, b in index.items():
            if b.key is not key and b.key != key or b.twin or not b.content_id:
                return f"index entry {key[0]}/{len(key[1])}B maps to {b!r} holding other content"
            if self.hashing and b.hash is None:
                return f"block {b.block_id} is indexed without its chain hash"
        listed_ids = set()
        for key, listed in self._twins.items():
            for t in listed:
                listed_ids.add(t.block_id)
                if t.key != key or not t.twin or t.ref_cnt == 0 or key not in index:
                    return f"twin {t!r} is not a held spare of an indexed content"
                if t.content_id != index[key].content_id:
                    return f"twin {t!r} and primary {index[key]!r} differ in content id"
        for b in blocks:
            if b.key is None:
                continue
            if not b.twin and index.get(b.key) is not b:
                return f"block {b.block_id} has content but is neither indexed nor a twin"
            if b.twin and b.ref_cnt == 0:
                return f"spare block {b.block_id} is free but keeps its content"
        return None

    def check_request(self, req: Request, block_size: int) -> str | None:
        """The first full scheduled block of ``req`` whose content is not its own."""
        keys = req.keys.of_blocks(0, req.num_scheduled // block_size)
        cid = 0
        for j, extra in enumerate(keys):
            b = req.blocks[j]
            chunk = token_bytes(req.tokens[j * block_size:(j + 1) * block_size])
            if b.key != (cid, chunk, extra):
                return (f"request {req.request_id!r} block {j} (id {b.block_id}) does not hold "
                        f"the request's content")
            cid = b.content_id
        return None
