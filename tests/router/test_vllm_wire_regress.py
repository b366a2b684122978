"""Explicit step sequences the vLLM wire state machine (test_vllm_wire_fuzz.py) found,
replayed as plain tests so a clean clone (no example database) runs them every time."""

from types import SimpleNamespace

from router.test_vllm_wire_fuzz import VllmWire


def run_steps(steps):
    m = VllmWire()
    try:
        for name, kwargs in steps:
            getattr(m, name)(**kwargs)
            m.nothing_raised()
    finally:
        m.teardown()


def test_restart_mid_replay_after_lost_end_does_not_overstate():
    """The router said 4 cached tokens for [9]*12 when the manager had 0: a replay
    answer cut short by a restart, then a restart between steps, then a truncated frame."""
    count, nine, five = list(range(1, 13)), [9] * 12, [5] * 8
    seven = list(range(1, 9)) + [7, 7, 7, 7]
    run_steps([
        ("setup", {"buffer_steps": 3}),
        ("sync", {"prompt": five}),
        ("sync", {"prompt": count}),
        ("tap_fault", {"fault": "restart"}),
        ("restart", {}),
        ("step", {"cut": 2, "fate": "deliver", "prompt": seven}),
        ("sync", {"prompt": list(range(30, 42))}),
        ("tap_fault", {"fault": "no_end"}),
        ("step", {"cut": 2, "fate": "twice", "prompt": count}),
        ("sync", {"prompt": seven}),
        ("sync", {"prompt": nine}),
        ("tap_fault", {"fault": "whole"}),
        ("tap_fault", {"fault": "restart"}),
        ("step", {"cut": 1, "fate": "hold", "prompt": five}),
        ("sync", {"prompt": seven}),
        ("step", {"cut": 2, "fate": "deliver", "prompt": five}),
        ("sync", {"prompt": five}),
        ("tap_fault", {"fault": "restart"}),
        ("step", {"cut": 2, "fate": "truncate", "prompt": count}),
        ("sync", {"prompt": five}),
    ])


def test_no_precondition_reads_the_taps_thread():
    """Each rule's preconditions answer alike whatever the tap's thread has done: its
    ``restarted`` is set when a replay request reaches it, at any time, so a precondition
    reading it chose another rule for the same draws under load (FlakyStrategyDefinition,
    seen once). A restart the tap made, sampled or not (``seen``), leaves them as they are."""
    for restarts in range(3):
        answers = []
        for restarted, seen in ((0, 0), (1, 0), (1, 1)):
            m = SimpleNamespace(restarts=restarts, seen=seen, tap=SimpleNamespace(restarted=restarted))
            answers.append([all(p(m) for p in r.preconditions) for r in VllmWire.setup_state().rules])
        assert answers[0] == answers[1] == answers[2], (restarts, answers)
