"""Edges of the core's lookahead keys (core/lookahead.py) that the machine
(tests/test_lookahead_machine.py) reaches rarely or never: a decode step or an
``append_tokens`` that makes a block's lookahead known, an empty ``add_tokens``, the
Prompts another manager prepared."""

from __future__ import annotations

import pytest

from prefixkv.core.lookahead import LookaheadKVCacheManager
from prefixkv.core.manager import KVCacheManager
from prefixkv.errors import PromptError, RequestError


def test_append_tokens_keys_the_block_whose_lookahead_it_brings():
    """One token scheduled, then four appended: block 0 is full and its lookahead token
    (token 4) known, so it is keyed with it: found by a reader whose token 4 is the same,
    not by one whose token 4 differs."""
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=1)
    m.add_request("a", [0])
    m.append_tokens("a", [1, 2, 3, 4])
    assert m.lookup([0, 1, 2, 3, 4, 5]) == 4
    assert m.lookup([0, 1, 2, 3, 9, 5]) == 0
    m.check_invariants()


def test_a_decode_step_that_fills_a_block_is_refused_before_any_change():
    """A step's token fills block 0 before its lookahead token is known: RequestError,
    the request unchanged."""
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=1)
    m.add_request("a", [0, 1, 2])
    m.add_request("b", [5])
    with pytest.raises(RequestError, match="lookahead"):
        m.append_step(["b", "a"], [6, 3])
    assert (m.num_tokens("a"), m.num_scheduled_tokens("a")) == (3, 3)
    assert (m.num_tokens("b"), m.num_scheduled_tokens("b")) == (1, 1)
    assert m.lookup([0, 1, 2, 3, 4]) == 0
    m.check_invariants()
    m.append_step(["b"], [6])
    assert m.num_tokens("b") == 2
    m.check_invariants()


def test_adding_no_tokens_changes_nothing():
    """An empty ``add_tokens`` to a request whose prefill is done leaves it done: its
    decode steps go on."""
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=1)
    m.add_request("a", [0, 1])
    m.add_tokens("a", [])
    m.check_invariants()
    m.append_step(["a"], [2])
    assert (m.num_tokens("a"), m.num_scheduled_tokens("a")) == (3, 3)
    m.check_invariants()


def test_another_managers_prompt_is_refused():
    """A Prompt prepared by a plain manager, or by a lookahead manager of another L, or
    prepared twice: PromptError, nothing admitted."""
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=1)
    tokens = list(range(10))
    with pytest.raises(PromptError, match="lookahead"):
        m.lookup(KVCacheManager(64, 4).prepare(tokens))
    with pytest.raises(PromptError, match="lookahead"):
        m.add_request("a", LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=2).prepare(tokens))
    with pytest.raises(PromptError, match="prepared already"):
        m.prepare(m.prepare(tokens))
    assert m.num_free_blocks == 64
    m.check_invariants()


def test_a_hash_mode_callable_or_events_alone_are_offered():
    """Only a ``hash_mode`` callable *with* events on is refused; each alone builds."""
    def mode(b):
        return b[:16]
    for options in ({"hash_mode": mode}, {"enable_events": True}):
        m = LookaheadKVCacheManager(16, 4, hash_lookahead_tokens=1, **options)
        m.add_request("a", list(range(6)), num_new_tokens=4)
        assert m.lookup(list(range(6))) == 4
        m.check_invariants()


def test_append_tokens_short_of_blocks_or_refused_keeps_the_keys():
    """An ``append_tokens`` that answers None (short of blocks) or is refused (tokens not
    yet scheduled) leaves the request's keys as they were: the same request's block 0,
    filled later with another token after it, is keyed with that token."""
    m = LookaheadKVCacheManager(3, 4, hash_lookahead_tokens=1)
    m.add_request("b", [7])
    m.add_request("a", [0])
    m.add_request("c", [5, 6, 7], num_new_tokens=1)
    assert m.append_tokens("a", [1, 2, 3, 4]) is None
    m.check_invariants()
    m.free("b")
    assert m.append_tokens("a", [1, 2, 3, 9]) is not None
    assert m.lookup([0, 1, 2, 3, 9, 5]) == 4
    assert m.lookup([0, 1, 2, 3, 4, 5]) == 0
    m.check_invariants()
    with pytest.raises(RequestError, match="not yet scheduled"):
        m.append_tokens("c", [8, 9])
    m.add_tokens("c", [4, 1])
    m.extend("c", 3)
    assert m.lookup([5, 6, 7, 4, 1, 0]) == 4
    m.check_invariants()
