"""prefixkv's sized hybrid manager beside tests/sized_model.py with Mamba's sparse
retention (``mamba(retention=R)``: vLLM's ``prefix_cache_retention_interval`` beside a
Mamba group), with chunk-end checkpoints (where 0 lets only a step reaching vLLM's
``prefill_end`` checkpoint) and without: the machines of tests/test_groups_sizes_machine.py,
with a retention."""

from __future__ import annotations

from machine_rules import case
from test_groups_sizes_machine import (
    CheckpointMachine,
    CheckpointWideMachine,
    MambaBesideFullMachine,
    MambaBesideWindowMachine,
)


class CheckpointRetentionMachine(CheckpointWideMachine):
    """Mamba at 12 and at 12 beside full attention at 4 (hash 4), chunk-end checkpoints,
    retention 0 (vLLM's default): a prompt's last chunk checkpoints only, and a Mamba
    state is kept at the request's marks only."""

    retention = 0


class CheckpointSegmentsMachine(CheckpointMachine):
    """Full attention at 4 beside Mamba at 8 (hash 4), chunk-end checkpoints, a state
    kept every 16 tokens besides the marks (retention 16)."""

    retention = 16


class MambaRetentionMachine(MambaBesideFullMachine):
    """Full attention at 8 beside Mamba at 4 (lcm 8), retention 0: Mamba's states at the
    request's marks, rounded down to 8, only."""

    retention = 0


class MambaWindowSegmentsMachine(MambaBesideWindowMachine):
    """A 10-token window at 8, full attention at 4, Mamba at 8, retention 16 (the
    window's and Mamba's)."""

    retention = 16


TestCheckpointRetentionMachine = case(CheckpointRetentionMachine, max_examples=60, stateful_step_count=40)
TestCheckpointSegmentsMachine = case(CheckpointSegmentsMachine, max_examples=60, stateful_step_count=40)
TestMambaRetentionMachine = case(MambaRetentionMachine, max_examples=60, stateful_step_count=40)
TestMambaWindowSegmentsMachine = case(MambaWindowSegmentsMachine, max_examples=60, stateful_step_count=40)
