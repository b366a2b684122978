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
