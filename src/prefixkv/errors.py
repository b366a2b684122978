"""Typed errors. Every caller mistake is a ``ValueError`` subclass, raised before any
state changes; expected shortage is a ``None`` result, never an exception."""

from __future__ import annotations


class PrefixKVError(ValueError):
    """Base of every caller-mistake error raised by prefixkv."""


class ConfigError(PrefixKVError):
    """A constructor argument is out of range (sizes, hash mode, seed, vocabulary)."""


class TokenError(PrefixKVError):
    """Empty prompt, a token id outside uint32, or one at or above ``vocab_size``."""


class ExtraKeysError(PrefixKVError):
    """Extra keys (LoRA name, multimodal inputs, cache salt) of the wrong type or shape."""


class RequestError(PrefixKVError):
    """Unknown, finished or duplicate request id, a double free, or a call that the
    request's state does not allow (e.g. appending before its prefill is scheduled)."""


class InvariantError(AssertionError):
    """Raised by ``check_invariants()`` when internal bookkeeping is inconsistent.
    This is a bug in prefixkv, never a caller mistake."""


def check_positive(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int (not a bool); raise ConfigError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def check_count(name: str, value: object, low: int, high: int | None) -> int:
    """Return ``value`` if it is an int in ``[low, high]`` (``high`` None: unbounded);
    raise RequestError naming the valid range otherwise (a count the request's state does
    not allow)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"{name} must be an int in {bound}, got {value!r}")
    return value
