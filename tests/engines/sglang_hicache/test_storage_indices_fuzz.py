"""Host indices from SGLang's side, at random (Hypothesis), against a predicate written
apart from the backend's checks: batch_get_v1 either refuses them with ConfigError and
leaves the host pool as it was, or they are whole pages inside the pool, each named
once, and exactly the stored pages land there, each at its own place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from prefixkv.errors import ConfigError

from .engine import HostPool
from .test_storage import PAGE, fill, page_hashes, redis, replica, sgl, tokens  # noqa: F401

POOL = 8 * PAGE  # tokens in the readers' host pools


def valid(indices: list[int], pages: int) -> bool:
    """Whole pages inside a pool of POOL tokens, each named once."""
    if len(indices) != pages * PAGE:
        return False
    starts = indices[::PAGE]
    return (len(set(starts)) == len(starts) and all(
        s % PAGE == 0 and 0 <= s <= POOL - PAGE
        and indices[i * PAGE:(i + 1) * PAGE] == list(range(s, s + PAGE))
        for i, s in enumerate(starts)))


@pytest.fixture(scope="module")
def stored(sgl, redis):  # noqa: F811
    """Three pages written (of four keys: the last is not stored)."""
    writer, pool = replica(sgl, redis.url)
    fill(pool, 70)
    keys = page_hashes(sgl, tokens(4 * PAGE, 4500), PAGE)
    assert writer.batch_set_v1(keys[:3], torch.arange(3 * PAGE)) == [True] * 3
    return keys, [pool.get_data_page(i * PAGE).clone() for i in range(3)]


def host_indices(pages: int) -> st.SearchStrategy[list[int]]:
    """Indices for ``pages`` pages: distinct whole pages, each sometimes spoilt (named
    twice, starting anywhere, one index moved), or one index too few or too many."""
    spoil = st.sampled_from(["keep"] * 12 + ["twice", "anywhere", "moved"])

    def build(starts: list[int], how: list[str], at: list[int], to: list[int], trim: int) -> list[int]:
        out: list[int] = []
        for i, (s, h) in enumerate(zip(starts, how, strict=True)):
            page = list(range(s, s + PAGE))
            if h == "twice" and i:
                page = out[-PAGE:]
            elif h == "anywhere":
                page = list(range(to[i] % (POOL + 2 * PAGE) - PAGE, to[i] % (POOL + 2 * PAGE)))
            elif h == "moved":
                page[at[i] % PAGE] = to[i]
            out += page
        return out[:-1] if trim == 1 else out + [0] * (trim == -1)

    n = st.just(pages)
    return st.builds(build, st.permutations(range(0, POOL, PAGE)).map(lambda p: p[:pages]),
                     n.flatmap(lambda k: st.lists(spoil, min_size=k, max_size=k)),
                     n.flatmap(lambda k: st.lists(st.integers(0, PAGE), min_size=k, max_size=k)),
                     n.flatmap(lambda k: st.lists(st.integers(-POOL, 2 * POOL), min_size=k,
                                                  max_size=k)),
                     st.sampled_from([0] * 8 + [1, -1]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), pages=st.integers(0, 4))
def test_random_host_indices_are_refused_or_read_exactly_where_named(sgl, redis, stored,  # noqa: F811
                                                                     data, pages):
    keys, written = stored
    indices = data.draw(host_indices(pages))
    reader, pool = replica(sgl, redis.url, pool=HostPool(POOL, PAGE))
    pool.kv_buffer.fill_(-1.0)
    before = pool.kv_buffer.clone()
    try:
        got = reader.batch_get_v1(keys[:pages], torch.tensor(indices, dtype=torch.int64))
    except ConfigError:
        event("refused")
        assert not valid(indices, pages), indices
        assert torch.equal(pool.kv_buffer, before) and reader.pages.hits == 0
        return
    event(f"read {pages} pages")
    assert valid(indices, pages), indices
    assert got == [i < 3 for i in range(pages)]
    expected = before.clone()
    for i in range(min(pages, 3)):
        s = indices[i * PAGE]
        expected[:, :, s:s + PAGE] = written[i].reshape(2, 2, PAGE, 2, 8)
    assert torch.equal(pool.kv_buffer, expected)
