"""A vLLM-like engine loop over the vLLM-shaped adapter, for end-to-end tests.

Continuous batching with chunked prefill; speculative decoding (random drafts, a random
number accepted, a bonus token) or asynchronous scheduling (a step's sampled token joins
``all_token_ids`` only after the next step is scheduled); preemption of the newest
running request on shortage, as vLLM's scheduler does. ``num_computed_tokens`` advances
when a step is scheduled and falls back by the rejected drafts, as in vLLM.

The runner writes, for every scheduled position, the token whose KV the slot now holds
(``slot = block_id * block_size + offset``), in every layer group. ``check_reads``
verifies that every key a scheduled step's queries read (a cache hit included; in a
windowed group only the window's) holds exactly the request's own token, and ``write``
that a block another live request holds is written only with that request's own tokens
(same-step sharing). ``groups``: run a ``VllmHybridKVCacheManager`` over these layer
groups instead of the one-group adapter.
"""

from __future__ import annotations

import random

from prefixkv.adapters.vllm_hybrid import VllmHybridKVCacheManager
from prefixkv.groups import CHUNKED, SLIDING, HybridKVCacheManager, full_attention
from vllm_fakes import Req, make


def reads_from(spec, pos: int) -> int:
    """The first key a query at ``pos`` reads (the attention's definition, apart from
    ``GroupSpec.first_needed``, which the oracle must not share)."""
    if spec.kind == SLIDING:
        return max(0, pos - spec.tokens + 1)
    return pos - pos % spec.tokens if spec.kind == CHUNKED else 0


