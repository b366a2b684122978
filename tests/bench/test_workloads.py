"""Seeded workloads: deterministic, scaled by count, with the sharing they promise."""

from __future__ import annotations

import io

import pytest

from prefixkv.bench.progress import Progress
from prefixkv.bench.workloads import BUILTIN, builtin, token_bound


@pytest.mark.parametrize("name", BUILTIN)
def test_same_seed_same_requests(name):
    a, b = builtin(name, 0.05, seed=4), builtin(name, 0.05, seed=4)
    assert a.requests == b.requests
    assert builtin(name, 0.05, seed=5).requests != a.requests
    assert all(r.output and r.prompt for r in a.requests)


def test_shapes():
    sp = builtin("system-prompt", 0.05)
    assert len(sp.requests) == 10
    assert len({r.prompt[:2048] for r in sp.requests}) == 1
    chat = builtin("chat", 0.1)
    turn0, turn1 = chat.requests[0], chat.requests[len(chat.requests) // 6]
    assert turn1.after == turn0.rid
    assert turn1.prompt[:len(turn0.prompt) + len(turn0.output)] == turn0.prompt + turn0.output
    doc = builtin("document", 0.02)
    assert len(doc.requests) == 2 and doc.requests[0].prompt[:32768] == doc.requests[1].prompt[:32768]


def test_unknown_workload():
    with pytest.raises(ValueError, match="choose from system-prompt, chat, document, pressure"):
        builtin("zipf")


def test_progress_draws_only_when_enabled():
    quiet = io.StringIO()  # not a TTY
    p = Progress(2, None, quiet)
    p.tick("a")
    p.close()
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    p = Progress(2, True, loud)
    p.tick("first")
    p.tick("second")
    p.close()
    text = loud.getvalue()
    assert "0/2" in text and "first" in text and "2/2" in text and text.endswith("\n")


@pytest.mark.parametrize("name", BUILTIN)
def test_token_bound_holds(name):
    for scale in (0.05, 0.3):
        wl = builtin(name, scale, seed=2)
        tokens = sum(len(r.prompt) + len(r.output) for r in wl.requests)
        bound, each = token_bound(name, scale)
        assert tokens <= bound and bound <= 2 * tokens
        assert max(len(r.prompt) + len(r.output) for r in wl.requests) <= each


def test_token_bound_of_an_unknown_workload():
    with pytest.raises(KeyError):
        token_bound("zipf")
