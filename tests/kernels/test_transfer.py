"""Block transfers between device and host caches: exact copies against a per-op
simulation, every documented error raised before anything is written."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from prefixkv.kernels import (  # noqa: E402
    ArgumentTypeError,
    BlockIdError,
    DeviceError,
    DtypeError,
    ShapeError,
    UnsupportedError,
    alloc_host_cache,
    copy_blocks,
    load_blocks,
    offload_blocks,
    run_kv_ops,
)
from prefixkv.results import BlockCopy, BlockLoads, BlockOffloads  # noqa: E402

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 9, 5, 2, 8


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def stacked(seed=0, blocks=BLOCKS, dtype=torch.float32):
    """K and V caches with layers stacked: [LAYERS, blocks, BS, HEADS, DIM] (block_dim 1)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYERS, blocks, BS, HEADS, DIM, generator=g).to(dtype) for _ in range(2)]


def hosts(devs, slots=7, block_dim=1):
    return [alloc_host_cache(d, slots, block_dim=block_dim).normal_() for d in devs]


def simulate(ops, devs, hs, block_dim=1):
    """The plan one op at a time, in the documented order, on clones."""
    devs = [d.clone().movedim(block_dim, 0) for d in devs]
    hs = [h.clone() for h in hs]
    for kind in (BlockOffloads, BlockLoads, BlockCopy):
        group = [op for op in ops if type(op) is kind]
        if kind is BlockCopy:
            pairs = [(op.src, op.dst) for op in group]
        else:  # one (src, dst) pair at a time, in order
            pairs = [(s, t) for op in group for s, t in zip(op.src, op.dst, strict=True)]
        for d, h in zip(devs, hs, strict=True):
            for s, t in pairs:  # one copy at a time (a fork of a fork reads the copy before)
                if kind is BlockOffloads:
                    h[t] = d[s]
                elif kind is BlockLoads:
                    d[t] = h[s]
                else:
                    d[t] = d[s]
    return [d.movedim(0, block_dim) for d in devs], hs


def test_alloc_host_cache_is_slot_major_and_zeroed():
    dev = stacked()[0]
    h = alloc_host_cache(dev, 4, block_dim=1)
    assert h.shape == (4, LAYERS, BS, HEADS, DIM) and h.dtype == dev.dtype
    assert h.device.type == "cpu" and h.is_contiguous() and not h.is_pinned()
    assert h.abs().sum() == 0
    assert alloc_host_cache(dev[0], 2).shape == (2, BS, HEADS, DIM)


@pytest.mark.parametrize("block_dim", [0, 1])
def test_offload_then_load_round_trips_every_layer(block_dim):
    devs = stacked(1)
    if block_dim == 0:
        devs = [d.movedim(1, 0).contiguous() for d in devs]
    hs = hosts(devs, block_dim=block_dim)
    want_devs, want_hosts = simulate([BlockOffloads((4, 0, 7), (2, 3, 6))], devs, hs, block_dim)
    assert offload_blocks(devs, hs, ids(4, 0, 7), ids(2, 3, 6), block_dim=block_dim) is None
    for got, want in zip(hs, want_hosts, strict=True):
        assert torch.equal(got, want)
    before = [d.clone() for d in devs]
    load_blocks(hs, devs, ids(6, 2, 3), ids(1, 8, 5), block_dim=block_dim)

    def pick(t, i):
        return t.select(block_dim, i)

    for d, b in zip(devs, before, strict=True):
        assert torch.equal(pick(d, 1), pick(b, 7)) and torch.equal(pick(d, 8), pick(b, 4))
        assert torch.equal(pick(d, 5), pick(b, 0))
        for untouched in (0, 2, 3, 4, 6, 7):
            assert torch.equal(pick(d, untouched), pick(b, untouched))


def test_a_plan_runs_offloads_then_loads_then_copies():
    """Slot 2 is written by an offload and read by a load of the same plan; block 3 is
    offloaded then overwritten by a load; block 5 is a copy's source and a load's target."""
    devs = stacked(2)
    hs = hosts(devs)
    ops = [BlockCopy(5, 6), BlockLoads((2, 0), (5, 3)), BlockOffloads((3, 1), (2, 4)),
           BlockCopy(0, 1)]
    want_devs, want_hosts = simulate(ops, devs, hs)
    assert run_kv_ops(ops, devs, hs, block_dim=1) is None
    for got, want in zip(devs + hs, want_devs + want_hosts, strict=True):
        assert torch.equal(got, want)


