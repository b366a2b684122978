"""``ContentIndex.claim`` tries the first block the last claim found before probing for a
prompt's first block (the index's root's ``child``, a guess verified as any): prompts
that open alike (a shared system prompt, a chat's turns) find it without hashing their
first chunk. A stale guess (the block emptied, refilled, a spare) falls back to the
probe and finds exactly what the dicts hold."""

from __future__ import annotations

from typing import Any

from prefixkv import KVCacheManager


class _Probes(dict[Any, Any]):
    """A dict that counts ``get`` calls (``claim`` calls ``by_chunk.get`` as a method)."""

    gets = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.gets += 1
        return super().get(key, default)


def _claim(m: KVCacheManager, tokens: list[int]) -> tuple[list[int], int]:
    """The block ids a claim of ``tokens`` finds and the dict probes it made (the claim's
    references dropped again)."""
    idx, pool = m._index, m._pool
    probes = _Probes(idx._by_chunk)
    idx._by_chunk = probes
    p = m.prepare(tokens)
    try:
        got = idx.claim(p.chunks, p.keys.base, None, p.data)
        assert got is not None
        hits, unlinked = got
        pool.claimed(unlinked)
        pool.unclaim(hits, unlinked)
    finally:
        idx._by_chunk = dict(probes)
    return [b.block_id for b in hits], probes.gets


def test_a_prompt_opening_as_the_last_found_probes_no_dict() -> None:
    m = KVCacheManager(64, 4, seed=0)
    system = list(range(1, 9))  # two blocks
    m.add_request("a", system + list(range(100, 113)))
    m.free("a")
    first, gets = _claim(m, system + [50] * 9)  # no claim found a block yet: the probe
    assert len(first) == 2 and gets == 2  # (and the miss after the run's agreeing part)
    again, gets = _claim(m, system + [60] * 9)
    assert again == first and gets == 1  # the first block guessed: the miss's probe alone
    m.check_invariants()


def test_a_stale_guess_falls_back_to_the_probe() -> None:
    m = KVCacheManager(16, 4, seed=0)
    a = list(range(1, 13))
    m.add_request("a", a)
    m.free("a")
    assert len(_claim(m, a)[0]) == 3  # the guess: "a"'s first block
    assert m.reset_prefix_cache()  # its content gone (the guess's key cleared)
    b = list(range(200, 212))
    m.add_request("b", b)  # b's first block may reuse that block, with other content
    m.free("b")
    assert _claim(m, a) == ([], 1)  # nothing of "a" is cached: a probe, no hit
    hits, _ = _claim(m, b)
    assert len(hits) == 3 and m.add_request("c", b).num_cached_tokens == 8  # type: ignore[union-attr]
    m.check_invariants()
