"""What the vLLM-shaped adapter reads from a vLLM ``Request`` (pure Python).

The adapter never keeps or changes the engine's request; it reads ``request_id``,
``all_token_ids`` (prompt, then outputs: the tokens known so far),
``num_computed_tokens`` and, when present, ``cache_salt``, ``lora_request``
(``lora_name``, ``lora_int_id``), ``mm_features`` (``identifier``,
``mm_position.offset``, ``mm_position.length``), ``num_preemptions`` and
``skip_reading_prefix_cache``; or ``extra_keys`` (an ExtraKeys) in place of the first
three.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from prefixkv.errors import PrefixKVError, RequestError, check_flag
from prefixkv.extra_keys import ExtraKeys, MultiModalInput

__all__ = ["VllmRequest", "extra_keys_of", "reads_cache", "reject_unsupported"]

_REJECTED = (("num_external_computed_tokens", 0, "KV connectors"),
             ("delay_cache_blocks", False, "delayed caching"),
             ("num_encoder_tokens", 0, "encoder-decoder models"),
             ("reserved_blocks", 0, "a reserved-block gate"))


class VllmRequest(Protocol):
    """The attributes of a vLLM ``Request`` the adapter needs (others are optional)."""

    request_id: Hashable
    all_token_ids: Sequence[int]
    num_computed_tokens: int


def extra_keys_of(request: Any) -> ExtraKeys | None:
    """The request's ExtraKeys: its ``extra_keys`` if set, else built from
    ``cache_salt``, ``lora_request`` (``lora_name`` enters the hash, ``lora_int_id`` is
    carried into events as ``lora_id``) and ``mm_features``; None when it has none.
    Raises ExtraKeysError when one is malformed."""
    given: ExtraKeys | None = getattr(request, "extra_keys", None)
    if given is not None:
        return given
    lora = getattr(request, "lora_request", None)
    name = getattr(lora, "lora_name", None)
    salt = getattr(request, "cache_salt", None)
    mm = tuple(MultiModalInput(f.identifier, f.mm_position.offset, f.mm_position.length)
               for f in getattr(request, "mm_features", None) or ())
    if name is None and salt is None and not mm:
        return None
    lora_id = getattr(lora, "lora_int_id", None) if name is not None else None
    return ExtraKeys(lora=name, cache_salt=salt, mm=mm, lora_id=lora_id)


def reads_cache(request: Any) -> bool:
    """False for a request that must compute every position (vLLM sets
    ``skip_reading_prefix_cache`` for prompt-logprobs and pooling requests). Raises
    RequestError when the attribute is set to something other than a bool."""
    skip = getattr(request, "skip_reading_prefix_cache", False)
    return not check_flag("skip_reading_prefix_cache", skip, RequestError)


def reject_unsupported(unknown: dict[str, Any], **given: Any) -> None:
    """Raise PrefixKVError naming the ``allocate_slots`` arguments in ``given`` that
    differ from vLLM's defaults (features prefixkv does not offer) and every keyword in
    ``unknown``; return when there are none."""
    bad = [f"{k}={given[k]!r} ({why})" for k, default, why in _REJECTED if given[k] != default]
    bad += [f"{k}={v!r} (unknown argument)" for k, v in unknown.items()]
    if bad:
        raise PrefixKVError("allocate_slots: not supported by prefixkv: " + ", ".join(bad))
