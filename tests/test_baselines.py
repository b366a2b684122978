from prefixkv import Admission, BlockCopy, ContiguousAllocator


def test_contiguous_reserves_max_len_first_fit_and_merges_on_free():
    a = ContiguousAllocator(10, 4, max_model_len=12)  # 3 blocks per request
    assert a.add_request("x", [1, 2, 3, 4, 5]) == Admission("x", (0, 1), 0, 5)
    assert a.add_request("y", [1]).block_ids == (3,)
    assert a.add_request("z", [1, 2]).block_ids == (6,)
    assert a.num_free_blocks == 1
    assert a.add_request("w", [1]) is None
    a.free("y")
    fork = a.fork("x", "x2")
    assert fork.block_ids == (3, 4) and fork.copies == (BlockCopy(0, 3), BlockCopy(1, 4))
    a.free("x")
    a.free("x2")
    assert a.num_free_blocks == 7
    assert a.add_request("v", list(range(12))).block_ids == (0, 1, 2)  # ranges 0..5 merged
    assert a.reserved_tokens("v") == 12
    assert a.append_tokens("v", []) == ()


def test_contiguous_offers_the_whole_allocator_interface():
    a = ContiguousAllocator(8, 4, max_model_len=12)
    assert a.add_request("x", list(range(10)), num_new_tokens=3) == Admission("x", (0,), 0, 3)
    assert a.lookup(list(range(10))) == 0
    assert a.extend("x", 7) == (1, 2)
    assert a.append_tokens("x", [1, 2]) == ()
    assert (a.num_tokens("x"), a.num_scheduled_tokens("x"), a.get_block_ids("x")) == (12, 12, (0, 1, 2))
    assert a.usage == 3 / 8 and a.take_events() == [] and a.reset_prefix_cache() is False
    assert a.take_stats().queries == 10
    assert a.preempt("x", num_computed_tokens=12) == tuple(range(10)) + (1, 2)
    assert a.usage == 0.0 and a.reset_prefix_cache() is True


def test_kernel_errors_are_prefixkv_errors():
    import pytest
    kernels = pytest.importorskip("prefixkv.kernels")
    from prefixkv import PrefixKVError
    assert issubclass(kernels.KernelInputError, PrefixKVError)
