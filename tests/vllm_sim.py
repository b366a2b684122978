"""A vLLM-like engine loop over the vLLM-shaped adapter, for end-to-end tests.

Continuous batching with chunked prefill; speculative decoding (random drafts, a random
number accepted, a bonus token) or asynchronous scheduling (a step's sampled token joins
``all_token_ids`` only after the next step is scheduled); preemption of the newest
running request on shortage, as vLLM's scheduler does. ``num_computed_tokens`` advances
when a step is scheduled and falls back by the rejected drafts, as in vLLM.

The runner writes, for every scheduled position, the token whose KV the slot now holds
(``slot = block_id * block_size + offset``). ``check_hits`` verifies that every cache hit
reads exactly the tokens of the request that hit it, and ``write`` that a block another
live request holds is written only with that request's own tokens (same-step sharing).
"""

from __future__ import annotations

import random

from vllm_fakes import Req, make


class Sim:
    def __init__(self, seed: int, *, num_blocks: int, block_size: int = 4, asynchronous: bool,
                 drafts: int, lookahead: int, chunk: int = 7) -> None:
        self.rng = random.Random(seed)
        self.kv, self.mgr = make(num_blocks, block_size)
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
        self.check_hits(admitted)
        for r, start, n in scheduled:
            self.sample(r, start + n)
        for r in [r for r in self.running if len(r.all_token_ids) >= self.goal[r.request_id]]:
            self.running.remove(r)
            self.kv.free(r)
            self.pending.pop(r.request_id, None)
        self.mgr.check_invariants()

    def write(self, r: Req, start: int, n: int) -> None:
        table = self.kv.get_block_ids(r.request_id)[0]
        others = {b: (o, j) for o in self.running if o is not r
                  for j, b in enumerate(self.kv.get_block_ids(o.request_id)[0])}
        tokens = list(r.all_token_ids) + self.spec[r.request_id]
        for p in range(start, start + n):
            block = table[p // self.bs]
            if block in others:  # shared in the step that computes it: the same tokens
                o, j = others[block]
                assert j == p // self.bs and o.all_token_ids[p] == tokens[p], \
                    f"{r.request_id} writes block {block} that {o.request_id} reads"
            self.slots[block * self.bs + p % self.bs] = tokens[p]

    def check_hits(self, admitted: list[tuple[Req, int]]) -> None:
        for r, hit in admitted:
            table = self.kv.get_block_ids(r.request_id)[0]
            held = [self.slots.get(table[p // self.bs] * self.bs + p % self.bs) for p in range(hit)]
            assert held == list(r.all_token_ids[:hit]), f"{r.request_id} hit KV of other tokens"
            self.hits += hit

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
