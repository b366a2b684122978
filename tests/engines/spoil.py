"""Spoiling what a store holds, for the engines' random fault tests (vLLM's connector,
SGLang's HiCache backend): a stored value flipped, two swapped, one replaced by a key of
another Redis type, one deleted."""

from __future__ import annotations

from collections.abc import Sequence


def spoil_one(client, how: str, pick: int, targets: Sequence[bytes] = ()) -> None:
    """Spoil one of the values stored under ``prefixkv:``, one of ``targets`` when any is
    stored (e.g. the blocks the next requests may load). ``how``: ``flip`` (one bit),
    ``swap`` (with the next key), ``list`` (the key becomes a list), else ``delete``."""
    keys = sorted(k for k in client.keys(b"prefixkv:*") if client.type(k) == b"string")
    wanted = set(targets)
    keys = [k for k in keys if k in wanted] or keys
    if not keys:
        return
    key = keys[pick % len(keys)]
    if how == "flip":
        value = bytearray(client.get(key))
        value[pick % len(value)] ^= 1 << (pick % 8)
        client.set(key, bytes(value))
    elif how == "swap" and len(keys) > 1:
        other = keys[(pick + 1) % len(keys)]
        a, b = client.get(key), client.get(other)
        client.set(key, b)
        client.set(other, a)
    elif how == "list":
        client.delete(key)
        client.rpush(key, b"not a value")
    else:
        client.delete(key)
