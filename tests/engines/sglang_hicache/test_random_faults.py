"""Random runs of two SGLang 0.5.23 ranks (SGLang's own HybridCacheController, host
pools and storage threads, controller.py) sharing one real Redis that misbehaves: both
back up and prefetch prefixes of two prompts for two tenants, under SGLang's three
prefetch policies, while stored values are corrupted, swapped between keys, replaced by
another Redis type or deleted, and the server restarts empty. Each (prompt, tenant) has
KV of its own (written from its own seed), so a page of another prompt, another page or
another tenant shows. Every page SGLang takes as loaded must equal the page written for
it, and no exception may reach SGLang's threads."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixkv.store.server import LocalRedis

from ..spoil import spoil_one
from .controller import Engine, closing  # noqa: F401
from .test_controller import no_errors_in_sglang_threads, s, same, tokens  # noqa: F401

PAGE, PAGES = 4, 10
_TENANTS = (None, "t1")

_how, _pick = st.sampled_from(["flip", "swap", "list", "delete"]), st.integers(0, 1 << 16)
_spoil = st.tuples(_how, _pick)
_ops = st.one_of(
    st.tuples(st.just("backup"), st.integers(0, 1), st.integers(0, 1), st.integers(1, PAGES),
              st.integers(0, 1)),
    st.tuples(st.just("prefetch"), st.integers(0, 1), st.integers(0, 1), st.integers(1, PAGES),
              st.integers(0, 1), st.sampled_from(["wait_complete", "best_effort", "timeout"])),
    st.tuples(st.just("pair"), st.integers(0, 1), st.integers(0, 1), st.integers(1, PAGES),
              st.integers(1, PAGES), st.integers(0, 1),
              st.sampled_from(["wait_complete", "best_effort", "timeout"]),
              st.one_of(st.none(), _spoil)),
    st.tuples(st.just("spoil"), _how, _pick),
    st.tuples(st.just("restart")),
)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(_ops, min_size=3, max_size=25))
def test_random_faults_never_load_a_page_not_written_for_it(s, ops, caplog):  # noqa: F811
    prompts = [tokens(PAGES * PAGE, 30000 + 1000 * b) for b in range(2)]
    seeds = {(b, t): 100 + 10 * b + t for b in range(2) for t in range(2)}
    with LocalRedis() as server:
        try:
            ranks = [Engine(s, server.url, page=PAGE, tokens=PAGES * PAGE * 2, timeout=1.0)
                     for _ in range(2)]
            # each (prompt, tenant)'s pages, as a backup of it all writes them (a page's
            # bytes depend on its place and the seed only, so a prefix writes a prefix)
            dead = Engine(s, "unix:///nonexistent/redis.sock", page=PAGE,
                          tokens=PAGES * PAGE * 2, timeout=1.0)
            pages = {key: dead.backup(prompts[key[0]], seed, _TENANTS[key[1]])[1]
                     for key, seed in seeds.items()}
            dead.close()
            client = ranks[0].backend.backend.client
            loaded_pages = 0
            for op in ops:
                if op[0] == "backup":
                    _, rank, b, n, t = op
                    ranks[rank].backup(prompts[b][:n * PAGE], seeds[b, t], _TENANTS[t])
                elif op[0] == "prefetch":
                    _, rank, b, n, t, policy = op
                    done, loaded = ranks[rank].prefetch(prompts[b][:n * PAGE], policy,
                                                        _TENANTS[t], timeout=0.05)
                    assert done == len(loaded) * PAGE and same(pages[b, t], loaded), op
                    loaded_pages += len(loaded)
                elif op[0] == "pair":  # one rank backs up, the store may misbehave,
                    _, rank, b, n, m, t, policy, spoil = op  # the other rank prefetches
                    ranks[rank].backup(prompts[b][:n * PAGE], seeds[b, t], _TENANTS[t])
                    if spoil is not None:
                        spoil_one(client, *spoil)
                    done, loaded = ranks[1 - rank].prefetch(prompts[b][:m * PAGE], policy,
                                                            _TENANTS[t], timeout=0.05)
                    assert done == len(loaded) * PAGE and same(pages[b, t], loaded), op
                    loaded_pages += len(loaded)
                elif op[0] == "spoil":
                    spoil_one(client, op[1], op[2])
                else:
                    server.stop()
                    server.start()
            no_errors_in_sglang_threads(caplog)
        finally:
            while Engine.live:
                Engine.live[-1].close()
