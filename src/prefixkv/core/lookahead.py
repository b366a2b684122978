"""Lookahead keys (vLLM 0.33's ``num_hash_lookahead_tokens`` = L): a block's content
covers the ``L`` tokens after it, so a block is keyed, and findable, only once they are
known (docs/lookahead.md; the reference: tests/lookahead_model.py).

``LookaheadKVCacheManager`` is ``KVCacheManager`` with block ``j``'s extra-key bytes
followed by the multimodal inputs that start in the ``L`` tokens after it, then
``b"A" || L:u32 || tokens[(j+1)*bs:(j+1)*bs+L]`` (uint32 each;
``hashing.lookahead_bytes``). Its content is then the request's prefix
``[0, (j+1)*bs + L)`` with the extra keys over it (vLLM's), a pure function
of the request's tokens, and its chain hash covers the same. The per-block bytes travel
in ``RequestKeys.mm`` (``LookaheadKeys``), which every index path already reads per
block, so the plain manager's paths are not touched. Block ``j`` has its lookahead
bytes once the request holds ``(j+1)*bs + L`` tokens (``len(keys.mm)`` blocks of a
request); no block past those is ever keyed: every call that would schedule a full
block whose lookahead tokens are not known is refused with RequestError, before any
change. So a caller schedules (keys) a request's tokens up to ``len(tokens) - L`` and
reserves slots for the rest; ``add_tokens`` adds known tokens without scheduling them
(a decode step's sampled token), ``extend`` schedules them once their lookahead is in.

Since no block is keyed without its lookahead bytes, a walk with the base bytes past a
request's known blocks finds nothing: a hit of ``k`` blocks needs the reader's first
``k*bs + L`` tokens to equal those of the request that computed them.

Events (``enable_events``): each ``BlockStored`` is a ``LookaheadBlockStored`` that
carries its blocks' lookahead tokens, so that a consumer rebuilds the hashes
(``core/lookahead_events.py``; ``hashing.block_hashes(..., hash_lookahead_tokens=L)``).

Not offered with lookahead (ConfigError at construction): a host tier, a shared store
(their keys and fetches are the plain chain's), a ``hash_mode`` callable with events on
(prepared prompts' hashes would be taken before the lookahead is known).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import Any

from ..errors import ConfigError, PromptError, RequestError
from ..event_log import EventLog
from ..extra_keys import ExtraKeys
from ..hashing import lookahead_bytes
from ..index import ContentIndex
from ..results import DecodeStep
from .lookahead_events import LookaheadEventLog
from .manager import KVCacheManager
from .probe import BlockProbe
from .prompt import Prompt, encode_prompt
from .request import Request, RequestKeys

__all__ = ["LookaheadKVCacheManager", "LookaheadKeys", "lookahead_keys"]

class LookaheadKeys(RequestKeys):
    """``RequestKeys`` whose ``mm[j]`` is block ``j``'s own bytes (``own``'s) followed by
    its lookahead tokens, for the blocks whose lookahead tokens are known (no more:
    ``len(mm)``). Immutable, as ``RequestKeys``: a request's grow by replacement."""

    __slots__ = ("own", "lookahead")

    own: RequestKeys
    lookahead: int


def lookahead_keys(own: RequestKeys, tokens: array[int], block_size: int, lookahead: int,
                   known: LookaheadKeys | None = None, start: int = 0) -> LookaheadKeys:
    """The keys of a request of ``tokens`` whose plain keys are ``own``: ``known``'s
    blocks kept (its tokens a prefix of ``tokens``), those whose lookahead became known
    since added. ``start``: the position of ``tokens[0]`` (a window of the request's
    tokens from there, reaching past every block ``known`` lacks)."""
    n = max(0, start + len(tokens) - lookahead) // block_size
    mm: list[bytes] = list(known.mm) if known is not None else []  # type: ignore[arg-type]
    first = len(mm)
    if n > first:
        for j, extra in enumerate(own.of_blocks(first, n), first):
            mm.append(extra + lookahead_bytes(own.extra, tokens, (j + 1) * block_size, lookahead, start))
    keys = LookaheadKeys.__new__(LookaheadKeys)
    keys.extra, keys.base, keys.mm = own.extra, own.base, mm
    keys.own, keys.lookahead = own, lookahead
    return keys


