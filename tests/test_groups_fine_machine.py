"""tests/test_groups_sizes_machine.py's machine on vLLM's fine-grained partial hits with a
full-attention group larger than the hash block (groups/partial_full.py, groups/fine.py):
prefixkv's manager beside tests/sized_model.py's reference (``partial``: ``_fine_hit``,
``_full_tail``), itself checked against vLLM's manager on these layouts
(tests/engines/test_vllm_sized_model.py)."""

from machine_rules import case
from test_groups_sizes_machine import SizedMachine


class FineMachine(SizedMachine):
    """Full attention at 8 beside Mamba at 16 (hash 4): a hit found inside a
    full-attention block by its partial entry, copied on write, the entry promoted."""

    groups = ((8, None), (16, "mamba"))
    hash_size = 4
    extra_blocks = 4
    partial = True


class FineWideMachine(SizedMachine):
    """Full attention at 16 beside Mamba at 8 (hash 4): three boundaries inside each
    full-attention block, Mamba's inside its own."""

    groups = ((16, None), (8, "mamba"))
    hash_size = 4
    extra_blocks = 4
    partial = True


class FineTwoFullMachine(SizedMachine):
    """Full attention at 4, Mamba at 4, full attention at 4 (hash 2): two groups find a
    partial entry together."""

    groups = ((4, None), (4, "mamba"), (4, None))
    hash_size = 2
    extra_blocks = 5
    partial = True


TestFineMachine = case(FineMachine, max_examples=60, stateful_step_count=40)
TestFineWideMachine = case(FineWideMachine, max_examples=60, stateful_step_count=40)
TestFineTwoFullMachine = case(FineTwoFullMachine, max_examples=60, stateful_step_count=40)


def test_a_spare_with_its_partial_entry_announces_nothing_when_its_request_decodes():
    # (found by a random seed, session 30) full8+mamba16, hash 4: r1 and r2 compute the
    # same 8 tokens (no hit: Mamba holds no state at 8); r2's block 3 is a spare of r1's
    # block 1 (its whole key unannounced) holding its own entry at 4. r2 decodes 4
    # tokens: nothing is cached anew, so nothing is announced, as vLLM's manager
    # (tests/engines/test_vllm_fine_full.py); the model had promoted the spare's entry
    # again (removed, then stored at 4)
    from test_groups_sizes_machine import PREFIXES

    state = FineMachine()
    state.setup()
    r1 = state.add(chunk=None, extra=None, prompt=PREFIXES[0][:8])
    state.same_events()
    r2 = state.add_known_prefix(cut=7, pre=0, tail=1)  # (PREFIXES[0][7] is 1: the same 8 tokens)
    state.same_events()
    assert state.model.spares == {(0, None, tuple(PREFIXES[0][:8])): [3]}
    state.append(rid=r2, toks=[0, 0, 0, 0])
    assert state.model.events == []
    state.same_events()
    state.same_tables_and_free_queue()
    state.same_hits()
    assert state.model.spares == {(0, None, tuple(PREFIXES[0][:8])): [3]}
    assert [[list(g) for g in state.m.get_block_ids(r)] for r in (r1, r2)] == [[[1], [2]], [[3, 5], [4]]]
    state.teardown()
