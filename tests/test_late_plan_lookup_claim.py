"""A late-plan step where ``lookup`` finds more than the admission after it claims
(found by fuzz-r17: SmallLatePlanManagerMachine, seed 103, 4x CI examples x 120 steps;
reproduced on main d2cf51e; replayed here step by step, all draws 0).

Blocks of 2 tokens, a pool of 8. In one step, ``x`` admits PREFIXES[0] + [0] (a hit of
one block, its other full blocks recorded in the step); then ``lookup`` of the same
prompt finds 8 tokens through x's blocks (0, 1, 3, 5), but block 3 has no key (a
pending run's block, ``index/pending.py``) and the next admission claims only 4 tokens
(blocks 0, 1). ``lookup`` and ``add_request`` must agree (the machine's ``_admit``).

Block 0 heads a settled run whose one block is block 1, and block 1 heads the pending
run of blocks 3, 5. ``walk_pending`` (lookup) reaches block 1 one block at a time and
follows its run; ``ContentIndex.claim`` took block 1 as the tail of block 0's run and
went on with the next chunk through block 1's child, never reading block 1's
``starts``: block 3 has no key yet, so the claim ended there. Now ``claim`` reads the
``starts`` of the last block of each run it takes (``index/content.py``)."""

from test_state_machine_late_plan import SmallLatePlanManagerMachine


class _Zero:
    def draw(self, strategy):
        return 0


def _first(x):
    values = getattr(x, "values", None)
    return (values[0] if values else None) if values is not None else x


def test_an_admission_in_the_step_claims_what_lookup_found():
    st = SmallLatePlanManagerMachine()
    st.setup()

    def checked(x=None):
        st.consistent()
        st.blocks_hold_each_requests_tokens()
        st.events_predict_lookup()
        st.every_live_full_block_is_findable()
        return _first(x)

    checked(st.a_hit_goes_in_its_step(how="free", pre=0, prompt=[0], tail=0))
    checked(st.abort_before_step_ran())
    r1 = checked(st.add(chunk=5, extra=None, prompt=[1, 2, 3, 4, 5, 0, 0, 11]))
    r2 = checked(st.a_load_fails_and_is_recomputed(bad=0, extra=None, ok=0, prompt=[0, 0, 0, 11]))
    checked(st.step(data=_Zero()))
    checked(st.step(data=_Zero()))
    checked(st.a_hit_goes_in_its_step(how="free", pre=0, prompt=[0], tail=0))
    checked(st.fork_chain(depth=1, gone={0, 1}, parent=r1, prompt=None, toks=[]))
    checked(st.append(rid=r2, toks=[0]))
    checked(st.fork_chain(depth=3, gone={0, 1, 2, 3}, parent=r2, prompt=None, toks=[0, 0, 0, 0]))
    assert not st.tokens and not st.dirty
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    x = st.m.add_request("x", prompt)
    assert (x.block_ids, x.num_cached_tokens) == ((0, 1, 3, 5, 4), 2)
    assert st.m.lookup_block_ids(prompt) == (0, 1, 3, 5)
    assert st.m._pool.blocks[3].key is None  # (a pending run's block: keyed later)
    y = st.m.add_request("y", prompt)
    assert y.num_cached_tokens == 8, y  # (what lookup found before it; it claimed 4)
