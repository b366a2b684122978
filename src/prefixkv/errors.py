"""Typed errors. Every caller mistake is a ``ValueError`` subclass, raised before any
state changes; expected shortage is a ``None`` result, never an exception."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

T = TypeVar("T")


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


class ExtraNotInstalledError(ImportError):
    """An optional part of prefixkv was imported without its extra installed; the
    message names the missing package and the ``pip install 'prefixkv[...]'`` to run.
    ``extra``: the extra's name."""

    def __init__(self, part: str, extra: str, missing: str) -> None:
        super().__init__(f"{part} needs {missing}, which is not installed: "
                         f"pip install 'prefixkv[{extra}]'", name=missing)
        self.extra = extra


class InvariantError(AssertionError):
    """Raised by ``check_invariants()`` when internal bookkeeping is inconsistent.
    This is a bug in prefixkv, never a caller mistake."""


def check_positive(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int (not a bool); raise ConfigError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def check_flag(name: str, value: object, error: type[PrefixKVError]) -> bool:
    """Return ``value`` if it is a bool; raise ``error`` otherwise (``"no"`` is truthy,
    so a string or an int where a flag belongs is a mistake, never a guess)."""
    if type(value) is not bool:
        raise error(f"{name} must be True or False, got {value!r}")
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


def live_request(live: Mapping[Hashable, T], request_id: Hashable) -> T:
    """``live[request_id]``; RequestError for an unknown (never admitted or freed) id."""
    try:
        return live[request_id]
    except (KeyError, TypeError):
        raise RequestError(f"unknown request {request_id!r} (never admitted, or already "
                           f"freed; {len(live)} live)") from None


def check_new_request(live: Mapping[Hashable, object], request_id: Hashable) -> None:
    """RequestError unless ``request_id`` is hashable and not live."""
    try:
        taken = request_id in live
    except TypeError:
        raise RequestError(f"request id must be hashable, got {type(request_id).__name__}") from None
    if taken:
        raise RequestError(f"request {request_id!r} is already live")
