"""block_hashes() predicts the chain hashes a real manager announces in BlockStored."""

import pytest

from prefixkv import BlockStored, ExtraKeys, KVCacheManager, MultiModalInput, block_hashes
from prefixkv.errors import ConfigError, ExtraKeysError, TokenError


def stored_hashes(mgr: KVCacheManager, prompt, extra=None) -> list[bytes]:
    mgr.add_request("r", prompt, extra=extra)
    events = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    mgr.free("r")
    return [h for e in events for h in e.block_hashes]


@pytest.mark.parametrize("mode,seed", [("sha256", None), ("sha256", 7), ("sha256", b"k"),
                                       ("xxhash", 0), ("xxhash", 12345678901234567890)])
def test_matches_manager_events(mode, seed):
    prompt = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens
    mgr = KVCacheManager(64, 16, hash_mode=mode, seed=seed, enable_events=True)
    want = stored_hashes(mgr, prompt)
    assert len(want) == 3
    assert block_hashes(prompt, 16, hash_mode=mode, seed=seed) == want


def test_extra_keys_and_multimodal_inputs():
    prompt = list(range(1, 41))  # 5 blocks of 8
    extra = ExtraKeys(lora="ad", cache_salt="t1",
                      mm=(MultiModalInput("img0", 9, 6), MultiModalInput(b"\x01\x02", 30, 2)))
    mgr = KVCacheManager(64, 8, hash_mode="sha256", seed=3, enable_events=True)
    want = stored_hashes(mgr, prompt, extra)
    got = block_hashes(prompt, 8, hash_mode="sha256", seed=3, extra=extra)
    assert got == want and len(got) == 5
    plain = block_hashes(prompt, 8, hash_mode="sha256", seed=3)
    assert all(a != b for a, b in zip(got, plain, strict=True))


def test_multimodal_input_changes_only_overlapping_blocks_and_after():
    prompt = list(range(1, 33))
    img = ExtraKeys(mm=(MultiModalInput("img", 17, 4),))  # block 2 of 8-token blocks
    with_img = block_hashes(prompt, 8, seed=1, extra=img)
    plain = block_hashes(prompt, 8, seed=1)
    assert with_img[:2] == plain[:2] and with_img[2] != plain[2] and with_img[3] != plain[3]


def test_hits_follow_predicted_hashes():
    """A block whose predicted hash was announced is a hit for the same prompt."""
    mgr = KVCacheManager(64, 4, hash_mode="sha256", enable_events=True)
    prompt = list(range(10, 23))
    announced = set(stored_hashes(mgr, prompt))
    predicted = block_hashes(prompt, 4)
    assert set(predicted) <= announced
    assert mgr.lookup(prompt) == 4 * len(predicted)


def test_short_prompt_has_no_full_block():
    assert block_hashes([1, 2, 3], 4) == []


def test_errors():
    with pytest.raises(ConfigError, match="needs the manager's seed"):
        block_hashes([1] * 16, 16, hash_mode="xxhash")
    with pytest.raises(ConfigError, match="block_size"):
        block_hashes([1] * 16, 0)
    with pytest.raises(ConfigError, match="hash_mode"):
        block_hashes([1] * 16, 16, hash_mode="md5")
    with pytest.raises(ConfigError, match="seed"):
        block_hashes([1] * 16, 16, seed=-1)
    with pytest.raises(TokenError):
        block_hashes([-1] * 16, 16)
    with pytest.raises(ExtraKeysError):
        block_hashes([1] * 16, 16, extra="salt")
    with pytest.raises(ExtraKeysError, match="runs past"):
        block_hashes([1] * 16, 16, extra=ExtraKeys(mm=(MultiModalInput("x", 10, 10),)))
