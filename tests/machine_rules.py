"""What the manager state machines share: ``ManagerMachine`` (test_state_machine, and the
late-plan, tenant and options machines on it) and ``HybridMachine``
(test_groups_state_machine, and the Mamba machine on it).

``SharedRules`` holds the rules that read the same in both (request ids, ``free``,
``reset``, the ``check_invariants`` invariant) over the one ``live`` bundle; a machine
overrides one by defining a rule of the same name. Hypothesis orders a machine's rules by
name, wherever they are defined, so a rule moved here draws and runs as before. Also: the
prompts both draw (a cut of a known prefix, then a tail), the chain hashes a mirror of the
events is asked about, and a machine's test case under its settings.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, consumes, invariant, rule

from prefixkv.hashing import chain, encode_tokens, token_bytes

LIVE = Bundle("live")


def prompts_over(prefixes, max_token, max_tail):
    """Non-empty prompts: the first 0 to all tokens of one of ``prefixes``, then up to
    ``max_tail`` tokens of 0..``max_token``."""
    return st.builds(
        lambda pre, cut, tail: prefixes[pre][:cut] + tail,
        st.integers(0, len(prefixes) - 1), st.integers(0, max(map(len, prefixes))),
        st.lists(st.integers(0, max_token), max_size=max_tail),
    ).filter(bool)


def hit_hashes(hash_fn, root, prompt, extra, bs):
    """The chain hashes of the blocks of ``prompt`` (with ``extra``, an ExtraKeys or None)
    a hit may take: its full blocks but the one holding its last token."""
    n = (len(prompt) - 1) // bs
    base = extra.base_bytes() if extra else b""
    hashes, _ = chain(hash_fn, root, token_bytes(encode_tokens(prompt[:n * bs])), [base] * n)
    return hashes


def case(machine, **kw):
    """``machine``'s test case, run under ``settings(deadline=None, **kw)``."""
    test = machine.TestCase
    test.settings = settings(deadline=None, **kw)
    return test


class SharedRules:
    """Rules of a machine holding a manager ``m`` and its model of live requests,
    ``tokens`` by request id (``_forget`` drops one from the model), ``last`` (the step
    just scheduled, or None) and ``next_id`` (0 at setup)."""

    live = LIVE

    def _new_id(self):
        self.next_id += 1
        return f"r{self.next_id}"

    def _own_step(self):
        """Called first by a rule that takes the plan itself (a step of its own): the
        late-plan machine ends the step under way first."""

    @rule(rid=consumes(LIVE))
    def free(self, rid):
        self.last = None
        if rid in self.tokens:
            self.m.free(rid)
            self._forget(rid)

    @rule()
    def reset(self):
        self._own_step()
        self.last = None
        order = self.m.free_block_order()
        assert self.m.reset_prefix_cache() == (not self.tokens)
        if not self.tokens:  # (the free order kept, as vLLM's reset keeps its free queue)
            assert self.m.num_cached_blocks == 0 and self.m.free_block_order() == order

    @invariant()
    def consistent(self):
        self.m.check_invariants()
