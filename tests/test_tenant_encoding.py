"""The encoding that keeps tenants apart: ``extra_keys.py`` says no two different key
sets encode to the same bytes. Hypothesis draws pairs of key sets from an alphabet made
to collide (the tag letters, length bytes, NUL, combining marks, a multimodal hash that
spells a salt's tagged bytes) and checks that equal bytes, for every block, mean equal
keys, so that equal chain hashes (``block_hashes``) can only come from equal keys.

Equal keys here: the same LoRA name, salt and multimodal inputs, a multimodal hash read
as its bytes (``MultiModalInput("ab")`` and ``MultiModalInput(b"ab")`` name one input:
both encode as ``b"ab"``, documented); ``lora_id`` is not hashed (the name is the
identity)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, MultiModalInput
from prefixkv.hashing import block_hashes

BS = 4
PROMPT = list(range(1, 18))  # four full blocks

_PIECES = ["a", "b", "L", "S", "M", "\x00", "\x01", "\x04", "\u0301", "\u00e9", "e"]
texts = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6).map("".join)
names = st.none() | texts


@st.composite
def multimodal(draw: st.DrawFn) -> tuple[MultiModalInput, ...]:
    n = draw(st.integers(0, 2))
    out = []
    for _ in range(n):
        h = draw(texts)
        raw = draw(st.booleans())
        offset = draw(st.integers(0, 12))
        length = draw(st.integers(1, len(PROMPT) - offset))
        out.append(MultiModalInput(h.encode() if raw else h, offset, length))
    return tuple(out)


keys = st.builds(ExtraKeys, lora=names, cache_salt=names, mm=multimodal())


@st.composite
def near(draw: st.DrawFn) -> tuple[ExtraKeys, ExtraKeys]:
    """A key set and one built to encode like it under a weaker encoding: the salt's
    tagged text moved into the LoRA name, a salt cut and its tail moved across, a
    multimodal hash spelling the base keys' bytes, the same inputs as str and bytes."""
    one = draw(keys)
    lora, salt = one.lora or "", one.cache_salt or ""
    k = draw(st.integers(0, len(salt)))
    how = draw(st.sampled_from(["merge", "cut", "spell", "flip", "same"]))
    if how == "merge" and one.cache_salt is not None:
        two = ExtraKeys(lora=lora + "S" + salt, mm=one.mm)
    elif how == "cut" and 0 < k < len(salt):
        two = ExtraKeys(lora=lora + "S" + salt[:k] if lora else None, cache_salt=salt[k:], mm=one.mm)
    elif how == "spell" and one.base_bytes():
        two = ExtraKeys(mm=(MultiModalInput(one.base_bytes(), 0, len(PROMPT)),) + one.mm)
    elif how == "flip":
        two = ExtraKeys(one.lora, one.cache_salt, tuple(MultiModalInput(
            m.hash.encode() if isinstance(m.hash, str) else m.hash.decode(), m.offset, m.length)
            for m in one.mm))
    else:
        two = ExtraKeys(one.lora, one.cache_salt, one.mm)
    return one, two


def _identity(k: ExtraKeys) -> tuple[object, ...]:
    mm = tuple((m.hash.encode() if isinstance(m.hash, str) else m.hash, m.offset, m.length) for m in k.mm)
    return k.lora, k.cache_salt, mm


def _encoded(k: ExtraKeys) -> list[bytes]:
    return k.block_bytes(len(PROMPT) // BS, BS)


def _encode_apart_unless_equal(one: ExtraKeys, two: ExtraKeys) -> None:
    """Block by block: the keys that apply to a block encode alike exactly when equal."""
    for i in range(len(PROMPT) // BS):
        a, b = one.for_range(i * BS, (i + 1) * BS), two.for_range(i * BS, (i + 1) * BS)
        same = (_identity(a) if a else None) == (_identity(b) if b else None)
        assert (_encoded(one)[i] == _encoded(two)[i]) == same, (one, two, i)


@settings(max_examples=400, deadline=None)
@given(keys, keys)
def test_equal_encodings_mean_equal_keys(one, two):
    _encode_apart_unless_equal(one, two)


@settings(max_examples=300, deadline=None)
@given(near())
def test_keys_built_to_collide_encode_apart_unless_equal(pair):
    _encode_apart_unless_equal(*pair)


@settings(max_examples=100, deadline=None)
@given(keys, keys)
def test_equal_chain_hashes_mean_equal_keys_on_every_block_before(one, two):
    ha = block_hashes(PROMPT, BS, extra=one)
    hb = block_hashes(PROMPT, BS, extra=two)
    for i in range(len(ha)):
        before = all(_encoded(one)[j] == _encoded(two)[j] for j in range(i + 1))
        assert (ha[i] == hb[i]) == before, (one, two, i)


def test_a_salt_and_a_multimodal_hash_spelling_its_tagged_bytes_encode_apart():
    salted = ExtraKeys(cache_salt="a")
    spelled = ExtraKeys(mm=(MultiModalInput(b"S\x01\x00\x00\x00a", 0, 4),))
    assert _encoded(salted)[0] != _encoded(spelled)[0]
    assert block_hashes(PROMPT, BS, extra=salted) != block_hashes(PROMPT, BS, extra=spelled)
