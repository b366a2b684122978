"""With a host tier and images, ``match`` walks the device and the tier in one loop
(index/matching.py): a device block that is not its parent's chained child is found
through the device's maps, not only in the tier. Two prompts share an image's two
blocks and part after; block size 4."""

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput

BS = 4
IMAGE = ExtraKeys(mm=(MultiModalInput("img", 0, 6),))   # in blocks 0 and 1
A = [*range(8), 50, 51, 52, 53, 54]
B = [*range(8), 60, 61, 62, 63, 64]


def test_prompts_with_an_image_beside_a_host_tier_hit_the_device_blocks_they_share():
    m = KVCacheManager(16, BS, host_blocks=4)
    m.add_request("a", A, extra=IMAGE)
    m.take_kv_ops()
    adm = m.add_request("b", B, extra=IMAGE)
    assert adm.num_cached_tokens == 8 and adm.block_ids[:2] == m.get_block_ids("a")[:2]
    m.take_kv_ops()
    assert m.lookup(A, extra=IMAGE) == m.lookup(B, extra=IMAGE) == 12
    assert m.lookup_block_ids(B, extra=IMAGE) == m.get_block_ids("b")[:3]
    m.check_invariants()
