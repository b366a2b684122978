"""A reference of vLLM 0.33's hybrid manager over layer groups of DIFFERENT block sizes
(docs/groups.md), written from vLLM's rules as plain Python: one pool of numbered blocks,
each group's table at its own size, hits aligned to ``align`` (the lcm), caching rounded
down to it, and vLLM's plain free order. tests/engines/test_vllm_sized_model.py drives it
beside vLLM's own ``KVCacheManager`` (block ids, free queue, hits, cached keys equal);
tests/test_groups_sizes_machine.py drives prefixkv's hybrid manager beside it.

A group is ``(block size, window)``: window None is full attention, an int a sliding
window of that many tokens, ``"mamba"`` a Mamba group (vLLM's ``MambaManager`` in
``mamba_cache_mode="align"``, with vLLM's fine-grained partial hits off: hits aligned to
``align``, no speculative nor checkpoint blocks); ``retained[g]`` (default 0): tokens
below group g's window whose blocks a request keeps (vLLM's ``extra_retained_tokens``:
released at ``get_num_skipped_tokens``, never asked of a hit). A block's key in group
``g`` is ``(g, extra, tokens)``, the tokens of the whole prefix up to the block's end
(what the fine hash at its last hash boundary chains over). The rules, each as vLLM 0.33 runs them:

- Hit (``hit``): the largest ``L <= len(tokens) - 1``, a multiple of ``align``, at which
  every group holds, cached, the blocks a query at ``L`` reads; group g's hit is its
  ``L // b`` entries, the null block below the window, else the key's first holder.
- Admission and growth (``add``, ``grow``): a windowed group first releases the blocks
  below what the step's first query reads, less the retained tokens
  (``max(0, first_needed(computed) - retained) // b``; last first),
  then each group, in order, takes ``cdiv(slots, b)`` entries from the free queue's head.
  What the call would release counts as free for it; a call that does not fit changes
  nothing (prefixkv's rule; vLLM releases anyway).
- Caching: the scheduled tokens rounded down to ``align``; a group's whole blocks up to
  there not cached before; a window's only those a hit at an ``align`` boundary reads
  (vLLM's ``reachable_block_mask``); null blocks never. A key already held gets a second
  holder (found after the first is evicted).
- Free order: ``free`` frees group by group, each table's blocks last first; a block
  whose last reference goes joins the free queue at its head when it holds no key (those
  of one call in that order, before those already there), at its tail when it does
  (vLLM's ``free_blocks``). Taking a block that holds keys evicts them.
- Twins (``twins``, prefixkv's rule; off: vLLM's): a block that caches a key another
  block holds is a spare of it, holding no key of its own: freed, it goes to the queue's
  head (empty) and a free holder of the key moves to the tail in its place; when the
  holder is evicted, the first held twin takes over (groups/index.py), the copy vLLM
  then finds (its first cached). Until a twin is freed (``emptied``) the two rules give
  the same ids, queue and hits; from then on vLLM's queue holds a copy this one emptied.
- Events, as prefixkv announces them: a key is stored when its first holder caches it,
  removed when its last holder is evicted (vLLM announces every holder); a
  full-attention partial entry for each holder, as vLLM (session 28).
- Mamba (``"mamba"``): a query at ``p`` reads the state after ``p - 1`` (the window of 2
  below), so a hit at ``L`` needs block ``L // b - 1`` cached, the entries below it null.
  A step ending at ``e`` takes one block, at entry ``cdiv(e, b) - 1``, when the table is
  shorter (the entries it jumps over null); one ending in the last entry writes there.
  A step starting at ``s`` releases every block below ``(s - 1) // b``, last first
  (vLLM's align-mode ``_remove_blocks_in_range`` skips nulls, never stops at one). Every
  block (dense retention; with ``retention``, those ``_mamba_kept`` names: vLLM's sparse
  ``MambaManager.reachable_block_mask``) is cached once it holds the state at its own end: a step
  ended exactly there (``Req.exact``; vLLM's scheduler ends align-mode chunks there, so
  vLLM caches the same blocks: a block a step ran past holds an older state, which
  prefixkv never caches).
- EAGLE (``peek``: one bool per group, vLLM's ``drop_eagle_group_ids`` widened to every
  group of a flagged group's spec; None: no EAGLE): the hit (``_peek_hit``) is vLLM's one
  pass over the sets of groups of one (block size, window), full attention first, each
  set taking the candidate down: full attention matches its run of cached blocks within
  the candidate plus one block (a peeking set) and drops the last, rounded down to
  ``align``; a window scans down for a run of ``cdiv(W - 1, b)`` (+1 peeking) cached
  blocks whose top starts an ``align`` boundary (peeking; else ends one), else takes the
  run reaching block 0, then drops one block (peeking) and rounds down to ``align``
  after each pop (the literal rule, quirks included). A peeking group caches up to
  ``min(computed, aligned + b)`` (nothing before the first ``align`` boundary), a
  window's the ``cdiv(W - 1, b) + 1`` blocks ending at each boundary's first block
  (``reachable_block_mask`` with ``use_eagle``), and its partial tail entry at the whole
  prompt's last hash boundary.
- Partial tail entries (vLLM's ``_cache_partial_tail_block``; docs/groups.md): a
  full-attention group larger than the hash block, once the prompt's last hash boundary
  before its last token lies inside one of its cached blocks, stores that boundary's
  prefix as one more entry of the block (once per block, on a block holding its key or
  a twin of it, as vLLM caches every copy). Each entry counts its holders: announced by
  the first, withdrawn when the last loses it (evicted, or a twin emptied when freed:
  vLLM keeps that copy cached until it evicts it); a twin taking over the block's own key
  keeps its own entry, if its request put one there.
- Fine-grained partial hits (``partial``: vLLM's ``enable_partial_hash_hits``, on for a
  Mamba group larger than the hash block; the subset modelled here: Mamba groups of one
  size, every other group full attention of one size, no EAGLE, no lookahead, no
  checkpoint blocks). Hits and caching go at ``h``, not ``align``: full attention's hit
  ``F`` is its run of whole blocks, then (a block larger than ``h``) the longest hash
  boundary inside the next one whose prefix it holds as a partial entry; the hit is
  the largest multiple ``L <= F`` of ``h`` at which every Mamba group holds a block
  under the key of the whole prefix (a block's own key, or a partial entry)
  (``_fine_hit``); a Mamba group's hit entries are ``(L - 1) // b`` nulls and that
  block, full attention's the first ``cdiv(L, b)`` blocks it found. A full-attention
  group larger than ``h`` holds the prompt's last hash boundary ``P`` (below) as an
  entry of the block it lies in once the request computed it (``_full_tail``); the
  request keeps writing that block, and its whole key replaces the entry (promotion,
  the entry then added back beside it). A step ending exactly at the prompt's last hash
  boundary ``P = (prompt - 1) // h * h``, inside a Mamba block, stores the prefix up to
  ``P`` as an entry of that block (vLLM's ``cache_partial_block``); the producer owns it.
  A hit inside a block (Mamba or full attention) is copied on write: the admission takes
  one more block (first of its group's new ones), puts it in the table in the source's
  place and queues the copy (source, copy), both kept held until ``take_copies``' caller
  frees them (vLLM's ``take_kv_cache_block_copies``, whose blocks the scheduler frees
  once the copy ran); the copy is cached once full. A Mamba producer's next allocation
  takes one more block too, first, moves the source's entries to it (the request keeps
  writing the source, which is cached once full) and queues the same copy, both ends
  held the same way. Taking a block that holds keys evicts them all; a block cached
  whole while holding a shorter entry loses it first (vLLM's promotion; never a
  spare, whole already, whose entry stays).
- Chunk-end checkpoints (``checkpoint``, with ``partial``: vLLM's
  ``num_prefill_checkpoint_blocks = 1``, ``prefill_checkpoint_alignment`` the hash
  block, no lookahead, no EAGLE; with ``retention`` 0 only a step reaching vLLM's
  ``prefill_end``, ``_prefill_end``, and a checkpoint ending its entry is cached only
  where ``_mamba_kept`` says). A step from ``s`` to ``e`` checkpoints
  at ``c = (e - 1) // h * h`` (vLLM's ``get_mamba_prefill_checkpoint_position``) when
  ``s`` is a multiple of ``h``, ``s + h <= c``, and the entry ``j = cdiv(e, b) - 2``
  lies past the one holding the step's initial state (``(s - 1) // b``) and is empty
  (``is_mamba_prefill_checkpoint_valid``): the step then takes one more block (after
  a copy on write's, before the one of its end) and puts it at ``j``, where the worker
  writes the state at ``c``; with ``ck_align`` (vLLM's ``prefill_checkpoint_alignment``;
  default ``h``) only when ``c - s`` is a multiple of it. It is cached as the state at
  ``c``: its own key when ``c`` ends entry ``j``; else, when ``c`` is the prompt's last
  hash boundary or the request's junction (``Req.junction``, vLLM's
  ``shared_prefix_boundary``: ``junction``), as an entry of the prefix up to ``c``
  (owned by nobody: no copy on write when the producer goes on; the step records no
  partial tail entry then; with ``twins``, a spare of the block already holding that
  prefix, if one does); else never (a transient checkpoint, released with the step's
  other blocks below the next one's start).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


def first_needed(window, pos):
    """The first position a query at ``pos`` reads."""
    if window == "mamba":
        return max(0, pos - 1)
    return 0 if window is None else max(0, pos - window + 1)


def skipped(window, retained, pos):
    """vLLM's ``get_num_skipped_tokens(pos)``: the tokens below the window and the
    retained ones."""
    return max(0, first_needed(window, pos) - retained)


def cdiv(a, b):
    return -(-a // b)


@dataclass
class Req:
    tokens: list
    extra: object
    computed: int  # tokens scheduled so far
    tables: list  # per group: block ids
    cached: list = field(default_factory=list)  # per group: entries past which caching goes on
    prompt: int = 0  # the prompt's length at admission (vLLM's ``num_prompt_tokens``)
    exact: set = field(default_factory=set)  # (g, j): Mamba block j holds the state at its end
    cow: dict = field(default_factory=dict)  # g -> (j, source, owner): a copy the next allocation makes
    lost: int | None = None  # the first hash block whose prefix id is lost (``rewind``)
    checkpoints: dict = field(default_factory=dict)  # g -> (position, entry): the last step's checkpoint
    junction: int = 0  # vLLM's ``shared_prefix_boundary`` at admission (``retention``)


class SizedModel:
    def __init__(self, groups, num_blocks, hash_size, align, null=True, twins=False, peek=None,
                 retained=(), partial=False, checkpoint=False, retention=None, ck_align=None):
        self.groups, self.h, self.align = tuple(groups), hash_size, align
        self.retention = retention  # (vLLM's prefix_cache_retention_interval: ``_reachable``)
        self.partial = partial
        self.checkpoint = checkpoint
        self.ck_align = ck_align or hash_size  # (vLLM's ``prefill_checkpoint_alignment``)
        self.copies: list = []  # (source, copy) queued, both held until ``take_copies``' caller frees them
        self.retained = tuple(retained) or (0,) * len(self.groups)
        # (vLLM's groups of a flagged group's spec peek too)
        self.peek = None if peek is None or not any(peek) else tuple(
            any(f for s, f in zip(self.groups, peek, strict=True) if s == spec) for spec in self.groups)
        self.free = deque(range(num_blocks))
        # vLLM's null block, block 0 (prefixkv reserves it only where a group releases)
        self.null = self.free.popleft() if null else None
        self.twins = twins
        self.emptied = 0  # twins freed empty: from the first on, vLLM's queue holds copies this one does not
        self.spares: dict = {}  # key -> the held twins of its holder (``twins`` on)
        self.refs = [0] * num_blocks
        self.keys: list[list] = [[] for _ in range(num_blocks)]  # the keys a block holds
        self.holders: dict = {}  # key -> the blocks holding it, the first found first
        self.events: list = []  # ("stored" | "removed", key), and ("cleared",)
        self.tails: dict = {}  # block -> the partial tail entry it holds besides its keys
        self.tail_holders: Counter = Counter()  # a tail entry -> how many blocks hold it
        self.reqs: dict = {}
        # a rewind forgot what vLLM keeps beyond the request's own blocks (a spare, a
        # copy, a longer prefix, another request's prefix id) or what its recompute does
        # not cache again (a window block only another request's marks reach, ``retention``):
        # from then on vLLM's queue, keys and hits differ by design
        self.diverged = False

    # ---- keys and hits --------------------------------------------------------------

    def key(self, g, extra, tokens, j):
        return g, extra, tuple(tokens[:(j + 1) * self.groups[g][0]])

    def hit(self, tokens, extra):
        """The hit in tokens and each group's hit entries."""
        limit = len(tokens) - 1
        if self.partial:
            return self._fine_hit(tokens, extra, limit)
        if self.peek is not None:
            end = self._peek_hit(tokens, extra, limit)
            return end, [[self.null if j < first_needed(w, end) // b
                          else self.holders[self.key(g, extra, tokens, j)][0]
                          for j in range(end // b)] for g, (b, w) in enumerate(self.groups)]
        for end in range(limit - limit % self.align, 0, -self.align):
            if all(self.key(g, extra, tokens, j) in self.holders
                   for g, (b, w) in enumerate(self.groups)
                   for j in range(first_needed(w, end) // b, end // b)):
                return end, [[self.null if j < first_needed(w, end) // b
                              else self.holders[self.key(g, extra, tokens, j)][0]
                              for j in range(end // b)] for g, (b, w) in enumerate(self.groups)]
        return 0, [[] for _ in self.groups]

    def _fine_hit(self, tokens, extra, limit):
        """The hit with partial hits, as vLLM's coordinator finds it in one pass (full
        attention first, of one block size ``bf``; then the Mamba groups, of one size):
        full attention's hit ``F`` is its run of whole blocks held by every group (key
        of the prefix to the block's end), then the longest hash boundary inside the next
        block whose prefix every group holds (a partial entry; vLLM's fine-grained
        ``FullAttentionManager.find_longest_cache_hit``); the hit is the longest
        boundary ``L <= F`` whose prefix every Mamba group holds. Full attention's rows
        are the first ``cdiv(L, bf)`` of the blocks it found (the last the partial
        entry's block, found at ``F``, when ``L`` passes the run)."""
        mamba = [g for g, (_, w) in enumerate(self.groups) if w == "mamba"]
        k, top = self._full_run(tokens, extra, limit)
        end = next((e for e in range(top, 0, -self.h) if self._held(mamba, tokens, extra, e)), 0)
        if not end:
            return 0, [[] for _ in self.groups]
        rows = []
        for g, (b, w) in enumerate(self.groups):
            if w is None:
                ends = [(j + 1) * b for j in range(k)] + ([top] if top > k * b else [])
                rows.append([self.holders[(g, extra, tuple(tokens[:e]))][0] for e in ends][:cdiv(end, b)])
            else:
                found = self.holders[(g, extra, tuple(tokens[:end]))][0]
                rows.append([self.null] * ((end - 1) // b) + [found])
        return end, rows

    def _held(self, gs, tokens, extra, end):
        return all((g, extra, tuple(tokens[:end])) in self.holders for g in gs)

    def _full_run(self, tokens, extra, limit):
        """With partial hits, full attention's own hit (``_fine_hit``): its ``k`` whole
        blocks held, and ``top``, that run's end or a hash boundary inside the next
        block whose prefix it holds as a partial entry."""
        full = [g for g, (_, w) in enumerate(self.groups) if w is None]
        bf = self.groups[full[0]][0]
        k = 0
        while (k + 1) * bf <= limit and self._held(full, tokens, extra, (k + 1) * bf):
            k += 1
        top = next((e for e in range(min(k * bf + bf - self.h, limit // self.h * self.h), k * bf, -self.h)
                    if self._held(full, tokens, extra, e)), k * bf)
        return k, top

    def take_copies(self):
        """The copies queued since the last call (source, copy); their blocks stay held
        until ``release`` frees them (each pair's source, then its copy)."""
        out, self.copies = self.copies, []
        return out

    def release(self, blocks):
        self._free(blocks)

    def _peek_hit(self, tokens, extra, limit):
        """vLLM's hit with EAGLE (module docstring), in tokens."""
        a, hashed = self.align, len(tokens) // self.h * self.h
        sets = {}
        for g, spec in enumerate(self.groups):
            sets.setdefault(spec, []).append(g)
        cur = limit
        for (b, w), gs in sorted(sets.items(), key=lambda kv: kv[0][1] is not None):
            peek = any(self.peek[g] for g in gs)
            top = min(cur + b, hashed) // b if peek else cur // b  # (blocks 0 .. top - 1 are looked at)

            def cached(j, gs=gs, b=b):
                return all(self.key(g, extra, tokens, j) in self.holders for g in gs)
            if w is None:
                run = 0
                while run < top and cached(run):
                    run += 1
                cur = max(0, run - peek) * b
                cur -= cur % a
                continue
            need, count, length = cdiv(w - 1, b) + peek, 0, None
            for i in range(top - 1, -1, -1):
                if not cached(i):
                    count = 0
                    continue
                if count == 0 and b != a and ((i if peek else i + 1) * b) % a:
                    continue  # (a run's top must end, or peeking start, an aligned boundary)
                count += 1
                if count >= need:
                    length = i + count
                    break
            if length is None:  # the run reaching block 0, rounded down to ``a``
                length = count
                while length * b % a:
                    length -= 1
            if peek and length:
                length -= 1
                while length * b % a:
                    length -= 1
            cur = length * b
        return cur

    # ---- the pool -----------------------------------------------------------------

    def _take(self, n):
        out = [self.free.popleft() for _ in range(n)]
        for x in out:
            for key in self.keys[x]:  # (evicted)
                self.holders[key].remove(x)
                if not self.holders[key] and self.spares.get(key):  # (a held twin takes over)
                    heir = self.spares[key].pop(0)
                    self.holders[key].append(heir)
                    self.keys[heir].append(key)
                if not self.holders[key]:
                    del self.holders[key]
                    self.events.append(("removed", key))
                elif self._each(key):
                    self.events.append(("removed", key))
            self._drop_tail(x)
            self.keys[x] = []
            self.refs[x] = 1
        return out

    def _free(self, ordered):
        first, last = [], []
        for x in ordered:
            self.refs[x] -= 1
            if not self.refs[x]:
                spare = [k for k, held in self.spares.items() if x in held]
                if spare:  # (a twin returns empty: a full-attention partial entry it holds too)
                    self._unkey(x)
                (last if self.keys[x] else first).append(x)
                for key in spare:  # (a twin goes empty; a free holder takes its place)
                    self.spares[key].remove(x)
                    self._drop_tail(x)
                    self.emptied += 1
                    primary = self.holders[key][0]
                    if not self.refs[primary]:
                        (last if primary in last else self.free).remove(primary)
                        last.append(primary)
        self.free.extendleft(reversed(first))
        self.free.extend(last)

    def _unkey(self, x):
        """``x`` loses every key it holds (vLLM's ``_remove_cached_block_hashes``)."""
        for key in self.keys[x]:
            self.holders[key].remove(x)
            if not self.holders[key]:
                del self.holders[key]
                self.events.append(("removed", key))
            elif self._each(key):
                self.events.append(("removed", key))
        self.keys[x] = []

    def _hold(self, x, key):
        if key not in self.holders or self._each(key):
            self.events.append(("stored", key))
        self.holders.setdefault(key, []).append(x)
        self.keys[x].append(key)

    def _each(self, key):
        """Whether ``key`` is announced and withdrawn for each holder: a partial entry of
        full attention larger than the hash block (vLLM's ``cache_partial_block`` and
        eviction, per block); other keys once, by their first holder and last."""
        b, w = self.groups[key[0]]
        return self.partial and w is None and b > self.h and bool(len(key[2]) % b)

    def _store(self, x, key):
        """``x`` caches ``key``: a spare of its holder (``twins``), else one more holder."""
        if key in self.holders and self.twins:
            self.spares.setdefault(key, []).append(x)
        else:
            self._hold(x, key)

    def _touch(self, blocks):
        for x in blocks:
            if not self.refs[x]:
                self.free.remove(x)
            self.refs[x] += 1

    # ---- the calls ----------------------------------------------------------------

    def _releasing(self, r):
        """Per group, the entries a step of ``r`` from ``r.computed`` releases, last first."""
        out = []
        for (b, w), e, ids in zip(self.groups, self.retained, r.tables, strict=True):
            cut, gone = min(skipped(w, e, r.computed) // b, len(ids)), []
            for j in range(cut - 1, -1, -1):
                if ids[j] == self.null:
                    if w == "mamba":
                        continue
                    break
                gone.append(j)
            out.append(gone)
        return out

    def add(self, rid, tokens, extra, num_new=None):
        """Admit ``rid`` with its hit, scheduling ``num_new`` tokens (default: the rest).
        Returns the hit, or None (nothing changed) when it does not fit."""
        end, hit = self.hit(tokens, extra)
        num_new = len(tokens) - end if num_new is None else num_new
        need = 0
        for (b, w), e, h in zip(self.groups, self.retained, hit, strict=True):
            skip = skipped(w, e, end) // b  # (the hit's null entries below the window stay)
            fresh = max(cdiv(end + num_new, b) - max(skip, len(h)), 0)
            ck = w == "mamba" and self._checkpoint(b, h, end, end + num_new,
                                                   self._prefill_end(len(tokens), len(tokens))) is not None
            need += (min(fresh, 1) + ck if w == "mamba" else fresh) + bool(self.partial and h and end % b)
            need += sum(not self.refs[x] for x in h[skip:] if x != self.null)
        if need > len(self.free):
            return None
        r = Req(list(tokens), extra, end, [], [], len(tokens),
                junction=self.junction(tokens, extra, end) if self.retention is not None or self.checkpoint
                else 0)
        for g, ((b, w), e, h) in enumerate(zip(self.groups, self.retained, hit, strict=True)):
            skip = skipped(w, e, end) // b
            if self.partial and h and end % b:  # (a hit inside the block: copied on write)
                r.cow[g] = (len(h) - 1, h[-1], False)
            elif w == "mamba" and h:
                r.exact.add((g, len(h) - 1))
            self._touch([x for x in h[skip:] if x != self.null])
            r.tables.append([self.null] * skip + h[skip:])
            r.cached.append(len(h) - (g in r.cow))
        self.reqs[rid] = r
        self._grow(r, num_new)
        return end

    def grow(self, rid, num_new, tokens=()):
        """``tokens`` appended to ``rid`` (decoded), then ``num_new`` tokens scheduled.
        False (nothing changed) when it does not fit."""
        r = self.reqs[rid]
        going = self._releasing(r)
        releasable = sum(self.refs[r.tables[g][j]] == 1 for g, js in enumerate(going) for j in js)
        end = r.computed + num_new
        pe = self._prefill_end(r.prompt, len(r.tokens) + len(tokens))
        need = len(r.cow) + sum(min(fresh, 1) + (self._checkpoint(b, ids, r.computed, end, pe) is not None)
                                if w == "mamba" else fresh
                                for (b, w), ids in zip(self.groups, r.tables, strict=True)
                                if (fresh := max(cdiv(end, b) - len(ids), 0)))
        if need > len(self.free) + releasable:
            return False
        for g, js in enumerate(going):
            blocks = [r.tables[g][j] for j in js]
            for j in js:
                r.tables[g][j] = self.null
            self._free(blocks)
        r.tokens += tokens
        self._grow(r, num_new)
        return True

    def _grow(self, r, num_new):
        start = r.computed
        r.computed += num_new
        for g, ((b, w), ids) in enumerate(zip(self.groups, r.tables, strict=True)):
            fresh = max(cdiv(r.computed, b) - len(ids), 0)
            if w != "mamba":
                new = self._take(fresh + (g in r.cow))
                if g in r.cow:  # (a hit inside a full-attention block: copied on write)
                    self._copy(r, g, new.pop(0))
                ids += new
                continue
            ck = self._checkpoint(b, ids, start, r.computed, self._prefill_end(r.prompt, len(r.tokens)))
            new = self._take(int(fresh > 0) + (ck is not None) + (g in r.cow))
            if g in r.cow:
                self._copy(r, g, new.pop(0))
            if fresh:
                ids += [self.null] * (fresh - 1 - (ck is not None)) + new
            if r.computed % b == 0:
                r.exact.add((g, r.computed // b - 1))
            if ck is None:
                r.checkpoints.pop(g, None)
                continue
            r.checkpoints[g] = ck
            if ck[0] == (ck[1] + 1) * b:
                r.exact.add((g, ck[1]))
        n = min(r.computed, len(r.tokens))
        first = start // self.h if start // self.h < n // self.h else None  # (a hash boundary passed)
        if first:
            self._cut(r, first)
        self._cache(r, n, first)

    def _checkpoint(self, b, ids, s, e, pe=0):
        """The checkpoint ``(position, entry)`` of a step from ``s`` to ``e`` in a Mamba
        group of ``b`` whose entries are ``ids`` (module docstring), or None; none for a
        step ending below ``pe`` (``_prefill_end``)."""
        c, j = (e - 1) // self.h * self.h, cdiv(e, b) - 2
        if not self.checkpoint or s % self.h or s + self.h > c or j <= (s - 1) // b \
                or (c - s) % self.ck_align or e < pe:
            return None
        assert j >= len(ids) or ids[j] == self.null
        return c, j

    def _copy(self, r, g, copy):
        """The copy on write of ``r.cow[g]`` into the new block ``copy`` (module docstring)."""
        j, source, owner = r.cow.pop(g)
        self.copies.append((source, copy))
        if owner:  # (the producer keeps writing the source: its entries move to the copy)
            for key in self.keys[source]:
                self.holders[key].remove(source)
                self.holders[key].append(copy)
            self.keys[copy], self.keys[source] = self.keys[source], []
            for held in self.spares.values():  # (a twin's place goes to its copy)
                if source in held:
                    held[held.index(source)] = copy
            self.refs[source] += 1
        else:
            r.tables[g][j] = copy
            self.refs[copy] += 1

    def _cache(self, r, n, first=None):
        """Cache ``r``'s blocks up to ``n`` tokens; after a step passing a hash boundary
        from hash block ``first`` on, also those from the aligned end before it that
        hold nothing (prefixkv's ``_record``: a block that lost its content to a
        ``rewind`` while its key stayed is cached again, a spare)."""
        computed, n = n, n if self.partial else n // self.align * self.align
        hashed = len(r.tokens) // self.h * self.h
        lo = None if first is None else first * self.h // self.align * self.align
        for g, (b, w) in enumerate(self.groups):
            peek = self.peek is not None and self.peek[g]
            end = min(computed, n + b) if peek and n else n  # (vLLM's get_num_cacheable_tokens)
            full = min(end, hashed) // b
            for j in range(r.cached[g] if lo is None else min(r.cached[g], lo // b), full):
                x = r.tables[g][j]
                if x == self.null or self._holds(x) and not self._shorter(x, (j + 1) * b) \
                        or not self._reachable(g, j, r) \
                        or (w == "mamba" and (g, j) not in r.exact) \
                        or r.lost is not None and (j + 1) * b // self.h > r.lost:
                    continue  # (null, unreachable, a Mamba block past its state, a lost prefix id)
                key = self.key(g, r.extra, r.tokens, j)
                if self.partial and self.keys[x]:  # (a shorter partial entry: promoted)
                    self._unkey(x)
                if key in self.holders and self.twins:
                    self.spares.setdefault(key, []).append(x)
                    continue
                if key not in self.holders:
                    self.holders[key] = []
                    self.events.append(("stored", key))
                self.holders[key].append(x)
                self.keys[x].append(key)
            r.cached[g] = max(r.cached[g], full)
            if self.partial and w == "mamba" and g in r.checkpoints:
                self._checkpointed(r, g)
            elif self.partial and w == "mamba":
                self._partial_tail(r, g, computed)
            elif self.partial:
                self._full_tail(r, g, computed)
            else:
                self._tail(r, g, min(end, hashed))

    def _checkpointed(self, r, g):
        """The step's checkpoint at ``c`` inside entry ``j + 1``: an entry of the prefix
        up to ``c`` on block ``j`` when ``c`` is the prompt's last hash boundary or the
        request's junction (vLLM's ``_cache_partial_tail_block`` keeps a checkpoint at
        ``shared_prefix_boundary``)."""
        c, j = r.checkpoints[g]
        if c % self.groups[g][0] == 0 or c != (r.prompt - 1) // self.h * self.h and c != r.junction:
            return
        x, key = r.tables[g][j], (g, r.extra, tuple(r.tokens[:c]))
        if key not in self.keys[x] and x not in self.spares.get(key, ()):
            self._unkey(x)
            self._store(x, key)

    def _partial_tail(self, r, g, computed):
        """A step that ended at the prompt's last hash boundary inside a Mamba block
        stores that prefix as an entry of the block; the request owns it."""
        b, end = self.groups[g][0], (r.prompt - 1) // self.h * self.h
        if computed != end or not end % b or cdiv(end, b) > len(r.tables[g]):
            return
        x, key = r.tables[g][cdiv(end, b) - 1], (g, r.extra, tuple(r.tokens[:end]))
        if x == self.null or key in self.keys[x]:
            return
        if self.keys[x] and len(self.keys[x][0][2]) < end:
            self._unkey(x)
        self._store(x, key)
        r.cow[g], r.cached[g] = (cdiv(end, b) - 1, x, True), cdiv(end, b) - 1

    def _full_tail(self, r, g, computed):
        """With partial hits, a full-attention group larger than the hash block, once
        ``computed`` reaches the prompt's last hash boundary ``P`` before its last token
        inside one of its blocks, holds ``P``'s prefix as an entry of that block (vLLM's
        ``FullAttentionManager._cache_partial_tail_block``, at every caching; once per
        block); the request keeps writing the block, which is promoted once whole."""
        b, end = self.groups[g][0], (r.prompt - 1) // self.h * self.h
        if not end or end > computed or not end % b or end // b >= len(r.tables[g]):
            return
        x, key = r.tables[g][end // b], (g, r.extra, tuple(r.tokens[:end]))
        if key in self.keys[x]:
            return
        self._hold(x, key)  # (vLLM first drops a shorter own key: never one at ``P`` here)

    def _tail(self, r, g, hi):
        b, w = self.groups[g]
        peek = self.peek is not None and self.peek[g]
        end = (r.prompt if peek else r.prompt - 1) // self.h * self.h
        if w is not None or b <= self.h or not 0 < end <= hi or not end % b \
                or r.lost is not None and end // self.h > r.lost:
            return
        x = r.tables[g][end // b]
        if x != self.null and self._holds(x) and x not in self.tails:  # (a spare's too)
            self.tails[x] = entry = (g, r.extra, tuple(r.tokens[:end]))
            if not self.tail_holders[entry]:  # (announced by its first holder)
                self.events.append(("stored", entry))
            self.tail_holders[entry] += 1

    def _drop_tail(self, x):
        """``x`` loses the partial tail entry it holds, if any: withdrawn by its last
        holder."""
        entry = self.tails.pop(x, None)
        if entry is not None:
            self.tail_holders[entry] -= 1
            if not self.tail_holders[entry]:
                del self.tail_holders[entry]
                self.events.append(("removed", entry))

    def _shorter(self, x, n):
        """With partial hits, whether block ``x`` holds keys, all shorter than ``n`` tokens
        (a partial entry of a block now whole: vLLM promotes it). A spare is whole
        already: the entry it holds beside (``_full_tail``, after it became a spare) is
        never promoted again (vLLM's block holds its whole key and the entry, and a later
        caching finds both)."""
        return self.partial and bool(self.keys[x]) and all(len(k[2]) < n for k in self.keys[x]) \
            and not any(x in held for held in self.spares.values())

    def _holds(self, x):
        """Whether block ``x`` holds a key (its own, or as a spare)."""
        return bool(self.keys[x]) or any(x in held for held in self.spares.values())

    def _caches(self, g, n, j, r):
        """prefixkv's ``BlockSizes.caches``: whether group ``g`` caches its block ``j``
        of request ``r`` once ``n`` tokens are computed."""
        b, _ = self.groups[g]
        end = n // self.align * self.align
        if self.peek is not None and self.peek[g] and end:
            end = min(n, end + b)
        return (j + 1) * b <= end and self._reachable(g, j, r)

    def _cut(self, r, first):
        """prefixkv's ``cut`` (groups/sized.py ``_cut_off``): a step passing the hash
        blocks from ``first`` on, when in some group (not Mamba) the block holding
        position ``first * h - 1`` is cached at that count but holds nothing (it lost
        its content to a ``rewind`` while its key stayed), makes the request's prefix
        ids from ``first`` on lost ones."""
        if r.lost is not None and r.lost < first:
            return  # (lost already)
        p = first * self.h
        for g, ((b, w), ids) in enumerate(zip(self.groups, r.tables, strict=True)):
            j = (p - 1) // b
            if w != "mamba" and j < len(ids) and ids[j] != self.null and not self._holds(ids[j]) \
                    and self._caches(g, p, j, r):
                r.lost = first
                return

    def _reachable(self, g, j, r):
        """Whether group ``g`` caches block ``j`` of request ``r`` (vLLM's
        ``reachable_block_mask``): full attention every block, Mamba ``_mamba_kept``'s;
        a window the ``need`` blocks a hit reads ending at each segment's end (``align``
        with ``retention`` None, ``retention`` tokens when positive, none when 0) and,
        with ``retention`` not None, at each of ``r``'s marks rounded down to
        ``align``: its prompt's replay boundary (``prompt - 1``) and its shared-prefix
        junction (vLLM's ``replay_boundaries`` without EAGLE, ``shared_prefix_boundary``)."""
        b, w = self.groups[g]
        if w is None:
            return True
        if w == "mamba":
            return self._mamba_kept(b, j, r)
        peek = self.peek is not None and self.peek[g]
        need = cdiv(w - 1, b) + peek
        seg = self.align if self.retention is None else self.retention
        if seg:
            per = seg // b
            if need >= per or j >= peek and (j - peek) % per >= per - need:
                return True
        if self.retention is None:
            return False
        assert not peek, "the reference keeps retention marks without EAGLE only"
        marks = [r.prompt - 1] + ([r.junction] if r.junction else [])
        return any(t // self.align * self.align // b - need <= j < t // self.align * self.align // b
                   for t in marks)

    def _mamba_kept(self, b, j, r):
        """Whether a Mamba group of blocks of ``b`` caches block ``j`` of request ``r``
        (vLLM's ``MambaManager.reachable_block_mask``): every block with ``retention``
        None, or a positive one of at most ``b`` tokens; else those ending a
        ``retention``-token segment (none for 0) and the one ending at or below each of
        ``r``'s marks rounded down to the hit unit (``h`` with partial hits, else
        ``align``): the prompt's replay boundary (``prompt - 1``) and its junction."""
        seg = self.retention
        if seg is None or seg and seg // b <= 1:
            return True
        if seg and (j + 1) % (seg // b) == 0:
            return True
        u = self.h if self.partial else self.align
        return any(t // u * u // b - 1 == j for t in [r.prompt - 1] + ([r.junction] if r.junction else []))

    def _prefill_end(self, prompt, num_tokens):
        """vLLM's ``prefill_end`` for a step of a request whose prompt has ``prompt``
        tokens, ``num_tokens`` in all: with ``retention`` 0 (vLLM's coordinator passes it
        then only), ``max(prompt, num_tokens - 1)``, the end a step must reach to take a
        checkpoint block; else 0 (every step may)."""
        return max(prompt, num_tokens - 1) if self.retention == 0 else 0

    def junction(self, tokens, extra, hit):
        """vLLM's ``shared_prefix_boundary`` for a lookup of ``tokens`` whose hit is
        ``hit``: the hit the first set of groups of vLLM's lookup (full attention first,
        then in order; groups of one (size, window) together) alone serves at an
        ``align`` boundary (with partial hits: full attention's own fine hit, at the
        hash block), when longer than ``hit``; else 0 (without EAGLE)."""
        first = next((s for s in self.groups if s[1] is None), self.groups[0])  # (vLLM sorts full first)
        limit = len(tokens) - 1
        if self.partial:  # (full attention's own fine hit: ``_full_run``)
            top = self._full_run(tokens, extra, limit)[1]
            return top if top > hit else 0
        for end in range(limit - limit % self.align, hit, -self.align):
            if all(self.key(g, extra, tokens, j) in self.holders
                   for g, (b, w) in enumerate(self.groups) if (b, w) == first
                   for j in range(first_needed(w, end) // b, end // b)):
                return end
        return 0

    def free_request(self, rid):
        r = self.reqs.pop(rid)
        for ids in r.tables:
            self._free([x for x in reversed(ids) if x != self.null])

    def reset(self):
        """vLLM's ``reset_prefix_cache``: only when no request holds a block (nor a copy
        not released yet)."""
        if self.reqs or any(self.refs[x] for x in range(len(self.refs)) if x != self.null):
            return False
        self.holders.clear()
        self.spares.clear()
        self.tails.clear()
        self.tail_holders.clear()
        self.keys = [[] for _ in self.keys]
        self.events.append(("cleared",))
        return True

    # ---- rewind (prefixkv's semantics: vLLM's manager has none) -------------------

    def rewind(self, rid, p):
        """prefixkv's ``rewind(rid, p)`` with different sizes: the request forgets its
        tokens from ``p`` (given again by ``grow``, which caches them anew), and each
        group's blocks from ``p // b`` lose their content: a spare is unlisted, a
        holder with a spare hands its key to the first; any other key is forgotten
        with every key extending its prefix (every group), whose free holders go to
        the queue's head (by group, then block id: the first taken is the last of
        that order), and a live request holding that prefix
        never caches at or past it again (its prefix id is lost). The blocks stay in
        the tables. vLLM's manager has no rewind (its scheduler sets the computed
        tokens back and its blocks stay cached): the tables are the same either way;
        what is findable until the recompute caches again, the forgotten keys and
        the queue differ (by design). False (nothing changed) where prefixkv refuses:
        beside Mamba and where the recompute reads what a window released. A block
        another request holds too loses its content for it as well (that request's
        next step passing a hash boundary right after it cuts: ``_cut``)."""
        r, h = self.reqs[rid], self.h
        for (b, w), ids in zip(self.groups, r.tables, strict=True):
            released = next((j for j, x in enumerate(ids) if x != self.null), len(ids))
            if w == "mamba" or released > first_needed(w, p) // b:
                return False
        roots = []
        for g, (b, _) in enumerate(self.groups):
            for j, x in enumerate(r.tables[g][p // b:], p // b):
                # (a key this request does not reach: another's marks cached it; the
                # recompute does not cache it again, vLLM's keeps it)
                self.diverged |= bool(self.keys[x]) and not self._reachable(g, j, r)
                key = next((k for k, held in self.spares.items() if x in held), None)
                if key is not None:  # (a spare: unlisted)
                    self.diverged = True
                    self._drop_tail(x)
                    self.spares[key].remove(x)
                    if not self.spares[key]:
                        del self.spares[key]
                elif self.keys[x]:
                    key = self.keys[x][0]
                    if self.spares.get(key):
                        self._unhold(x, key)
                        self.diverged = True
                    else:
                        roots.append(key[1:])
        self._forget(roots, r, {(g, x) for g, (b, _) in enumerate(self.groups) for x in r.tables[g][p // b:]})
        if r.lost is not None and r.lost >= p // h:
            r.lost = None  # (its prefix ids from there are new ones)
        del r.tokens[p:]
        r.computed = p
        r.cached = [min(c, p // b) for c, (b, _) in zip(r.cached, self.groups, strict=True)]
        return True

    def _unhold(self, x, key):
        """Block ``x`` loses ``key``: the first spare takes it over."""
        self.holders[key].remove(x)
        self.keys[x].remove(key)
        heir = self.spares[key].pop(0)
        if not self.spares[key]:
            del self.spares[key]
        self.holders[key].append(heir)
        self.keys[heir].append(key)
        self._drop_tail(x)

    def _forget(self, roots, rewound, own):
        """Forget the prefixes ``roots`` (``(extra, tokens)``) and every one extending them
        (``own``: the rewound request's ``(group, block)`` that lose their content)."""
        if not roots:
            return
        def under(extra, tokens):
            return any(extra == e and tokens[:len(t)] == t for e, t in roots)
        freed = []
        for key in [k for k in self.holders if under(*k[1:])]:
            spares = self.spares.pop(key, None)  # (unlisted: a spare announces nothing)
            self.diverged |= bool(spares)
            self.events.extend([("removed", key)] * (len(self.holders[key]) if self._each(key) else 1))
            for x in spares or ():
                self._drop_tail(x)
            for x in self.holders.pop(key):
                self.diverged |= (key[0], x) not in own
                self.keys[x].remove(key)
                self._drop_tail(x)
                if not self.refs[x]:
                    freed.append((key[0], x))
        freed.sort()
        for _, x in freed:
            self.free.remove(x)
        self.free.extendleft([x for _, x in freed])
        for r in self.reqs.values():
            if r is rewound:
                continue
            for e, t in roots:
                d = len(t) // self.h - 1
                if r.extra == e and r.computed // self.h > d and (r.lost is None or r.lost > d) \
                        and tuple(r.tokens[:len(t)]) == t:
                    r.lost, self.diverged = d, True
