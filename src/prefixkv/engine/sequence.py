"""Sampling parameters and the engine's per-sequence state.

A request with ``n`` samples becomes ``n`` sequences: sample 0 runs the prefill and the
others are forked from it after its first token. A sequence's tokens and counters::

    | prompt ...................... | output ........... |
    | in cache: num_computed | new this step | pending  |   (pending: sampled, KV not yet
                                                          computed; at most one token)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from prefixkv.core.prompt import Prompt
from prefixkv.extra_keys import ExtraKeys


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request.

    ``temperature == 0`` is greedy (argmax). Otherwise each sample draws with the
    Gumbel-max trick from its own generator seeded ``seed + sample_index``, so a sample's
    tokens depend only on its logits, never on batching, caching or preemption.
    ``n`` samples share the prompt's KV through ``fork``. A sequence finishes after
    ``max_tokens`` tokens, on ``eos_token_id``, or at the engine's ``max_model_len``.
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SampleSeq:
    """One sample of a request, as the engine tracks it (the allocator keeps its own
    copy of the tokens; the engine's is the truth when it re-admits after preemption)."""

    __slots__ = ("seq_id", "request_id", "index", "params", "extra", "prompt", "output",
                 "num_computed", "num_known", "status", "admitted", "generator",
                 "finish_reason", "arrival", "first_scheduled", "first_token", "finished",
                 "num_cached_tokens", "num_prefill_computed", "num_preemptions", "prepared")

    def __init__(self, request_id: Hashable, index: int, prompt: list[int],
                 params: SamplingParams, extra: ExtraKeys | None, arrival: float) -> None:
        self.seq_id = (request_id, index)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.extra = extra
        self.prompt = prompt
        self.output: list[int] = []
        self.num_computed = 0      # tokens whose KV is in the cache
        self.num_known = 0         # tokens the allocator holds (admitted or appended)
        self.status = Status.WAITING
        self.admitted = -1         # admission order; the highest is preempted first
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.finish_reason: str | None = None
        self.arrival = arrival
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.finished: float | None = None
        self.num_cached_tokens: int | None = None  # cache hit at the first admission
        self.prepared: Prompt | None = None  # the prompt, prepared where it arrived
        self.num_prefill_computed = 0  # tokens computed by prefills, recompute included
        self.num_preemptions = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def sample(self, logits: torch.Tensor) -> int:
        """Next token from ``logits: [vocab_size]`` fp32."""
        if self.generator is None:
            return int(torch.argmax(logits))
        u = torch.rand(logits.shape, generator=self.generator, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        return int(torch.argmax(logits.double() / self.params.temperature + gumbel.to(logits.device)))

    def finish_check(self, max_model_len: int) -> str | None:
        """The reason to stop after the token just sampled, or None."""
        p = self.params
        if p.eos_token_id is not None and self.output and self.output[-1] == p.eos_token_id:
            return "stop"
        if len(self.output) >= p.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