def test_copies_run_as_if_in_order():
    # Before: every source was read before any write, so a fork of a fork (1 -> 2, 2 -> 3)
    # put block 2's old content in 3, where the plan (take_kv_ops) owes block 1's.
    devs = stacked(3)
    before = [d.clone() for d in devs]
    copy_blocks(devs, ids(1, 2, 5, 4), ids(2, 3, 4, 5), block_dim=1)  # a chain and a swap
    for d, b in zip(devs, before, strict=True):
        assert torch.equal(d[:, 2], b[:, 1]) and torch.equal(d[:, 3], b[:, 1])
        assert torch.equal(d[:, 4], b[:, 5]) and torch.equal(d[:, 5], b[:, 5])


def test_a_plan_with_a_fork_of_a_fork_gives_the_grandchild_the_parents_kv():
    from prefixkv import KVCacheManager

    m = KVCacheManager(16, 4)
    m.add_request("p", [1, 2, 3, 4, 5, 6])    # a full block and a partial one
    m.fork("p", "c1")
    m.fork("c1", "c2")                        # one plan: p -> c1, then c1 -> c2
    ops = m.take_kv_ops()
    assert len(ops) == 2 and ops[1].src == ops[0].dst
    devs = stacked(4, blocks=16)
    before = [d.clone() for d in devs]
    run_kv_ops(ops, devs, block_dim=1)
    last = m.get_block_ids("p")[-1]
    for d, b in zip(devs, before, strict=True):
        for child in ("c1", "c2"):
            assert torch.equal(d[:, m.get_block_ids(child)[-1]], b[:, last])


def test_empty_plans_and_groups_do_nothing():
    devs = stacked(4)
    hs = hosts(devs)
    before = [t.clone() for t in devs + hs]
    assert run_kv_ops([], devs, hs, block_dim=1) is None
    assert run_kv_ops([BlockCopy(0, 0)], devs, block_dim=1) is None   # a plan of forks needs no host
    offload_blocks(devs, hs, ids(), ids(), block_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(devs + hs, before, strict=True))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_plans_match_the_simulation(data):
    devs = stacked(data.draw(st.integers(0, 9)), dtype=torch.bfloat16)
    hs = hosts(devs, slots=6)
    n_off = data.draw(st.integers(0, 5))
    off_dst = data.draw(st.permutations(range(6)))[:n_off]
    load_dst = data.draw(st.permutations(range(BLOCKS)))[:data.draw(st.integers(0, 5))]
    copy_dst = data.draw(st.permutations(range(BLOCKS)))[:data.draw(st.integers(0, 3))]
    block = st.integers(0, BLOCKS - 1)
    ops = [BlockCopy(data.draw(block), d) for d in copy_dst]
    off_src = [data.draw(block) for _ in off_dst]
    load_src = [data.draw(st.integers(0, 5)) for _ in load_dst]
    for kind, srcs, dsts in ((BlockOffloads, off_src, off_dst), (BlockLoads, load_src, load_dst)):
        cut = data.draw(st.integers(0, len(dsts)))  # in up to two ops
        ops += [kind(tuple(srcs[a:b]), tuple(dsts[a:b]))
                for a, b in ((0, cut), (cut, len(dsts))) if b > a]
    ops = data.draw(st.permutations(ops))
    want_devs, want_hosts = simulate(ops, devs, hs)
    run_kv_ops(ops, devs, hs, block_dim=1)
    for got, want in zip(devs + hs, want_devs + want_hosts, strict=True):
        assert torch.equal(got, want)


# ---- errors, raised before anything is written --------------------------------------

def unchanged_after(exc, call, devs, hs):
    before = [t.clone() for t in devs + hs]
    with pytest.raises(exc):
        call()
    assert all(torch.equal(a, b) for a, b in zip(devs + hs, before, strict=True))


