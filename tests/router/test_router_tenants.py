"""Multi-tenant routing: what one tenant can learn of another's cache through the
router (docs/security.md, "The router"). Replicas are real managers whose events reach
the router over the wire (``encode_batch`` -> ``decode_batch`` -> ``apply``); tenants
are told apart by ``cache_salt``.

The promise checked: with salts, a tenant's routing decisions and ``cached_tokens`` are
the same whether or not another tenant cached the very same tokens anywhere in the
fleet; with equal salts (the control) they are not: the test can see sharing. Load is
another matter (the other tenant's requests in flight change where one's requests go:
its traffic volume, as the shared pool's evictions show it; docs/security.md)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager
from prefixkv.fleet.wire import encode_batch
from prefixkv.router import ApproxIndex, Router, decode_batch

BS = 4
NAMES = ["r0", "r1", "r2"]

prompts = st.lists(st.lists(st.integers(1, 6), min_size=BS, max_size=4 * BS), min_size=1,
                   max_size=6)


def fed_router(cached, salt, **kw):
    """A router whose replicas' managers cached ``cached`` ((replica, tokens) pairs) under
    ``salt`` (None: nothing cached), told by their events over the wire."""
    router = Router(NAMES, block_size=BS, **kw)
    for i, (replica, tokens) in enumerate(cached if salt is not None else []):
        mgr = KVCacheManager(64, BS, hash_mode="sha256", enable_events=True)
        mgr.add_request(str(i), tokens, extra=ExtraKeys(cache_salt=salt))
        router.apply(replica, decode_batch(encode_batch(mgr.take_events(), block_size=BS))[1])
    return router


def decisions(router, asked, salt):
    """``route`` and ``cached_tokens`` for each prompt ``asked`` under ``salt``."""
    out = []
    for tokens in asked:
        extra = ExtraKeys(cache_salt=salt)
        out.append((router.route(tokens, extra), router.cached_tokens(tokens, extra)))
    return out


@settings(max_examples=40, deadline=None)
@given(prompts, st.lists(st.sampled_from(NAMES), min_size=6, max_size=6), st.data())
def test_another_salts_cache_changes_no_decision(victim, where, data):
    cached = list(zip(where, victim, strict=False))
    # the attacker asks the victim's very prompts (and their prefixes), salt "b"
    asked = data.draw(st.lists(st.sampled_from(victim), min_size=1, max_size=6))
    asked += [p[:BS] for p in victim]
    seen = decisions(fed_router(cached, "a"), asked, "b")
    assert seen == decisions(fed_router(cached, None), asked, "b")
    assert all(c.cached_tokens == 0 and not any(runs.values()) for c, runs in seen)
    # the control: the victim's own salt does see what it cached (sharing is visible)
    own = decisions(fed_router(cached, "a"), victim, "a")
    assert all(runs[r] >= len(p) // BS * BS for (_, runs), p, r in zip(own, victim, where,
                                                                          strict=False))


def test_an_unsalted_request_does_not_match_a_salted_tenants_blocks():
    cached = [("r1", list(range(1, 13)))]
    seen = decisions(fed_router(cached, "a"), [list(range(1, 13))], None)
    assert seen == decisions(fed_router(cached, None), [list(range(1, 13))], None)


def test_an_approx_index_learns_no_other_salts_routes():
    # an engine without events: the router guesses from its own decisions, by the
    # salted hashes it routed, so tenant "a"'s routes teach nothing for tenant "b"
    tokens = list(range(1, 17))
    router = Router(NAMES, block_size=BS, index=ApproxIndex(1e9), load_weight=0.0)
    first = router.route(tokens, ExtraKeys(cache_salt="a"))
    router.finish(first.replica)
    assert router.route(tokens, ExtraKeys(cache_salt="a")) == first.__class__(
        first.replica, 16, False)  # its own salt: the guess is used
    assert router.cached_tokens(tokens, ExtraKeys(cache_salt="b")) == dict.fromkeys(NAMES, 0)
