"""``ConnectorScheduler``: the scheduler side of ``PrefixKVConnector`` (no vLLM import;
it reads vLLM's ``Request`` and ``SchedulerOutput`` by attribute).

Blocks are named in the store by prefixkv's chain hashes (``prefixkv.hashing``, sha256
with the configured seed), so every replica, and every prefixkv manager with the same
``StoreLayout``, finds the others' blocks (after a reset, those of the ones that reset
as often: ``reset``)::

    lookup     held = EXISTS of the blocks past the local hit, sent with the step's
               other lookups from the lookup thread (``connector_lookup``): None (ask
               again next step) until it is back, then (held blocks x block_size,
               load_async=True); 0 when it failed or passed lookup_timeout. Without
               that thread (``lookups`` None), one EXISTS on the scheduler's thread
    alloc      the held blocks' fresh device ids -> a load (``BlockRun``) for the workers
    each step  blocks that this step's forward pass completes, whose tokens are known
               -> saves; a finished request's last full blocks -> a final save, its
               free delayed until the workers report it sent
    workers    fetch, content-check and write the load off the model runner's critical
               path; a block that fails the check is reported invalid: vLLM recomputes
               from it (``kv_load_failure_policy="recompute"``); the request's lookups
               stop before it until the request saves it again

The lookup reads no value: a held block can still fail the check when a worker reads
it, and is then a miss, never KV. A failing store costs misses; it is left alone for
``retry_after`` seconds after a failure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...hashing import HashFn
from ...store.link import StoreLink
from ...store.mistakes import own_mistake
from ...store.protocol import StoreBackend
from .connector_chains import Chain, Chains
from .connector_lookup import FAILED, Lookups
from .connector_meta import BlockRun, PrefixKVConnectorMetadata


@dataclass
class ConnectorStats:
    """Counts since the connector started: lookups made, blocks the store held at
    lookup, blocks handed to workers to load and to save, failed store calls."""

    lookups: int = 0
    held_blocks: int = 0
    load_blocks: int = 0
    save_blocks: int = 0
    store_errors: int = 0


class ConnectorScheduler:
    """``link``: the store as rank 0's workers see it (its keys); ``backend``: the
    client for lookups (its timeout bounds the time a lookup may take);
    ``fn``/``root``: the chain hash and its root; ``lookups``: the lookup thread's
    queue (None: each lookup is made on the caller's thread)."""

    def __init__(self, link: StoreLink, backend: StoreBackend, block_size: int, fn: HashFn,
                 root: bytes, *, retry_after: float = 1.0, lookups: Lookups | None = None) -> None:
        self._link, self._backend, self._bs = link, backend, block_size
        self._lookups = lookups
        self._fn, self._retry_after = fn, retry_after
        self._chains = Chains(fn, root, block_size)  # (request id -> its named blocks)
        self._loads: list[BlockRun] = []
        # loads not reported finished yet, each with the index of its first block
        self._loading: dict[str, tuple[int, BlockRun]] = {}
        self._finals: list[BlockRun] = []
        self.saved: list[tuple[Any, int, int]] = []  # (request, first, end) handed to save
        self._quiet_until = 0.0
        self.stats = ConnectorStats()

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: the tokens of the full blocks past
        ``num_computed_tokens`` (block-aligned) that the store holds, from there on,
        leaving the last prompt token to compute; and whether they load asynchronously
        (always, when there are any). With ``lookups``: None (cannot tell yet) until
        the request's lookup is back."""
        bs = self._bs
        local, most = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        c = self._chains.of(request, most)
        c.saved, c.offered = local, False
        if c.bad is not None:  # a load failed there: offered again, it would fail again
            most = min(most, c.bad)  # (and vLLM would ask again: a request that never runs)
        if local >= most or time.monotonic() < self._quiet_until:
            return 0, False
        prefix = self._link.prefix(c.extra)
        keys = [prefix + h.hex().encode() for h in c.hashes[local:most]]
        if self._lookups is not None:
            got = self._lookups.answer(request.request_id, local, keys)
            if got is None:
                return None, False
            held = got
        else:
            try:
                held = int(self._backend.held(keys))
            except Exception as exc:
                own_mistake(exc, "StoreBackend.held (vLLM connector)")
                held = FAILED
        self.stats.lookups += 1
        if held == FAILED:
            self.stats.store_errors += 1
            self._quiet_until = time.monotonic() + self._retry_after
            return 0, False
        self.stats.held_blocks += held
        c.offered = held > 0
        return held * bs, held > 0

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """``update_state_after_alloc``: ``block_ids`` are all the request's blocks (group
        0); a load is stated for the ``num_external_tokens`` past the local hit. The
        request's lookup is used up (asked again, say after a preemption, it is made
        again)."""
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        c = self._chains.get(request.request_id)
        if c is None or c.request is not request:  # admitted without our lookup
            c = self._chains.of(request, 0)
            c.saved = request.num_computed_tokens // self._bs
        c.offered = False
        if num_external_tokens <= 0:
            return
        start = c.saved
        end = start + num_external_tokens // self._bs
        self._chains.name(c, end)  # (named by the lookup already, unless vLLM deferred it)
        run = self._chains.run(c, start, end, block_ids[start:end], self._link.tag)
        self._loads.append(run)
        self._loading[request.request_id] = (start, run)
        self.stats.load_blocks += end - start
        c.saved = end

    def on_output(self, finished_recving: set[str], invalid_block_ids: set[int]) -> None:
        """``update_connector_output``: a load whose block failed (store down, or a value
        that failed the content check) leaves that block and the ones after it to be
        recomputed, and then saved again, and the request's later lookups stop before
        it until that save (else the same value is loaded, fails and is recomputed from
        again, for good, when it is the first block: vLLM asks again at once when a
        request has no computed token); a finished load is forgotten. The failed block is
        placed by the load's own first block, not by its name: the chain may have been
        named again since (a streaming session's new inputs)."""
        if invalid_block_ids:
            for req_id, (start, run) in self._loading.items():
                bad = [i for i, b in enumerate(run.block_ids) if b in invalid_block_ids]
                c = self._chains.get(req_id)
                if bad and c is not None:
                    first = start + bad[0]
                    c.saved = min(c.saved, first)
                    c.bad = first if c.bad is None else min(c.bad, first)
        for req_id in finished_recving:
            self._loading.pop(req_id, None)

    def build_meta(self, scheduler_output: Any, block_ids_of: Any) -> PrefixKVConnectorMetadata:
        """``build_connector_meta``: sends the step's lookups; the loads stated since
        the last step, the saves of the blocks this step completes
        (``block_ids_of(req_id)``: the request's block ids) and the final saves of
        finished requests."""
        if self._lookups is not None:
            self._lookups.flush()  # this step's lookups, one pipeline
        meta = PrefixKVConnectorMetadata(loads=self._loads, finals=self._finals)
        self._loads, self._finals = [], []
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            c = self._chains.get(req_id)
            if c is None:
                continue
            r = c.request
            done = min(r.num_computed_tokens + n - len(spec.get(req_id, ())), len(r.all_token_ids))
            run = self._save(c, done // self._bs, block_ids_of(req_id))
            if run is not None:
                meta.saves.append(run)
        return meta

    def _save(self, c: Chain, end: int, block_ids: Sequence[int]) -> BlockRun | None:
        """The save of chain ``c``'s blocks from ``c.saved`` to ``end``, if any. A save
        over the block a load of the request failed at ends the stop before it: the
        store is to hold the request's own KV there (a save dropped or refused leaves
        the old value, which fails again, and is recomputed and saved again)."""
        start = c.saved
        if end <= start or c.stale:
            return None
        self._chains.name(c, end)
        c.saved = end
        if c.bad is not None and start <= c.bad < end:
            c.bad = None
        self.stats.save_blocks += end - start
        self.saved.append((c.request, start, end))
        return self._chains.run(c, start, end, block_ids[start:end], self._link.tag)

    def finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """``request_finished``: True (delay the free) when full blocks of the request
        remain to be saved; their save goes out with the next step. A request still
        waiting for its load (``WAITING_FOR_REMOTE_KVS``: vLLM counts the tokens to load
        as computed, but a deferred load has not started and a started one has not
        landed) computed nothing here: nothing is saved, and vLLM itself holds the
        blocks of a load in flight until it lands. (vLLM sets the finished status
        before it calls this: a load answered and not stated yet is what tells a
        deferred one, a started one left ``saved`` at its end.)"""
        c = self._chains.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        if c is None or c.request is not request:
            return False
        if c.offered or getattr(getattr(request, "status", None), "name",
                                None) == "WAITING_FOR_REMOTE_KVS":
            return False
        done = min(request.num_computed_tokens, len(request.all_token_ids)) // self._bs
        run = self._save(c, done, block_ids)
        if run is None:
            return False
        self._finals.append(run)
        return True

    def reset(self) -> bool:
        """``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``, run by
        ``pause_generation(clear_cache=True)`` around a weight update): keys carry the
        ``reset_tag`` of the count of resets (``StoreLink.reset``, the rule of
        ``KVCacheManager``: replicas of either kind reset alike share; the chain hashes
        stay), so nothing saved before is found; requests known now never save (their
        KV may predate it); loads stated land as stated (their runs keep their tag).
        True (vLLM's default, None, counted as done while the store served the old
        weights' KV)."""
        self._link.reset(self._fn)
        for c in self._chains.values():
            c.stale = True
        return True

    def pending(self) -> int:
        """Requests whose lookup is kept (asked, in flight, or answered and not used)."""
        return 0 if self._lookups is None else self._lookups.pending()

    def close(self) -> None:
        """Stop the lookup thread, if any."""
        if self._lookups is not None:
            self._lookups.close()