class LookaheadKVCacheManager(KVCacheManager):
    """``KVCacheManager`` whose blocks are keyed with the ``hash_lookahead_tokens``
    tokens after them (module docstring). Every call is ``KVCacheManager``'s, but:
    a call that would schedule a full block whose lookahead tokens are not known raises
    RequestError (nothing changed); ``add_tokens`` adds known tokens unscheduled;
    ``prepare`` makes Prompts with the lookahead keys, and ``add_request`` and the
    lookups take only those. Raises ConfigError for ``hash_lookahead_tokens`` not an
    int >= 1, and for what the module docstring says is not offered."""

    hash_lookahead_tokens: int

    def __init__(self, num_blocks: int, block_size: int = 16, *, hash_lookahead_tokens: int,
                 **options: Any) -> None:
        if hash_lookahead_tokens.__class__ is not int or hash_lookahead_tokens < 1:
            raise ConfigError(f"hash_lookahead_tokens must be an int >= 1, got {hash_lookahead_tokens!r}")
        if options.get("host_blocks") or options.get("store") is not None:
            raise ConfigError("prefixkv does not offer lookahead keys (hash_lookahead_tokens) "
                              "with a host tier or a shared store")
        if callable(options.get("hash_mode")) and options.get("enable_events"):
            raise ConfigError("prefixkv does not offer lookahead keys (hash_lookahead_tokens) "
                              "with a hash_mode callable and events on")
        super().__init__(num_blocks, block_size, **options)
        self.hash_lookahead_tokens = hash_lookahead_tokens
        if isinstance(self._events, EventLog) and isinstance(self._index, ContentIndex):
            assert self._index.lazy, "lookahead keys announce their stores when the log is taken"
            self._events = self._index._sink = LookaheadEventLog(self._events.max_events,
                                                                 hash_lookahead_tokens)

    def prepare(self, prompt_token_ids: Sequence[int], *, extra: ExtraKeys | None = None) -> Prompt:
        """``KVCacheManager.prepare`` with the lookahead keys of the prompt's blocks."""
        if isinstance(prompt_token_ids, Prompt):
            raise PromptError("this prompt is prepared already: pass the Prompt itself")
        tokens, own, cut = encode_prompt(prompt_token_ids, extra, self.block_size, self.vocab_size)
        keys = lookahead_keys(own, tokens, self.block_size, self.hash_lookahead_tokens)
        return Prompt(tokens, keys, list(cut), None, self._config)

    def _prompt(self, prompt: Sequence[int] | Prompt, extra: ExtraKeys | None) -> Prompt:
        """``prompt`` as this manager's Prompt; PromptError for another manager's."""
        if not isinstance(prompt, Prompt):
            return self.prepare(prompt, extra=extra)
        keys = prompt.keys
        if not isinstance(keys, LookaheadKeys) or keys.lookahead != self.hash_lookahead_tokens:
            raise PromptError("this Prompt was not prepared with this manager's lookahead keys")
        return prompt

    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int] | Prompt, *,
                    extra: ExtraKeys | None = None, num_new_tokens: int | None = None,
                    max_hit_tokens: int | None = None, read_cache: bool = True,
                    **options: Any) -> Any:
        """``KVCacheManager.add_request``; RequestError (nothing changed) when the
        tokens it would schedule fill a block whose lookahead tokens are not known."""
        p = self._prompt(prompt_token_ids, extra)
        try:
            live = request_id in self._requests
        except Exception:  # (unhashable: the base call's error)
            live = True
        if not live and (num_new_tokens is None or (num_new_tokens.__class__ is int and num_new_tokens > 0)):
            hit = self.lookup(p, max_hit_tokens=max_hit_tokens) if read_cache is True else 0
            n = len(p.tokens)
            total = n if num_new_tokens is None or hit + num_new_tokens >= n else hit + num_new_tokens
            self._check_keyed(request_id, total, len(p.keys.mm))  # type: ignore[arg-type]
        return super().add_request(request_id, p, num_new_tokens=num_new_tokens,
                                   max_hit_tokens=max_hit_tokens, read_cache=read_cache, **options)

    def _check_keyed(self, request_id: Hashable, scheduled: int, known: int) -> None:
        """RequestError unless every full block of ``scheduled`` tokens is among the
        ``known`` blocks whose lookahead tokens are known."""
        if scheduled // self.block_size > known:
            raise RequestError(
                f"request {request_id!r}: scheduling {scheduled} tokens fills block "
                f"{known} before its {self.hash_lookahead_tokens} lookahead tokens are known "
                f"(lookahead keys: add_tokens, then extend up to the tokens known less "
                f"{self.hash_lookahead_tokens})")

    def add_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Add known tokens to a request without scheduling them (``extend`` schedules
        them, once their lookahead tokens are known too). Raises RequestError (unknown
        id), TokenError (bad ids or container), nothing changed."""
        req = self._get(request_id)
        new = self._encode(token_ids)
        if not new:
            return
        if req.num_scheduled == len(req.tokens):
            self._num_prefilling += 1  # (tokens not yet scheduled: ``extend`` schedules them)
        req.tokens.extend(new)
        self._grow_keys(req)

    def _grow_keys(self, req: Request) -> None:
        keys = req.keys
        assert isinstance(keys, LookaheadKeys), "a lookahead manager's request has lookahead keys"
        if (len(req.tokens) - self.hash_lookahead_tokens) // self.block_size > len(keys.mm):  # type: ignore[arg-type]
            req.keys = lookahead_keys(keys.own, req.tokens, self.block_size,
                                      self.hash_lookahead_tokens, keys)

    def extend(self, request_id: Hashable, num_new_tokens: int) -> tuple[int, ...] | None:
        """``KVCacheManager.extend``; RequestError as the class says."""
        req = self._get(request_id)
        if num_new_tokens.__class__ is int:  # (else the base call's error)
            self._check_keyed(request_id, req.num_scheduled + num_new_tokens, len(req.keys.mm))  # type: ignore[arg-type]
        return super().extend(request_id, num_new_tokens)

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> tuple[int, ...] | None:
        """``KVCacheManager.append_tokens``; RequestError as the class says (a token
        that fills a block always: its lookahead tokens come after it)."""
        req = self._get(request_id)
        new = self._encode(token_ids)
        total = len(req.tokens) + len(new)
        self._check_keyed(request_id, total, max(0, total - self.hash_lookahead_tokens) // self.block_size)
        keys = req.keys
        assert isinstance(keys, LookaheadKeys), "a lookahead manager's request has lookahead keys"
        if (total - self.hash_lookahead_tokens) // self.block_size > len(keys.mm):  # type: ignore[arg-type]
            # (before the base call: a block it fills is keyed with the lookahead it brings)
            req.keys = lookahead_keys(keys.own, req.tokens + new, self.block_size,
                                      self.hash_lookahead_tokens, keys)
        try:
            got = super().append_tokens(request_id, new)
        except BaseException:
            req.keys = keys
            raise
        if got is None:
            req.keys = keys  # (short of blocks: nothing changed)
        return got

    def append_step(self, request_ids: Sequence[Hashable], token_ids: Sequence[int]) -> DecodeStep:
        """``KVCacheManager.append_step``; RequestError as the class says."""
        reqs = self._step_requests(request_ids, token_ids)
        for req in reqs:
            total = len(req.tokens) + 1
            self._check_keyed(req.request_id, total,
                              max(0, total - self.hash_lookahead_tokens) // self.block_size)
        got = super().append_step(request_ids, token_ids)
        for req in reqs:
            self._grow_keys(req)
        return got

    def lookup(self, prompt_token_ids: Sequence[int] | Prompt, *, extra: ExtraKeys | None = None,
               max_hit_tokens: int | None = None) -> int:
        """``KVCacheManager.lookup`` with the lookahead keys."""
        return super().lookup(self._prompt(prompt_token_ids, extra), max_hit_tokens=max_hit_tokens)

    def lookup_block_ids(self, prompt_token_ids: Sequence[int] | Prompt, *,
                         extra: ExtraKeys | None = None, max_hit_tokens: int | None = None
                         ) -> tuple[int, ...]:
        """``KVCacheManager.lookup_block_ids`` with the lookahead keys."""
        return super().lookup_block_ids(self._prompt(prompt_token_ids, extra),
                                        max_hit_tokens=max_hit_tokens)

    def cached_block_id(self, prompt_token_ids: Sequence[int] | Prompt, num_tokens: int, *,
                        extra: ExtraKeys | None = None) -> int | None:
        """``KVCacheManager.cached_block_id`` with the lookahead keys (None for a block
        whose lookahead tokens the prompt does not hold)."""
        return super().cached_block_id(self._prompt(prompt_token_ids, extra), num_tokens)

    def block_probe(self, prompt_token_ids: Sequence[int] | Prompt, *,
                    extra: ExtraKeys | None = None) -> BlockProbe:
        """``KVCacheManager.block_probe`` with the lookahead keys."""
        return super().block_probe(self._prompt(prompt_token_ids, extra))
