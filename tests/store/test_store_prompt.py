"""A store re-admission (``StoreWait``, then ``add_request`` again) given the Prompt it
started from skips encoding and comparing the prompt (``StoreWaits.reuse``, by
identity); an equal Prompt is compared as before, the start's own list of token ids
with a copy taken then (not encoded), other ids encoded. A real Redis (conftest),
block_size 4."""

import pytest

from prefixkv import ExtraKeys, KVCacheManager, PromptError, StoreWait, TokenError
from prefixkv.core import store_reuse

from .test_readmit_reuse import BS, P, landed, manager, readmit_as_walk, stored, taken  # noqa: F401

SALT = ExtraKeys(cache_salt="s")


@pytest.fixture
def encoded(monkeypatch):
    """The prompts ``reuse`` encoded to compare them with the start's."""
    calls = []
    original = store_reuse.encode_tokens

    def spy(ids, *args):
        calls.append(list(ids))
        return original(ids, *args)

    monkeypatch.setattr(store_reuse, "encode_tokens", spy)
    return calls


@pytest.mark.parametrize("extra", [None, SALT])
@pytest.mark.parametrize("again", ["same", "equal", "ids"])
def test_a_readmission_with_the_same_prompt_compares_nothing(
        backend, shared, encoded, taken, extra, again):  # noqa: F811 (the fixture ``taken``)
    stored(shared, backend, P, extra)
    m = manager(shared)
    p = m.prepare(P, extra=extra)
    assert p.block_hashes is not None  # a store hashes blocks as they are stored
    landed(m, "r", p)
    given = {"same": p, "equal": m.prepare(P, extra=extra), "ids": P}[again]
    hits, adm = readmit_as_walk(m, "r", given, None if again != "ids" else extra)
    assert adm.num_cached_tokens == (len(P) - 1) // BS * BS
    assert taken == [True]  # (the landed run handed over, not walked again)
    assert encoded == ([P] if again == "ids" else [])  # (the start had no list to compare with)
    m.add_request("s", p)  # the same Prompt again, as another request: its own tokens
    m.append_tokens("r", [7])
    assert m.num_tokens("s") == len(P) and m.num_tokens("r") == len(P) + 1
    m.check_invariants()


def test_a_different_prompt_at_readmission_is_not_the_started_one(backend, shared):
    """The re-admission of a waiting request with another prompt walks the index (the
    fetch's run is for the started prompt); another configuration's Prompt is refused."""
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", m.prepare(P))
    other = P[:8] + [0] * 13
    hits, adm = readmit_as_walk(m, "r", m.prepare(other))
    assert adm.num_cached_tokens == 8
    foreign = KVCacheManager(8, BS, hash_mode="sha256", seed=9).prepare(P)
    with pytest.raises(PromptError):
        m.add_request("x", foreign)
    m.check_invariants()


@pytest.mark.parametrize(("started", "again"),
                         [(None, SALT), (SALT, None), (SALT, ExtraKeys(cache_salt="t"))])
def test_a_prompt_of_the_same_tokens_with_other_extra_keys_is_walked(backend, shared, started, again):
    """A re-admission with a Prompt of the started tokens but other extra keys (another
    salt, or none) is not the started one: the landed run is another content's, and the
    walk finds nothing of it (mutation pass: ``reuse`` comparing the keys by ``is`` or
    ``==`` the wrong way round handed the landed run over)."""
    stored(shared, backend, P, started)
    m = manager(shared)
    landed(m, "r", m.prepare(P, extra=started))
    hits, adm = readmit_as_walk(m, "r", m.prepare(P, extra=again))
    assert hits == [] and adm.num_cached_tokens == 0
    m.check_invariants()


def test_a_prompt_waits_like_its_token_ids(backend, shared):
    stored(shared, backend, P)
    m = manager(shared)
    assert isinstance(m.add_request("r", m.prepare(P)), StoreWait)


@pytest.mark.parametrize("given", ["same", "copy", "tuple", "changed", "floats"])
def test_token_ids_at_readmission_are_compared_with_the_start_s_list(backend, shared, encoded, given):
    """The start keeps the list of ids it was given and a copy: the same list at the
    re-admission is compared with the copy (a change the caller made to its list in
    between is seen), anything else is encoded; whichever way, the admission is what the
    walk finds, and ids the walk refuses are refused."""
    stored(shared, backend, P)
    m = manager(shared)
    ids = P[:]
    landed(m, "r", ids)
    if given == "changed":
        ids[9] += 1  # (in place: the list the start was given)
    again = {"same": ids, "copy": P[:], "tuple": tuple(P), "changed": ids,
             "floats": [float(t) for t in P]}[given]
    if given == "floats":
        with pytest.raises(TokenError):
            m.add_request("r", again)
        assert encoded == [again]
        return
    hits, adm = readmit_as_walk(m, "r", again)
    assert adm.num_cached_tokens == (8 if given == "changed" else 20)
    assert encoded == ([] if given in ("same", "changed") else [list(again)])  # (changed: walked)
    assert list(m._requests["r"].tokens) == ids
    m.check_invariants()


@pytest.mark.parametrize("started", ["tuple", "prepared"])
def test_no_ids_at_readmission_are_refused_after_a_start_without_a_list(backend, shared, started):
    """A start given no list keeps none: a re-admission given None (no list either) is
    encoded, and refused, as without a wait; the wait's run stays for the right call."""
    stored(shared, backend, P)
    m = manager(shared)
    landed(m, "r", tuple(P) if started == "tuple" else m.prepare(P))
    with pytest.raises(TokenError):
        m.add_request("r", None)
    m.check_invariants()
    hits, adm = readmit_as_walk(m, "r", P)
    assert adm.num_cached_tokens == 20
