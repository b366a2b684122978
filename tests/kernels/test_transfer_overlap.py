"""Block transfers over caches that share memory: a cache the call writes that is an
expanded view, or one memory given as two caches (K and V as one tensor, a host cache
that is a device cache), is refused with ShapeError before anything is written; caches
only read may share memory, and views of one tensor that share no element still move
exactly what the per-op simulation moves."""

import pytest

torch = pytest.importorskip("torch")

from prefixkv.kernels import (  # noqa: E402
    ShapeError,
    alloc_host_cache,
    copy_blocks,
    load_blocks,
    offload_blocks,
    run_kv_ops,
)
from prefixkv.results import BlockCopy, BlockLoads, BlockOffloads  # noqa: E402

from .test_transfer import BLOCKS, hosts, ids, simulate, stacked, unchanged_after  # noqa: E402


def test_copies_into_k_and_v_given_as_one_tensor_are_refused():
    # Before: each cache's copy ran in turn on the one tensor, the second reading what the
    # first wrote: a chain 1 -> 2 -> 3 put block 1 into 3 as well (silently wrong KV).
    kv = stacked(0)[0]
    unchanged_after(ShapeError, lambda: copy_blocks([kv, kv], ids(1, 2), ids(2, 3), block_dim=1), [kv], [])


def test_loads_into_k_and_v_given_as_one_tensor_are_refused():
    # Before: V's load overwrote K's: the device block held the V slot's bytes as K.
    kv = stacked(1)[0]
    hs = hosts([kv, kv.clone()])
    unchanged_after(ShapeError, lambda: load_blocks(hs, [kv, kv], ids(0), ids(4), block_dim=1), [kv], hs)


def test_offloads_into_one_host_tensor_twice_are_refused():
    devs = stacked(2)
    h = hosts(devs[:1])[0]
    unchanged_after(ShapeError, lambda: offload_blocks(devs, [h, h], ids(3), ids(0), block_dim=1), devs, [h])


def test_a_load_into_an_expanded_cache_is_refused_before_the_first_cache_is_written():
    # Before: torch raised a bare RuntimeError on the second cache, after the first was written.
    k = stacked(3)[0]
    v = torch.randn(1, BLOCKS, *k.shape[2:]).expand(k.shape[0], -1, -1, -1, -1)
    hs = hosts([k, k])
    unchanged_after(ShapeError, lambda: load_blocks(hs, [k, v], ids(0), ids(1), block_dim=1), [k], hs)


def test_a_host_cache_that_is_a_device_cache_is_refused():
    dev = torch.randn(BLOCKS, 4, 2, 8)
    other = torch.randn(BLOCKS, 4, 2, 8)
    host = alloc_host_cache(dev, BLOCKS).normal_()
    # the host cache of the second pair is the first device cache: offloading pair 1 would
    # change what pair 0 reads... or already read: either way one memory is two caches
    unchanged_after(ShapeError, lambda: offload_blocks([dev, other], [host, dev], ids(1), ids(2)),
                    [dev, other], [host])
    unchanged_after(ShapeError, lambda: load_blocks([host, dev], [dev, other], ids(1), ids(2)),
                    [dev, other], [host])


def test_a_plan_with_k_and_v_as_one_tensor_is_refused_before_its_offloads_run():
    kv = stacked(4)[0]
    hs = hosts([kv, kv.clone()])
    ops = [BlockOffloads((1,), (0,)), BlockCopy(2, 3)]
    unchanged_after(ShapeError, lambda: run_kv_ops(ops, [kv, kv], hs, block_dim=1), [kv], hs)


def test_caches_only_read_may_be_one_tensor():
    kv = stacked(5)[0]
    hs = hosts([kv, kv])
    want_devs, want_hosts = simulate([BlockOffloads((2, 4), (5, 1))], [kv, kv], hs)
    offload_blocks([kv, kv], hs, ids(2, 4), ids(5, 1), block_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(hs, want_hosts, strict=True))
    assert torch.equal(kv, want_devs[0])


@pytest.mark.parametrize("layout", ["interleaved", "stacked"])
def test_k_and_v_views_of_one_tensor_that_share_no_block_move_exactly(layout):
    g = torch.Generator().manual_seed(6)
    if layout == "interleaved":   # FlashInfer: [num_blocks, 2, ...]
        kv = torch.randn(BLOCKS, 2, 4, 2, 8, generator=g)
        devs = [kv[:, 0], kv[:, 1]]
    else:                         # [2, num_blocks, ...]
        kv = torch.randn(2, BLOCKS, 4, 2, 8, generator=g)
        devs = [kv[0], kv[1]]
    hs = hosts(devs, slots=4, block_dim=0)
    ops = [BlockOffloads((1, 2), (3, 0)), BlockLoads((1,), (5,)), BlockCopy(2, 6), BlockCopy(6, 7)]
    want_devs, want_hosts = simulate(ops, devs, hs, block_dim=0)
    run_kv_ops(ops, devs, hs)
    for got, want in zip(devs + hs, want_devs + want_hosts, strict=True):
        assert torch.equal(got, want)


def test_an_expanded_device_cache_is_only_read_by_an_offload():
    k = stacked(7)[0]
    v = k[:, :1].expand(-1, BLOCKS, -1, -1, -1)    # every block is block 0
    hs = hosts([k, k])
    want_devs, want_hosts = simulate([BlockOffloads((3, 5), (1, 2))], [k, v.contiguous()], hs)
    offload_blocks([k, v], hs, ids(3, 5), ids(1, 2), block_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(hs, want_hosts, strict=True))
