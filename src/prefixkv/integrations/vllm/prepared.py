"""Prompts prepared where vLLM builds its ``Request``: on the engine's input thread.

vLLM 0.33 hashes a prompt's blocks when its ``Request`` is built: ``Request.__init__``
calls the ``block_hasher`` it was given, and ``EngineCoreProc.process_input_sockets``
builds requests on its input thread (``preprocess_add_request``), beside the scheduler's
thread. ``PreparedPrompts.hasher`` wraps that hasher: on a request's first call (its
construction) it runs prefixkv's ``prepare`` on the request's token ids and extra keys
(the same ``core_tokens`` / ``extra_keys_of`` the scheduler's thread reads otherwise),
then returns what vLLM's hasher returns. The scheduler's admission takes the ``Prompt``
back with ``prompt_of`` when it still describes the request exactly, and the ids
otherwise.

When the Prompt describes a request: vLLM 0.33 changes a ``Request``'s tokens in three
kinds of places: ``append_output_token_ids`` (outputs: the count grows), the P/D
connectors that cut the prompt's tail on the prefill side (Mooncake, MoRIIO, NIXL:
``_all_token_ids.pop()`` / ``del ...[-n:]``, ``prompt_embeds`` sliced anew, the count
shrinks) and the streaming-session update (``Scheduler._update_request_as_session``, on
``resumable`` requests: tokens cut and extended in place, multimodal features added).
So the Prompt is used while the request has no output, is not resumable, and its token
list is the very list object it was prepared from with the same count of tokens; and its
LoRA request, cache salt, multimodal feature list (object and length), prompt
embeddings and their mask are those it was prepared from. Everything else (outputs
appended, a prompt cut, then grown back by an output, a re-admission after preemption
with outputs, a session, a token list or any of those inputs replaced, a request built
by another hasher or for another manager, a prompt ``prepare`` refused) admits the ids,
as before.
Each check is O(1): the point is to keep the scheduler's thread off the prompt's length.

The record of a request is held weakly (it goes with the ``Request``), written once on
the thread that builds it and read on the scheduler's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

from prefixkv.core.prompt import Prompt
from prefixkv.errors import PrefixKVError
from prefixkv.extra_keys import ExtraKeys

from .requests import core_tokens, extra_keys_of

__all__ = ["PreparedPrompts", "PreparingHasher"]

Prepare = Callable[..., Prompt]


@dataclass(frozen=True, slots=True)
class _Record:
    """A Prompt and the request's inputs it was prepared from (compared by identity)."""

    prompt: Prompt
    tokens: Sequence[int]  # the request's own token list (the object, not a copy)
    num_tokens: int
    lora: Any
    salt: str | None
    mm: Any
    num_mm: int
    embeds: Any
    mask: Any

    def describes(self, request: Any) -> bool:
        return (core_tokens(request) is self.tokens and request.num_tokens == self.num_tokens
                and not request.num_output_tokens and not request.resumable
                and request.lora_request is self.lora and request.cache_salt == self.salt
                and request.mm_features is self.mm and len(request.mm_features) == self.num_mm
                and request.prompt_embeds is self.embeds and request.prompt_is_token_ids is self.mask)


class PreparedPrompts:
    """The Prompts one manager prepared, per vLLM ``Request`` (held weakly).

    ``prepare`` is the manager's (``KVCacheManager.prepare`` or the hybrid manager's):
    it reads only configuration fixed when the manager was built, so it may run on any
    thread once the manager exists. ``block_size``: the manager's (the extra keys of
    prompt embeddings are per block)."""

    def __init__(self, prepare: Prepare, block_size: int) -> None:
        self._prepare, self._block_size = prepare, block_size
        # a request -> its record, or None when prepare refused its prompt
        self._records: WeakKeyDictionary[Any, _Record | None] = WeakKeyDictionary()
        self.prepared = 0  # Prompts made (counts for tests and benchmarks)
        self.taken = 0  # Prompts handed to admission (``prompt_of``)

    def hasher(self, vllm_hasher: Callable[[Any], list[Any]] | None) -> PreparingHasher:
        """A block hasher for vLLM's ``Request`` that prepares each request's prompt
        here, then answers as ``vllm_hasher`` (no hashes when None)."""
        return PreparingHasher(self, vllm_hasher)

    def note(self, request: Any) -> None:
        """Prepare ``request``'s prompt as it is now, once per request (a later call
        changes nothing). A prompt ``prepare`` refuses (an id outside [0, 2**32), a
        malformed extra key) is left to the ids path, which raises on the scheduler's
        thread as it would without this."""
        if request in self._records:
            return
        tokens: Sequence[int] = core_tokens(request)
        try:
            extra: ExtraKeys | None = extra_keys_of(request, self._block_size)
            prompt = self._prepare(tokens, extra=extra)
        except PrefixKVError:
            self._records[request] = None
            return
        mm = request.mm_features
        self._records[request] = _Record(prompt, tokens, len(tokens), request.lora_request,
                                         request.cache_salt, mm, len(mm), request.prompt_embeds,
                                         request.prompt_is_token_ids)
        self.prepared += 1

    def requests(self) -> list[Any]:
        """The requests noted here that are still alive (their records go with them), in
        the order noted; safe while another thread notes more (the dict is copied
        first)."""
        refs = self._records.keyrefs()  # (a list made in one C call: no thread runs meanwhile)
        return [r for r in (ref() for ref in refs) if r is not None]

    def prompt_of(self, request: Any) -> Prompt | None:
        """The Prompt prepared for ``request`` if it describes the request's tokens and
        extra keys exactly now (module docstring), else None: admit its ids."""
        record = self._records.get(request)
        if record is None or not record.describes(request):
            return None
        self.taken += 1
        return record.prompt


class PreparingHasher:
    """vLLM's ``block_hasher`` with prefixkv's ``prepare`` in front: called by
    ``Request.__init__`` (and, on the scheduler's thread, when outputs are appended or a
    session is updated). Only a call before the request has any output prepares; the
    others cost one length read on top of vLLM's hasher."""

    __slots__ = ("prompts", "vllm_hasher")

    def __init__(self, prompts: PreparedPrompts, vllm_hasher: Callable[[Any], list[Any]] | None) -> None:
        self.prompts, self.vllm_hasher = prompts, vllm_hasher

    def __call__(self, request: Any) -> list[Any]:
        if not request.num_output_tokens:
            self.prompts.note(request)
        return self.vllm_hasher(request) if self.vllm_hasher is not None else []