def test_bad_ids_raise_block_id_error_before_any_copy():
    devs = stacked(5)
    hs = hosts(devs)
    for ops in ([BlockOffloads((0,), (1,)), BlockLoads((1,), (BLOCKS,))],   # device id too large
                [BlockOffloads((0,), (1,)), BlockCopy(-1, 2)],              # negative
                [BlockOffloads((0,), (7,))],                                # slot outside 7 slots
                [BlockOffloads((BLOCKS,), (1,))],                           # block outside
                [BlockOffloads((0, 2), (1, 1))],                            # one slot written twice
                [BlockOffloads((0,), (1,)), BlockOffloads((2,), (1,))],     # (also across two ops)
                [BlockLoads((0, 1), (3, 3))],                               # one block written twice
                [BlockLoads((0,), (3,)), BlockLoads((1,), (3,))],           # (also across two ops)
                [BlockCopy(0, 3), BlockCopy(1, 3)]):
        unchanged_after(BlockIdError, lambda ops=ops: run_kv_ops(ops, devs, hs, block_dim=1), devs, hs)
    unchanged_after(BlockIdError, lambda: load_blocks(hs, devs, ids(9), ids(0), block_dim=1), devs, hs)
    for ops in ([BlockOffloads((0,), (1,)), BlockLoads((0, 1), (2,))],  # unequal lengths
                [BlockOffloads((0, 1), (2,)), BlockLoads((0,), (1,))]):
        unchanged_after(ShapeError, lambda ops=ops: run_kv_ops(ops, devs, hs, block_dim=1), devs, hs)


def test_bad_id_tensors():
    devs = stacked()
    hs = hosts(devs)
    with pytest.raises(ArgumentTypeError):
        offload_blocks(devs, hs, [0], ids(0), block_dim=1)
    with pytest.raises(ShapeError):
        offload_blocks(devs, hs, ids(0, 1).view(1, 2), ids(0, 1).view(1, 2), block_dim=1)
    with pytest.raises(ShapeError):
        offload_blocks(devs, hs, ids(0, 1), ids(0), block_dim=1)
    with pytest.raises(DtypeError):
        offload_blocks(devs, hs, ids(0).float(), ids(0), block_dim=1)
    with pytest.raises(DeviceError):
        offload_blocks(devs, hs, ids(0).to("meta"), ids(0), block_dim=1)


def test_bad_cache_lists():
    devs = stacked()
    hs = hosts(devs)
    with pytest.raises(ArgumentTypeError):
        offload_blocks(devs[0], hs, ids(0), ids(0), block_dim=1)      # a tensor, not a list
    with pytest.raises(ArgumentTypeError):
        run_kv_ops(["copy 0 1"], devs, hs, block_dim=1)
    with pytest.raises(ShapeError):
        offload_blocks([], [], ids(0), ids(0))
    with pytest.raises(ShapeError):
        offload_blocks(devs, hs[:1], ids(0), ids(0), block_dim=1)
    with pytest.raises(ShapeError):
        run_kv_ops([BlockLoads((0,), (0,))], devs, None, block_dim=1)
    with pytest.raises(ShapeError):
        run_kv_ops([BlockOffloads((0,), (0,))], devs, None, block_dim=1)
    with pytest.raises(ShapeError):                                    # host not slot-major
        offload_blocks(devs, [torch.zeros(LAYERS, 7, BS, HEADS, DIM)] * 2, ids(0), ids(0), block_dim=1)
    with pytest.raises(ShapeError):
        offload_blocks(devs, [h.transpose(1, 2).contiguous().transpose(1, 2) for h in hs],
                       ids(0), ids(0), block_dim=1)
    with pytest.raises(ShapeError):                                    # block counts differ
        offload_blocks([devs[0], stacked(blocks=4)[0]], hs, ids(0), ids(0), block_dim=1)


