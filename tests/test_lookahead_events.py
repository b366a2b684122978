"""Events of lookahead keys (``core/lookahead_events.py``): every ``BlockStored`` carries
its blocks' lookahead tokens, a consumer rebuilds each chain hash from the event alone
(its parent's hash, the block's tokens, its extra keys over the block and the ``L``
tokens after it, those ``L`` tokens), ``hashing.block_hashes(..., hash_lookahead_tokens=L)``
names a prompt's blocks as the events do, and the mirror of the events (hashes stored
and not removed) predicts ``lookup`` exactly: the lookahead state machines
(test_lookahead_machine) with events on, with a large pool and with a small one whose
log overflows (restatements: ``BlockStored.block``).
"""

from __future__ import annotations

import pytest

from prefixkv import BlockStored, ExtraKeys, MultiModalInput
from prefixkv.core.lookahead import LookaheadKVCacheManager
from prefixkv.core.lookahead_events import LookaheadBlockStored
from prefixkv.errors import ConfigError
from prefixkv.hashing import block_hashes, encode_tokens, lookahead_bytes, make_hash_fn
from test_index import Mirror as IndexMirror
from test_lookahead_machine import EvictingLookaheadMachine, LookaheadMachine, case

FN, ROOT = make_hash_fn("sha256", None)


def rebuilt(ev):
    """The chain hashes of ``ev``'s blocks from its own fields (and the root)."""
    la, bs, tokens = ev.lookahead, ev.block_size, ev.token_ids
    h, out = ev.parent_block_hash or ROOT, []
    for i in range(len(ev.block_hashes)):
        j = ev.first_block + i
        end = (j + 1) * bs
        x = ev.block_extra(i)  # (over the block and the L tokens after it)
        own = x.block_bytes(j + 1, bs)[j] if x is not None else b""
        after = lookahead_bytes(x, encode_tokens([0] * end + ev.lookahead_token_ids[i]), end, la)
        h = FN(h + encode_tokens(tokens[i * bs:(i + 1) * bs]).tobytes() + own + after)
        out.append(h)
    return out


class Checked:
    """A manager's ``take_events``, each store checked: lookahead events whose hashes
    rebuild from the event alone."""

    def __init__(self, m):
        self.m = m

    def take_events(self):
        out = self.m.take_events()
        for ev in out:
            if isinstance(ev, BlockStored):
                assert isinstance(ev, LookaheadBlockStored), ev
                assert rebuilt(ev) == list(ev.block_hashes), ev
        return out


class Mirror(IndexMirror):
    """test_index's mirror of the events (stores minus removals per hash), each store
    checked, asked with lookahead hashes."""

    def __init__(self, m):
        super().__init__(Checked(m))
        self.bs = m.block_size

    def predict(self, prompt, L):
        k = 0
        for h in block_hashes(prompt, self.bs, hash_lookahead_tokens=L):
            if h not in self.count:
                break
            k += 1
        return k * self.bs


class EventsMirrorRules:
    """The events' mirror asked every prompt the machine asks (after a drain)."""

    options = {"enable_events": True, "hash_mode": "sha256"}

    def _check_hit(self, prompt, hit):
        super()._check_hit(prompt, hit)
        if not hasattr(self, "mirror"):
            self.mirror = Mirror(self.m)
        self.mirror.drain()
        assert self.mirror.predict(prompt, self.L) == hit, (prompt, hit)


class LookaheadEventsMachine(EventsMirrorRules, LookaheadMachine):
    pass


class EvictingLookaheadEventsMachine(EventsMirrorRules, EvictingLookaheadMachine):
    options = {"enable_events": True, "hash_mode": "sha256", "max_events": 2}


TestLookaheadEventsMachine = case(LookaheadEventsMachine, max_examples=40, stateful_step_count=40)
TestEvictingLookaheadEventsMachine = case(EvictingLookaheadEventsMachine, max_examples=40,
                                          stateful_step_count=40)


def test_events_carry_the_lookahead_tokens_and_name_blocks_as_block_hashes():
    """bs 4, L 2; an image over tokens 9..10 starts in block 1's lookahead window: it
    enters block 1's hash and extra keys (as vLLM's), and block 2's."""
    extra = ExtraKeys(lora="ad", mm=(MultiModalInput("img", 9, 2),))
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=2, enable_events=True,
                                hash_mode="sha256")
    tokens = list(range(14))
    m.add_request("a", tokens, extra=extra, num_new_tokens=12)
    (ev,) = m.take_events()
    assert isinstance(ev, LookaheadBlockStored)
    assert ev.token_ids == tokens[:12] and ev.lookahead == 2
    assert ev.lookahead_token_ids == [[4, 5], [8, 9], [12, 13]]
    assert [ev.block_extra(i).mm for i in range(3)] == [(), extra.mm, extra.mm]
    assert list(ev.block_hashes) == block_hashes(tokens, 4, extra=extra, hash_lookahead_tokens=2)
    assert rebuilt(ev) == list(ev.block_hashes)
    one = ev.block(1, ev.block_ids[1], "CPU")
    assert isinstance(one, LookaheadBlockStored) and one.lookahead_token_ids == [[8, 9]]
    assert (one.parent_block_hash, one.block_hashes) == (ev.block_hashes[0], (ev.block_hashes[1],))
    assert rebuilt(one) == [ev.block_hashes[1]]


def test_an_image_after_a_block_enters_its_key():
    """vLLM's lookahead hash of a block covers the multimodal inputs in the L tokens
    after it: another image there, same token ids, finds block 0 only (prefixkv found
    block 1 too: drafter KV computed from another image)."""
    m = LookaheadKVCacheManager(64, 4, hash_lookahead_tokens=1)
    tokens = list(range(12))
    m.add_request("a", tokens, extra=ExtraKeys(mm=(MultiModalInput("x", 8, 2),)), num_new_tokens=8)
    assert m.lookup(tokens, extra=ExtraKeys(mm=(MultiModalInput("x", 8, 2),))) == 8
    assert m.lookup(tokens, extra=ExtraKeys(mm=(MultiModalInput("y", 8, 2),))) == 4


def test_block_hashes_refuses_a_bad_lookahead():
    for bad in (-1, 1.0, True):
        with pytest.raises(ConfigError, match="hash_lookahead_tokens"):
            block_hashes([1, 2, 3], 2, hash_lookahead_tokens=bad)
    assert block_hashes([1, 2, 3], 2, hash_lookahead_tokens=2) == []
    assert len(block_hashes([1, 2, 3, 4], 2, hash_lookahead_tokens=2)) == 1
