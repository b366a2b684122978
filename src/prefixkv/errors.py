"""Typed errors. Every caller mistake is a ``ValueError`` subclass, raised before any
state changes; expected shortage is a ``None`` result, never an exception."""

from __future__ import annotations

import re
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


class PromptError(RequestError):
    """A ``Prompt`` given to a manager whose configuration differs from the one that
    prepared it (block size, vocabulary size, hash function or seed), given together
    with ``extra=`` (the prompt carries its extra keys), or prepared again."""


class PlanError(PrefixKVError):
    """A plan taken with ``take_kv_ops(pending=True)`` and the calls that must follow it
    out of order: the next plan taken before ``kv_ops_done()``, or ``kv_ops_done()``
    with no such plan."""


class ExtraNotInstalledError(ImportError):
    """An optional part of prefixkv was imported without its extra installed; the
    message names the missing package and the ``pip install 'prefixkv[...]'`` to run.
    ``extra``: the extra's name."""

    def __init__(self, part: str, extra: str, missing: str) -> None:
        super().__init__(f"{part} needs {missing}, which is not installed: "
                         f"pip install 'prefixkv[{extra}]'", name=missing)
        self.extra = extra


class PromptTooLongError(PrefixKVError):
    """A request the pool can never hold: an admission with these arguments needs at
    least ``needed`` blocks for its ``num_tokens`` tokens, more than the ``capacity``
    usable blocks, even with every other block free and every block of it cached. Unlike
    a shortage (a ``None`` result, which waiting or preempting cures), waiting would never
    help: reject the request, or give it a larger pool. (vLLM refuses such prompts up
    front: past ``max_model_len``, which it checks fits the KV cache at startup.)"""

    def __init__(self, num_tokens: int, needed: int, capacity: int, detail: str = "") -> None:
        self.num_tokens, self.needed, self.capacity, self._detail = (num_tokens, needed,
                                                                     capacity, detail)
        super().__init__(f"a request of {num_tokens:,} tokens needs at least {needed:,} "
                         f"blocks, and the pool has {capacity:,}{detail}: it can never be "
                         f"admitted")

    def __reduce__(self) -> tuple[type[PromptTooLongError], tuple[int, int, int, str]]:
        return (type(self), (self.num_tokens, self.needed, self.capacity, self._detail))


class InvariantError(AssertionError):
    """Raised by ``check_invariants()`` when internal bookkeeping is inconsistent.
    This is a bug in prefixkv, never a caller mistake."""


MAX_BLOCKS = 1 << 24
"""The most blocks a pool (``num_blocks``) or slots a host tier (``host_blocks``) may
have: 16,777,216. Each is a Python object built at construction (about 200 bytes: some
3 GB and minutes of work at the bound); a larger size is a mistake (bytes passed for
blocks, say), rejected with ConfigError before anything is built."""


def check_positive(name: str, value: object, at_most: int | None = None) -> int:
    """Return ``value`` if it is a positive int (not a bool), at most ``at_most`` when
    given; raise ConfigError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if at_most is not None and value > at_most:
        raise ConfigError(f"{name} must be at most {at_most:,} (each is an object built "
                          f"now), got {value:,}")
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
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"{name} must be an int {bound}, got {value!r}")
    return value


def check_block_ids(block_ids: object, num_blocks: int) -> list[int]:
    """``block_ids`` as a list, each an int in ``[0, num_blocks)``; RequestError when it
    is not an iterable or an id is out of range."""
    try:
        ids: list[int] = list(block_ids)  # type: ignore[call-overload]
    except TypeError:
        raise RequestError(f"block_ids must be an iterable of block ids, got {block_ids!r}") from None
    for i in ids:
        check_count("block id", i, 0, num_blocks - 1)
    return ids


def checked_ids(block_ids: object, num_blocks: int) -> list[int]:
    """``check_block_ids``, its checks made in C calls while every id is an int in range
    (no bytecodes an id)."""
    try:
        ids: list[int] = list(block_ids)  # type: ignore[call-overload]
    except TypeError:
        ids = []
    else:
        if not ids or (set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) < num_blocks):
            return ids
    return check_block_ids(block_ids, num_blocks)  # (raises)


def check_chunk(request_id: Hashable, value: object, unscheduled: int) -> int:
    """``extend``'s count: an int in ``[1, unscheduled]``; RequestError otherwise, saying
    so when no known token is left to schedule (the range would be empty)."""
    if unscheduled <= 0:
        raise RequestError(f"request {request_id!r} has no known token left to schedule "
                           f"(extend schedules the prompt's next chunk; decoded tokens go "
                           f"through append_tokens), got num_new_tokens={value!r}")
    return check_count("num_new_tokens", value, 1, unscheduled)


def live_request(live: Mapping[Hashable, T], request_id: Hashable) -> T:
    """``live[request_id]``; RequestError for an unknown (never admitted or freed) id, or
    one that cannot be looked up (unhashable, or its ``__hash__``/``__eq__`` raises)."""
    try:
        return live[request_id]
    except KeyError:
        raise RequestError(f"unknown request {request_id!r} (never admitted, or already "
                           f"freed; {len(live)} live{_other_types(live, request_id)})") from None
    except Exception as exc:
        raise _unhashable(request_id, exc) from None


def _other_types(live: Mapping[Hashable, object], request_id: Hashable) -> str:
    """``"; their ids are str, this one is int"`` when no live id has the type of
    ``request_id`` (an engine's index given for its request id, say), else ''."""
    kinds = {type(k) for k in live}
    if not kinds or type(request_id) in kinds:
        return ""
    names = ", ".join(sorted(k.__name__ for k in kinds))
    return f"; their ids are {names}, this one is {type(request_id).__name__}"


def check_new_request(live: Mapping[Hashable, object], request_id: Hashable) -> None:
    """RequestError unless ``request_id`` is hashable (its ``__hash__`` and ``__eq__``
    work) and not live."""
    try:
        taken = request_id in live
    except Exception as exc:  # any exception: it is the caller's object that raised
        raise _unhashable(request_id, exc) from None
    if taken:
        raise RequestError(f"request {request_id!r} is already live (it holds blocks until "
                           f"free or preempt; give a new request another id)")


def _unhashable(request_id: object, exc: Exception) -> RequestError:
    return RequestError(f"request id must be hashable, got {type(request_id).__name__} "
                        f"(looking it up raised {exc!r})")


def is_utf8(text: object) -> bool:
    """Whether ``text`` is a str that encodes as UTF-8: one without a lone surrogate (the
    only code points UTF-8 cannot encode)."""
    return isinstance(text, str) and not any("\ud800" <= c <= "\udfff" for c in text)


_ENDPOINT = re.compile(r"[a-z][a-z0-9+.-]*://\S+")  # ZeroMQ's transport://address


def is_endpoint(text: object) -> bool:
    """Whether ``text`` is a ZeroMQ endpoint: a str of UTF-8 text ``transport://address``
    (ZeroMQ itself refuses anything else with ZMQError, after the socket was made). Here,
    below both the publisher (fleet) and the router, which check their endpoints alike."""
    return is_utf8(text) and _ENDPOINT.fullmatch(str(text)) is not None
