"""``Chunks`` reads as the list of chunks ``block_chunks`` cuts: items, slices, iteration
and the joined bytes, for counts around the 64-chunk groups it cuts in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import prefixkv.core.prompt as prompt
import test_state_machine
from prefixkv import KVCacheManager
from prefixkv.chunks import Chunks, joined
from prefixkv.core.prompt import CUT_LATE, encode_prompt
from prefixkv.hashing import block_chunks


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 16), st.integers(0, 200), st.data())
def test_chunks_read_as_the_cut_list(step: int, count: int, data: st.DataObject) -> None:
    buf = bytes(range(256)) * (step * count // 256 + 1)
    buf = buf[:step * count + data.draw(st.integers(0, step - 1))]  # (a partial tail)
    want = block_chunks(buf, step, count)
    got = Chunks(buf, step, 0, count)
    assert len(got) == count and list(got) == want and got == want
    assert joined(got) == b"".join(want)
    lo, hi = data.draw(st.integers(-count - 2, count + 2)), data.draw(st.integers(-count - 2, count + 2))
    part = got[lo:hi]
    assert isinstance(part, Chunks) and list(part) == want[lo:hi] and len(part) == len(want[lo:hi])
    assert part.data() == b"".join(want[lo:hi]) == joined(part)
    assert list(part[1:]) == want[lo:hi][1:]  # (a slice of a slice)
    assert list(got[lo:hi:2]) == want[lo:hi:2]
    for i in (0, count - 1, -1, -count, data.draw(st.integers(0, max(count - 1, 0)))):
        if count:
            assert got[i] == want[i]
    with pytest.raises(IndexError):
        got[count]
    with pytest.raises(IndexError):
        got[-count - 1]


def test_whole_buffer_is_not_copied() -> None:
    buf = bytes(64 * 130)
    assert Chunks(buf, 64, 0, 130).data() is buf
    assert joined([b"ab", b"cd"]) == b"abcd"


@pytest.mark.parametrize("full", [CUT_LATE - 1, CUT_LATE, CUT_LATE + 70])
def test_encoded_prompt_chunks_and_a_miss_run(full: int) -> None:
    ids = list(range(1000, 1000 + 16 * full + 5))
    tokens, _, chunks = encode_prompt(ids, None, 16, None)
    assert type(chunks) is (list if full < CUT_LATE else Chunks) and len(chunks) == full
    assert list(chunks) == block_chunks(tokens.tobytes(), 64, full)
    if isinstance(chunks, Chunks):
        assert chunks.buf == tokens.tobytes()
    m = KVCacheManager(full + 100, 16)
    m.add_request("a", ids)  # a miss, stored as a run from the chunks' bytes
    m.free("a")
    assert m.lookup(ids) == full * 16  # all full blocks (the last token is past them)
    cut = ids[:16 * (full // 2)] + [7] * 40  # a hit that cuts the run
    assert m.lookup(cut) == 16 * (full // 2)
    m.add_request("b", cut)
    m.free("b")
    assert m.lookup(ids) == full * 16 and m.lookup(cut) == 16 * (full // 2 + 2)
    m.check_invariants()


@pytest.mark.parametrize("machine", ["ManagerMachine", "DeferredEventsManagerMachine",
                                     "HostTierManagerMachine", "BlockSizeOneManagerMachine"])
def test_state_machines_with_every_prompt_cut_late(machine: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager machines' prompts are short (below ``CUT_LATE``): run some of them with
    every prompt's chunks a ``Chunks``, events and a host tier included."""
    monkeypatch.setattr(prompt, "CUT_LATE", 1)
    run_state_machine_as_test(getattr(test_state_machine, machine),
                              settings=settings(max_examples=25, stateful_step_count=40,
                                                deadline=None))
