"""What the manager reads from a vLLM ``Request``: its tokens and what else enters the
identity of its KV (prefixkv's ``ExtraKeys``). It never keeps or changes the request.

Read: ``all_token_ids`` (prompt then outputs, as known so far), ``num_tokens``,
``num_computed_tokens``, ``num_preemptions``, ``skip_reading_prefix_cache``,
``cache_salt`` (an empty one is no salt, as in vLLM), ``lora_request``
(``lora_name`` and ``lora_path`` are hashed, as vLLM hashes both, so a name re-pointed at
other weights misses; ``lora_int_id`` goes into events), ``mm_features``
(``identifier``, ``mm_position.offset`` / ``.length``) and ``prompt_embeds`` with
``prompt_is_token_ids``: positions fed by embeddings rather than tokens carry a
placeholder token id, so each block's embedding rows and which of its
positions they feed enter its identity as one more multimodal-style key (a digest per
block, as vLLM hashes each block's rows): requests share the blocks up to the first one
whose embeddings or mask differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from prefixkv.extra_keys import EMBEDS_TAG, ExtraKeys, MultiModalInput

__all__ = ["EMBEDS_TAG", "core_tokens", "extra_keys_of", "reads_cache", "sound_tokens"]


def core_tokens(request: Any) -> Sequence[int]:
    """The request's known token ids (vLLM's list behind ``all_token_ids``, not copied)."""
    tokens = request.all_token_ids
    out: Sequence[int] = getattr(tokens, "_x", tokens)
    return out



def sound_tokens(request: Any, replay_tokens: int) -> int:
    """The request's tokens whose KV is sound: ``num_computed_tokens``, but while vLLM's
    SWA bounded replay recomputes the ``replay_tokens`` below a hit (from
    ``replay_start``, > 0 once a hit replays), the hit's end: the replayed tokens' KV is
    cached in the other groups and kept (only the uncached window is rebuilt)."""
    n: int = request.num_computed_tokens
    start: int = getattr(request, "replay_start", 0) if replay_tokens else 0
    if start and start <= n < start + replay_tokens:
        return start + replay_tokens
    return n


def _embeds_keys(request: Any, block_size: int) -> tuple[MultiModalInput, ...]:
    """The embeddings' keys, one per block of the prompt: a digest of the block's rows
    and of which of its positions they feed (``prompt_is_token_ids``; None: all of them),
    so prompts whose embeddings share a prefix share its blocks, as in vLLM (which hashes
    each block's rows). In a mixed prompt an embedded position carries id 0 and a token
    position a row of zeros, so the ids and the embeds alone do not say whether the model
    read a token 0 or a zero embedding there: the mask enters each block's key too."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return ()
    torch = __import__("torch")
    data = embeds.detach().cpu().contiguous()
    is_token = getattr(request, "prompt_is_token_ids", None)
    n = max(1, request.num_prompt_tokens)
    keys = []
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        digest = hashlib.sha256(bytes(data[start:end].reshape(-1).view(dtype=torch.uint8).numpy()))
        digest.update(b"all" if is_token is None else bytes(map(bool, is_token[start:end])))
        keys.append(MultiModalInput(EMBEDS_TAG + digest.digest(), start, end - start))
    return tuple(keys)


def extra_keys_of(request: Any, block_size: int) -> ExtraKeys | None:
    """The request's ExtraKeys for a manager of ``block_size`` (the embeddings' keys are
    per block), None when it has none. Raises ExtraKeysError when one is malformed."""
    lora = getattr(request, "lora_request", None)
    name = getattr(lora, "lora_name", None)
    salt = getattr(request, "cache_salt", None) or None  # vLLM reads '' as no salt
    mm = tuple(MultiModalInput(f.identifier, f.mm_position.offset, f.mm_position.length)
               for f in getattr(request, "mm_features", None) or ())
    mm += _embeds_keys(request, block_size)
    if name is None and salt is None and not mm:
        return None
    lora_id = getattr(lora, "lora_int_id", None) if name is not None else None
    path = (getattr(lora, "lora_path", None) or None) if name is not None else None
    return ExtraKeys(lora=name, cache_salt=salt, mm=mm, lora_id=lora_id, lora_path=path)


def reads_cache(request: Any) -> bool:
    """False for a request that must compute every position (prompt logprobs, pooling:
    vLLM's ``skip_reading_prefix_cache``)."""
    return not getattr(request, "skip_reading_prefix_cache", False)