def test_bad_dtypes_devices_and_options():
    devs = stacked()
    hs = hosts(devs)
    with pytest.raises(DtypeError):
        offload_blocks(devs, [h.half() for h in hs], ids(0), ids(0), block_dim=1)
    with pytest.raises(DtypeError):
        alloc_host_cache(torch.zeros(2, 3, dtype=torch.int32), 2)
    with pytest.raises(DeviceError):
        offload_blocks(devs, [h.to("meta") for h in hs], ids(0), ids(0), block_dim=1)
    with pytest.raises(DeviceError):
        offload_blocks([devs[0], devs[1].to("meta")], hs, ids(0), ids(0), block_dim=1)
    with pytest.raises(UnsupportedError):
        offload_blocks(devs, hs, ids(0), ids(0), block_dim=5)
    with pytest.raises(UnsupportedError):
        alloc_host_cache(devs[0], 0)
    with pytest.raises(UnsupportedError):
        alloc_host_cache(devs[0], 2, block_dim=True)
    with pytest.raises(ArgumentTypeError):
        alloc_host_cache("cache", 2)
    with pytest.raises(UnsupportedError):
        offload_blocks(devs, hs, ids(0), ids(0), block_dim=1, stream=object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: pinned host "
                    "caches, the side stream and its event")
def test_cuda_plan_returns_an_event_and_matches_the_simulation():
    devs = [d.cuda() for d in stacked(6)]
    hs = hosts(devs)
    assert all(h.is_pinned() for h in hs)
    ops = [BlockOffloads((3, 4), (2, 3)), BlockLoads((2,), (6,)), BlockCopy(0, 1)]
    want_devs, want_hosts = simulate(ops, [d.cpu() for d in devs], hs)
    ev = run_kv_ops(ops, devs, hs, block_dim=1)
    torch.cuda.current_stream().wait_event(ev)
    ev.synchronize()
    for got, want in zip([d.cpu() for d in devs] + hs, want_devs + want_hosts, strict=True):
        assert torch.equal(got, want)


# ---- every cache dtype: the copies move bits --------------------------------------------

def bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_caches_move_bit_for_bit(dtype):
    """fp8 caches (CPU index_copy_ has no fp8 kernel) through every call, with every byte
    pattern (NaN and inf encodings too); the plan of issue 22 wrote host slot 3 and then
    raised on the load."""
    g = torch.Generator().manual_seed(7)

    def random_bytes(shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)

    devs = [random_bytes((LAYERS, BLOCKS, BS, HEADS, DIM)) for _ in range(2)]
    hs = [random_bytes((7, LAYERS, BS, HEADS, DIM)) for _ in range(2)]
    assert alloc_host_cache(devs[0], 7, block_dim=1).dtype == dtype
    plans = ([BlockOffloads((0,), (3,)), BlockLoads((1,), (2,))],
             [BlockCopy(5, 6), BlockLoads((2, 0), (5, 3)), BlockOffloads((3, 1), (2, 4)), BlockCopy(0, 1)])
    for ops in plans:
        want_devs, want_hosts = simulate(ops, [bits(d) for d in devs], [bits(h) for h in hs])
        run_kv_ops(ops, devs, hs, block_dim=1)
        for got, want in zip(devs + hs, want_devs + want_hosts, strict=True):
            assert torch.equal(bits(got), want)
    before = [bits(t).clone() for t in devs + hs]
    offload_blocks(devs, hs, ids(4, 8), ids(0, 1), block_dim=1)
    load_blocks(hs, devs, ids(5), ids(7), block_dim=1)
    copy_blocks(devs, ids(2), ids(1), block_dim=1)
    for d, h, d0, h0 in zip(devs, hs, before[:2], before[2:], strict=True):
        assert torch.equal(bits(h)[[0, 1]], d0[:, [4, 8]].movedim(1, 0))
        assert torch.equal(bits(d)[:, 7], h0[5]) and torch.equal(bits(d)[:, 1], d0[:, 2])


def test_strided_device_caches_of_two_byte_dtypes():
    """A K cache that is one half of an interleaved [blocks, 2, ...] tensor (strides that
    are not contiguous) in float16: the integer view keeps the strides."""
    kv = torch.randn(BLOCKS, 2, BS, HEADS, DIM).half()
    devs = [kv[:, 0], kv[:, 1]]
    hs = [alloc_host_cache(d, 4) for d in devs]
    ops = [BlockOffloads((1, 2), (0, 3)), BlockLoads((0,), (5,)), BlockCopy(3, 4)]
    want_devs, want_hosts = simulate(ops, devs, hs, block_dim=0)
    run_kv_ops(ops, devs, hs)
    for got, want in zip(devs + hs, want_devs + want_hosts, strict=True):
        assert torch.equal(got, want)
