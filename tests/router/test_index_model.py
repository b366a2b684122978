"""Both index backends against a plain model under random operations (Hypothesis)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.router import InProcessIndex

REPLICAS = ("a", "b", "c")
MEDIA = ("GPU", "CPU")
ops = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]),
                         st.sampled_from(REPLICAS), st.sampled_from(MEDIA),
                         st.lists(st.integers(0, 7), max_size=5)), max_size=30)
prompts = st.lists(st.integers(0, 7), min_size=1, max_size=8)


def model_runs(held: set, hashes: list) -> dict:
    out = {}
    for r in REPLICAS:
        run = sum(1 for _ in itertools.takewhile(
            lambda h, r=r: any((r, h, m) in held for m in MEDIA), hashes))
        gpu = sum(1 for _ in itertools.takewhile(lambda h, r=r: (r, h, "GPU") in held, hashes))
        if run:
            out[r] = (run, gpu)
    return out


def run_case(index, operations, prompt):
    held = set()
    for op, r, m, hs in operations:
        if op == "store":
            index.store(r, hs, m)
            held |= {(r, h, m) for h in hs}
        elif op == "remove":
            index.remove(r, hs, m)
            held -= {(r, h, m) for h in hs}
        else:
            index.clear(r)
            held = {x for x in held if x[0] != r}
    assert index.prefix_runs(prompt, REPLICAS) == model_runs(held, prompt)
    for r in REPLICAS:
        assert index.num_blocks(r) == sum(1 for x in held if x[0] == r)


@settings(max_examples=200, deadline=None)
@given(ops, prompts)
def test_in_process_index_matches_the_model(operations, prompt):
    run_case(InProcessIndex(), operations, prompt)


_namespaces = itertools.count()


@settings(max_examples=40, deadline=None)
@given(ops, prompts)
def test_redis_index_matches_the_model(redis_server, operations, prompt):
    redis_index = pytest.importorskip("prefixkv.router.redis_index")
    run_case(redis_index.RedisIndex(redis_server, f"model{next(_namespaces)}"), operations, prompt)
