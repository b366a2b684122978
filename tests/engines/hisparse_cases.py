"""The cases of the HiSparse reference (hisparse_model.py): named scenarios, each with the
events it must see, and the random streams' strategies; shared by the tests that run
them (test_vllm_hisparse_reference.py against vLLM, test_hisparse_row.py and
test_hisparse_state.py against the model)."""

from __future__ import annotations

from hypothesis import strategies as st

from .hisparse_model import BS, MAX_LEN

ALL = 2**16 - 1
# (pool, host pool, hot blocks, max_in_flight_tokens, prompt), ops, what must happen
SCENARIOS = {
    "others-take-unpinned-pages": ((16, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", ALL), ("take", 12), ("give_back", 0),
        ("step", 32), ("confirm", ALL)], {"asked for hot", "unpinned", "lost"}),
    "own-growth-takes-unpinned-pages": ((12, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", ALL), ("step", 32), ("confirm", ALL)],
        {"unpinned", "lost"}),
    # pages clean before the hot region are unpinned at once when it comes, tail first:
    # the pool hands out page 2's block first
    "unpins-tail-first": ((24, 12, 1, 64, 128), [
        ("step", 48), ("confirm", ALL), ("step", 16), ("step", 16), ("take", 13)], {"unpinned", "lost"}),
    # the pool's free count at the watermark (3 of 32) asks for nothing; below it, it asks
    "pool-at-watermark": ((32, 12, 1, MAX_LEN, 128), [
        ("step", 96), ("take", 14), ("step", 16), ("step", 16)], {"asked for hot"}),
    # freed with a page in flight (its blocks wait for the copy), one unpinned (stays in
    # the pool, no one's), clean ones (unpinned now) and dirty ones; then a new request
    "free-mid-flight": ((16, 12, 1, 16, 96), [
        ("step", 16), ("step", 16), ("step", 32), ("confirm", 0b0111), ("step", 16), ("confirm", 0b10),
        ("free", 0), ("step", 48), ("confirm", ALL), ("take", 12), ("step", 16), ("confirm", ALL)],
        {"unpinned", "freed in flight"}),
    "host-pool-full": ((32, 3, 1, MAX_LEN, 64), [("step", 48), ("step", 32), ("step", 16)], {"host full"}),
    "pool-below-watermark": ((12, 12, 2, MAX_LEN, 96), [
        ("step", 64), ("step", 16), ("confirm", 5), ("step", 16), ("take", 1), ("give_back", 0),
        ("step", 16), ("confirm", ALL)], {"asked for hot", "gpu full"}),
    # two workers: a copy is confirmed by the second completion only, freed in between
    "two-workers": ((16, 12, 1, 16, 96), [
        ("step", 48), ("halve", ALL), ("step", 16), ("halve", 0b101), ("free", 0), ("confirm", ALL),
        ("step", 48), ("halve", 0b11), ("confirm", 0b1)], {"waits for a worker", "freed in flight"}),
    # vLLM's test_hisparse_resident_request_can_grow_without_hot_capacity: 3 free blocks
    # fit the next indexer and row pages, and no hot region is asked for
    "grows-without-hot-capacity": ((8, 16, 2, MAX_LEN, 48), [("step", 32), ("step", 1)], set()),
}

STEP = st.tuples(st.just("step"), st.integers(1, 40))
CONFIRM = st.tuples(st.just("confirm"), st.integers(0, ALL))
HALVE = st.tuples(st.just("halve"), st.integers(0, ALL))
OPS = st.lists(st.one_of(STEP, CONFIRM, STEP, CONFIRM, HALVE, st.tuples(st.just("take"), st.integers(1, 12)),
                         st.tuples(st.just("give_back"), st.just(0)), st.tuples(st.just("free"), st.just(0))),
               min_size=4, max_size=40)
# the arguments of a random stream (``run`` in the tests that use them)
STREAMS = {"num_blocks": st.integers(10, 32), "host_blocks": st.integers(4, 12),
           "hot_blocks": st.integers(1, 3), "in_flight": st.sampled_from([16, 32, 64, MAX_LEN]),
           "prompt": st.integers(40, MAX_LEN), "ops": OPS}


# (pool, host pool, hot blocks, max_in_flight_tokens, prompt, num_prefill_lookahead,
# fit_mask), ops, what must happen
GATED = {
    # vLLM's test_can_fit_full_sequence_hisparse_caps_resident_pages: the row counts the
    # window's pages, not the request's; then a pool too small for even those
    "capped-at-the-window": ((11, 9, 2, 2 * BS, 8 * BS, 0, ALL), [
        ("step", BS), ("step", 3 * BS), ("take", 7), ("step", BS)],
        {"capped at the window", "full sequence does not fit"}),
    # the gate counts the hot region a request was asked for (the step alone would fit)
    "gate-counts-the-hot-region": ((16, 12, 2, BS, MAX_LEN, 0, 0b100), [
        ("step", BS), ("take", 5), ("step", BS)], {"asked for hot", "full sequence does not fit"}),
    # vLLM's test_hisparse_does_not_write_back_reprefillable_tokens: the last
    # ``lookahead - 1`` tokens are not copied
    "reprefillable-not-copied": ((32, 16, 2, MAX_LEN, 2 * BS, 3, 0), [
        ("step", 2 * BS), ("confirm", ALL)], set()),
}
# the gated streams' extra arguments (``run``'s ``lookahead`` and ``fit_mask``)
GATES = {"lookahead": st.sampled_from([0, 2, 5, BS + 3]), "fit_mask": st.integers(0, ALL)}
