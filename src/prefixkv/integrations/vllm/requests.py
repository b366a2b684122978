"""What the manager reads from a vLLM ``Request``: its tokens and what else enters the
identity of its KV (prefixkv's ``ExtraKeys``). It never keeps or changes the request.

Read: ``all_token_ids`` (prompt then outputs, as known so far), ``num_tokens``,
``num_computed_tokens``, ``num_preemptions``, ``skip_reading_prefix_cache``,
``cache_salt``, ``lora_request`` (``lora_name`` is hashed, ``lora_int_id`` goes into
events), ``mm_features`` (``identifier``, ``mm_position.offset`` / ``.length``) and
``prompt_embeds`` with ``prompt_is_token_ids``: positions fed by embeddings rather than
tokens carry a placeholder token id, so the embeddings' bytes and the positions they feed
enter the identity as one more multimodal-style key over the whole prompt (a digest), and
only requests with the same embeddings in the same places share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from prefixkv.extra_keys import ExtraKeys, MultiModalInput

__all__ = ["core_tokens", "extra_keys_of", "reads_cache"]


def core_tokens(request: Any) -> Sequence[int]:
    """The request's known token ids (vLLM's list behind ``all_token_ids``, not copied)."""
    tokens = request.all_token_ids
    out: Sequence[int] = getattr(tokens, "_x", tokens)
    return out


def _embeds_key(request: Any) -> tuple[MultiModalInput, ...]:
    """The embeddings' key: a digest of their bytes and of which positions they feed
    (``prompt_is_token_ids``; None: all of them). In a mixed prompt an embedded position
    carries id 0 and a token position a row of zeros, so the ids and the embeds alone do
    not say whether the model read a token 0 or a zero embedding there."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return ()
    data = embeds.detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8)
    digest = hashlib.sha256(bytes(data.numpy()))
    is_token = getattr(request, "prompt_is_token_ids", None)
    digest.update(b"all" if is_token is None else bytes(map(bool, is_token)))
    return (MultiModalInput("prompt_embeds:" + digest.hexdigest(), 0, max(1, request.num_prompt_tokens)),)


def extra_keys_of(request: Any) -> ExtraKeys | None:
    """The request's ExtraKeys, None when it has none. Raises ExtraKeysError when one is
    malformed."""
    lora = getattr(request, "lora_request", None)
    name = getattr(lora, "lora_name", None)
    salt = getattr(request, "cache_salt", None)
    mm = tuple(MultiModalInput(f.identifier, f.mm_position.offset, f.mm_position.length)
               for f in getattr(request, "mm_features", None) or ())
    mm += _embeds_key(request)
    if name is None and salt is None and not mm:
        return None
    lora_id = getattr(lora, "lora_int_id", None) if name is not None else None
    return ExtraKeys(lora=name, cache_salt=salt, mm=mm, lora_id=lora_id)


def reads_cache(request: Any) -> bool:
    """False for a request that must compute every position (prompt logprobs, pooling:
    vLLM's ``skip_reading_prefix_cache``)."""
    return not getattr(request, "skip_reading_prefix_cache", False)