class Sim:
    def __init__(self, seed: int, *, num_blocks: int, block_size: int = 4, asynchronous: bool,
                 drafts: int, lookahead: int, chunk: int = 7, groups=None) -> None:
        self.rng = random.Random(seed)
        if groups is None:
            self.kv, self.mgr = make(num_blocks, block_size)
            self.specs, self.null = [full_attention()], None
        else:
            self.mgr = HybridKVCacheManager(groups, num_blocks, block_size, enable_events=True)
            self.kv = VllmHybridKVCacheManager(self.mgr)
            self.specs, self.null = list(groups), self.mgr.null_block_id
        self.bs, self.asynchronous, self.drafts, self.lookahead = block_size, asynchronous, drafts, lookahead
        self.chunk = chunk
        self.slots: dict[int, int] = {}  # slot -> token whose KV it holds
        self.pending: dict[str, int] = {}  # asynchronous: sampled, not yet in all_token_ids
        self.spec: dict[str, list[int]] = {}  # drafts scheduled this step
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.goal: dict[str, int] = {}
        self.preemptions = self.hits = self.rejected = 0

    def add(self, req: Req, num_outputs: int) -> None:
        self.waiting.append(req)
        self.goal[req.request_id] = len(req.all_token_ids) + num_outputs

    def add_shared_prefix_requests(self, rng: random.Random, shared_len: int, max_outputs: int) -> None:
        """12 requests, each a random-length piece of one random prefix of ``shared_len``
        tokens and 1-14 tokens of its own, generating 1 to ``max_outputs`` - 1 tokens."""
        shared = [rng.randrange(1, 50) for _ in range(shared_len)]
        for i in range(12):
            prompt = shared[:rng.randrange(shared_len + 1)] + [
                rng.randrange(1, 50) for _ in range(rng.randrange(1, 15))]
            self.add(Req(f"r{i}", prompt), num_outputs=rng.randrange(1, max_outputs))

    def _positions(self, r: Req) -> int:
        """Positions whose token is known or will be known when the step runs."""
        return len(r.all_token_ids) + (r.request_id in self.pending)

    def _preempt(self, r: Req) -> None:
        self.kv.free(r)
        if r.request_id in self.pending:  # its in-flight output arrives anyway
            r.all_token_ids.append(self.pending.pop(r.request_id))
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.waiting.insert(0, r)
        self.preemptions += 1

    def step(self) -> None:
        kv, rng = self.kv, self.rng
        scheduled: list[tuple[Req, int, int]] = []
        for r in list(self.running):
            if r not in self.running:
                continue
            n = min(self.chunk, self._positions(r) - r.num_computed_tokens)
            decoding = r.num_computed_tokens + n == len(r.all_token_ids) and len(r.all_token_ids) > 0
            drafts = [rng.randrange(1, 50) for _ in range(rng.randrange(self.drafts + 1))] \
                if decoding and not self.asynchronous else []
            while kv.allocate_slots(r, n + len(drafts), num_lookahead_tokens=self.lookahead) is None:
                victim = self.running.pop()
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.spec[r.request_id] = drafts
                scheduled.append((r, r.num_computed_tokens, n + len(drafts)))
                r.num_computed_tokens += n + len(drafts)
        admitted: list[tuple[Req, int]] = []
        while self.waiting:
            r = self.waiting[0]
            blocks, hit = kv.get_computed_blocks(r)
            n = min(self.chunk, len(r.all_token_ids) - hit)
            new = kv.allocate_slots(r, n, hit, blocks, num_lookahead_tokens=self.lookahead,
                                    full_sequence_must_fit=rng.random() < 0.5)
            if new is None:
                break
            self.running.append(self.waiting.pop(0))
            self.spec[r.request_id] = []
            admitted.append((r, hit))
            scheduled.append((r, hit, n))
            r.num_computed_tokens = hit + n
        for rid, token in self.pending.items():  # asynchronous: last step's outputs arrive
            next(r for r in self.running if r.request_id == rid).all_token_ids.append(token)
        self.pending.clear()
        for r, start, n in scheduled:
            self.write(r, start, n)
        for r, start, n in scheduled:
            self.check_reads(r, start, n)
        self.hits += sum(hit for _, hit in admitted)
        for r, start, n in scheduled:
            self.sample(r, start + n)
        for r in [r for r in self.running if len(r.all_token_ids) >= self.goal[r.request_id]]:
            self.running.remove(r)
            self.kv.free(r)
            self.pending.pop(r.request_id, None)
        self.mgr.check_invariants()

    def write(self, r: Req, start: int, n: int) -> None:
        others = {b: (o, j) for o in self.running if o is not r
                  for t in self.kv.get_block_ids(o.request_id)
                  for j, b in enumerate(t) if b != self.null}
        tokens = list(r.all_token_ids) + self.spec[r.request_id]
        for table in self.kv.get_block_ids(r.request_id):
            for p in range(start, start + n):
                block = table[p // self.bs]
                assert block != self.null, f"{r.request_id} writes position {p} into the null block"
                if block in others:  # shared in the step that computes it: the same tokens
                    o, j = others[block]
                    assert j == p // self.bs and o.all_token_ids[p] == tokens[p], \
                        f"{r.request_id} writes block {block} that {o.request_id} reads"
                self.slots[block * self.bs + p % self.bs] = tokens[p]

    def check_reads(self, r: Req, start: int, n: int) -> None:
        """Every key the step's queries (positions ``start .. start+n-1``) read, in every
        group, holds the request's token: a hit's, a computed one's, or this step's."""
        tokens = list(r.all_token_ids) + self.spec[r.request_id]
        for spec, table in zip(self.specs, self.kv.get_block_ids(r.request_id), strict=True):
            first = reads_from(spec, start)
            held = [self.slots.get(table[p // self.bs] * self.bs + p % self.bs)
                    for p in range(first, start + n)]
            assert held == tokens[first:start + n], f"{r.request_id} reads KV of other tokens"

    def sample(self, r: Req, end: int) -> None:
        """After the step ran: a token is sampled when the step reached the last
        position; drafts are accepted in part."""
        if r not in self.running or end < self._positions(r) + len(self.spec[r.request_id]):
            return
        token = self.rng.randrange(1, 50)
        if self.asynchronous:
            self.pending[r.request_id] = token
            return
        drafts = self.spec[r.request_id]
        keep = self.rng.randrange(len(drafts) + 1)
        r.all_token_ids += drafts[:keep] + [token]
        r.num_computed_tokens -= len(drafts) - keep
        self.rejected += len(drafts) - keep

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running):
                return
            self.step()
        raise AssertionError("the engine did not finish")
