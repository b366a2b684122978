"""The state machine of ``test_state_machine``, with admissions that use every option at
once: ``read_cache=False``, ``num_lookahead_tokens``, ``require_full_fit`` and
``resumed``, on top of chunked prefill, forks, decode, reserves, preemption, a host tier
and pools of two and three blocks. The simulated KV store still checks, after every
step, that every live request's blocks hold exactly its KV; this rule also checks what
each option promises (what the admission finds, the blocks it covers, the stats it
counts, nothing changed on a shortage or a refusal)."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from prefixkv import PromptTooLongError
from prefixkv.core.block import blocks_for
from test_state_machine import ManagerMachine, prompts, salts


class OptionsMachine(ManagerMachine):
    """The plain manager (no tier), nine blocks."""

    num_blocks = 9

    @rule(prompt=prompts, extra=salts, chunk=st.none() | st.integers(1, 6),
          read_cache=st.booleans(), lookahead=st.integers(0, 6), full_fit=st.booleans(),
          resumed=st.booleans())
    def add_with_options(self, prompt, extra, chunk, read_cache, lookahead, full_fit, resumed):
        rid = self._new_id()
        before = self._snapshot()
        predicted = self.m.lookup(prompt, extra=extra) if read_cache else 0
        free = self.m.num_free_blocks
        try:
            adm = self.m.add_request(rid, prompt, extra=extra, num_new_tokens=chunk,
                                     read_cache=read_cache, num_lookahead_tokens=lookahead,
                                     require_full_fit=full_fit, resumed=resumed)
        except PromptTooLongError as e:
            first = len(prompt) if chunk is None else min(len(prompt), chunk)
            assert e.needed > self.num_blocks, e
            assert e.needed == max(blocks_for(len(prompt), self.bs), blocks_for(first + lookahead, self.bs))
            assert self._snapshot() == before and self.m.take_kv_ops() == []
            return
        if adm is None:
            assert self._snapshot() == before and self.m.take_kv_ops() == []
            return
        cached, new = adm.num_cached_tokens, adm.num_new_tokens
        assert cached == predicted, (cached, predicted)
        assert 0 < new and cached + new <= len(prompt)
        assert new == len(prompt) - cached if chunk is None else min(chunk, len(prompt) - cached)
        assert len(adm.block_ids) == blocks_for(cached + new + lookahead, self.bs), adm
        if full_fit:  # the whole prompt's blocks were free (its hits' own included)
            assert blocks_for(len(prompt), self.bs) - cached // self.bs <= free, (adm, free)
        got = self.m.stats - before[1]
        counted = ((got.preempted_requests, got.preempted_queries, got.preempted_hits)
                   if resumed else (got.requests, got.queries, got.hits))
        assert counted == (1, len(prompt), cached), (resumed, got)
        assert got.host_hits <= (0 if resumed else cached)
        self.tokens[rid] = list(prompt)
        self.extra[rid] = extra
        self.scheduled[rid] = cached + new
        self.reserved[rid] = cached + new + lookahead
        self._write(rid, cached, cached + new)


class HostTierOptionsMachine(OptionsMachine):
    """With a host tier: hits loaded from slots, evictions offloaded."""

    num_blocks = 7
    host_blocks = 6


class TinyPoolOptionsMachine(OptionsMachine):
    """Two device blocks and two host slots: nearly every admission evicts, offloads or
    is refused."""

    num_blocks = 2
    host_blocks = 2


class BlockSizeOneOptionsMachine(OptionsMachine):
    """Blocks of one token, a host tier: every prompt is k*bs+1, chunks end on block
    edges."""

    bs = 1
    num_blocks = 12
    host_blocks = 6


class ThreeBlockOptionsMachine(OptionsMachine):
    """Three device blocks, six host slots."""

    num_blocks = 3
    host_blocks = 6


TestOptionsMachine, TestHostTierOptionsMachine, TestTinyPoolOptionsMachine, \
    TestThreeBlockOptionsMachine, TestBlockSizeOneOptionsMachine = (
        machine.TestCase for machine in (OptionsMachine, HostTierOptionsMachine,
                                         TinyPoolOptionsMachine, ThreeBlockOptionsMachine,
                                         BlockSizeOneOptionsMachine))
for _case in (TestOptionsMachine, TestHostTierOptionsMachine, TestTinyPoolOptionsMachine,
              TestThreeBlockOptionsMachine, TestBlockSizeOneOptionsMachine):
    _case.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
del _case
