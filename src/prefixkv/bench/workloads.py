"""Seeded synthetic workloads: lists of requests in arrival order, nothing downloaded.

A workload is the input of a replay (``replay.py``): each ``BenchRequest`` arrives in
list order, is admitted when the scheduler can fit it, decodes its ``output`` one token
per step and finishes. A request with ``after`` set becomes eligible only once that
request has finished (the next turn of a chat session waits for the previous answer),
so chat sessions interleave: turn 1 of every session, then turn 2 of every session, ...

Token ids are drawn from ``random.Random(seed)``; the same seed and scale give the same
requests, token for token.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from ..extra_keys import ExtraKeys
from . import limits
from .errors import BenchError, check_int, shorten

VOCAB = 32000
TOKEN_IDS = tuple(range(VOCAB))
"""Every token id, each one int object: drawing from it (``rng.choices(TOKEN_IDS, k=n)``,
the same draws as from ``range(VOCAB)``) shares these objects, so a drawn token costs 8
bytes (a pointer) instead of a new int's 36."""
BUILTIN = ("system-prompt", "chat", "document", "pressure")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: the full prompt (history included), the tokens it will
    decode (at least one), its extra keys, and the id it must wait for, if any."""

    rid: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    extra: ExtraKeys | None = None
    after: str | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    """A named request list and the pool it is meant to run in (``pool_tokens`` slots,
    divided by the block size at replay time)."""

    name: str
    description: str
    requests: tuple[BenchRequest, ...]
    pool_tokens: int

    def max_tokens(self) -> int:
        """Prompt + output length of the longest request."""
        return max(len(r.prompt) + len(r.output) for r in self.requests)

    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


def _checked(name: str, scale: float, seed: int) -> None:
    """Refuse, before a token is drawn, what ``check_scale`` refuses, and a seed that is
    not an int (it names the token stream: seed True must not pass for seed 1)."""
    check_scale(scale, [name])
    if type(seed) is not int:
        raise BenchError(f"--seed must be an int, got {shorten(seed)}")


def _count(base: int, scale: float) -> int:
    return max(1, round(base * scale))


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.choices(TOKEN_IDS, k=n))


def system_prompt(scale: float = 1.0, seed: int = 0) -> Workload:
    """A 2048-token system prompt shared by every request, each with its own question."""
    _checked("system-prompt", scale, seed)
    rng = random.Random(f"system-prompt/{seed}")
    system = _tokens(rng, 2048)
    reqs = tuple(
        BenchRequest(f"sp{i}", system + _tokens(rng, rng.randint(32, 256)),
                     _tokens(rng, rng.randint(16, 128)))
        for i in range(_count(200, scale)))
    return Workload("system-prompt", "2048-token shared system prompt + unique user suffixes "
                    "(32-256 tokens), 16-128 output tokens", reqs, 65536)


MAX_TURNS = 64
"""``chat``'s turns at most: each re-sends its history, so a session's tokens grow as the
square of its turns (64 turns at scale 1: about ``limits.MAX_TRACE_TOKENS``)."""


def chat(scale: float = 1.0, seed: int = 0, turns: int = 6) -> Workload:
    """Multi-turn sessions behind a 512-token shared system prompt; every turn re-sends
    the whole history (previous prompt + answer) plus a new user message. ``turns``: an
    int in 1..``MAX_TURNS`` (BenchError otherwise)."""
    _checked("chat", scale, seed)
    check_int("turns", turns, 1, MAX_TURNS)
    rng = random.Random(f"chat/{seed}")
    system = _tokens(rng, 512)
    sessions = _count(24, scale)
    history = [system] * sessions
    reqs = []
    for turn in range(turns):
        for s in range(sessions):
            prompt = history[s] + _tokens(rng, rng.randint(32, 256))
            output = _tokens(rng, rng.randint(32, 192))
            after = f"chat{s}.{turn - 1}" if turn else None
            reqs.append(BenchRequest(f"chat{s}.{turn}", prompt, output, after=after))
            history[s] = prompt + output
    return Workload("chat", f"{sessions} sessions x {turns} turns, 512-token shared system "
                    "prompt, history re-sent each turn, sessions interleaved", tuple(reqs), 65536)


def document(scale: float = 1.0, seed: int = 0) -> Workload:
    """One 32768-token document followed by 100 different questions."""
    _checked("document", scale, seed)
    rng = random.Random(f"document/{seed}")
    doc = _tokens(rng, 32768)
    reqs = tuple(
        BenchRequest(f"doc{i}", doc + _tokens(rng, rng.randint(16, 64)),
                     _tokens(rng, rng.randint(16, 96)))
        for i in range(_count(100, scale)))
    return Workload("document", f"one 32768-token document asked {len(reqs)} questions",
                    reqs, 65536)


def pressure(scale: float = 1.0, seed: int = 0) -> Workload:
    """48 distinct 1024-token prefixes, picked with a skewed (Zipf-like) popularity, in a
    pool of 8192 slots: the working set is six times the pool, so eviction never stops."""
    _checked("pressure", scale, seed)
    rng = random.Random(f"pressure/{seed}")
    prefixes = [_tokens(rng, 1024) for _ in range(48)]
    weights = [1.0 / (k + 1) for k in range(len(prefixes))]
    reqs = tuple(
        BenchRequest(f"pr{i}", rng.choices(prefixes, weights)[0] + _tokens(rng, rng.randint(16, 128)),
                     _tokens(rng, rng.randint(16, 64)))
        for i in range(_count(400, scale)))
    return Workload("pressure", "48 skewed 1024-token prefixes + 16-128 token suffixes in an "
                    "8192-slot pool (constant eviction)", reqs, 8192)


def skewed(scale: float = 1.0, seed: int = 0) -> Workload:
    """A fleet's skew: three hot 2048-token prefixes take 80% of the requests (50/20/10%),
    the rest each have a cold 1024-token prefix of their own, all with unique suffixes.
    Sending every request of a hot prefix where it is cached overloads that replica."""
    _checked("skewed", scale, seed)
    rng = random.Random(f"skewed/{seed}")
    hot = [_tokens(rng, 2048) for _ in range(3)]
    reqs = []
    for i in range(_count(400, scale)):
        k = rng.choices(range(4), (50, 20, 10, 20))[0]
        prefix = hot[k] if k < 3 else _tokens(rng, 1024)
        reqs.append(BenchRequest(f"sk{i}", prefix + _tokens(rng, rng.randint(32, 128)),
                                 _tokens(rng, rng.randint(64, 256))))
    return Workload("skewed", "3 hot 2048-token prefixes (80% of requests: 50/20/10%) and "
                    "cold 1024-token ones (20%), unique 32-128 token suffixes, 64-256 "
                    "output tokens", tuple(reqs), 65536)


FLEET = ("skewed",)
"""Workloads for the fleet simulation only (``prefixkv bench --replicas``)."""

_SIZES = {  # requests (chat: sessions) at scale 1, and the most tokens each can hold
    "system-prompt": (200, 2048 + 256 + 128),
    "chat": (24, sum(512 + 256 * (t + 1) + 192 * t + 192 for t in range(6))),
    "document": (100, 32768 + 64 + 96),
    "pressure": (400, 1024 + 128 + 64),
    "skewed": (400, 2048 + 128 + 256),
}


def token_bound(name: str, scale: float = 1.0) -> tuple[int, int]:
    """``(bound, each)``: at most ``bound`` tokens (prompts + outputs) in
    ``builtin(name, scale)``, known without building it, and the most tokens one request
    (a chat: one session) can add. ``scale`` must be finite. Raises KeyError for a name
    not in ``BUILTIN``."""
    count, each = _SIZES[name]
    return _count(count, scale) * each, each


def check_scale(scale: float, workloads: Iterable[str]) -> None:
    """Refuse a ``--scale`` that is not a finite number > 0, or that makes a built-in
    workload of ``workloads`` (``"trace"`` is skipped) hold more than
    ``limits.MAX_TRACE_TOKENS`` tokens. The largest scale that fits is known first, so a
    scale far past it (1e308) is refused without counting its requests, which would
    overflow. Raises BenchError."""
    if type(scale) not in (int, float) or not (math.isfinite(scale) and scale > 0):
        raise BenchError(f"--scale must be a finite number > 0, got {shorten(scale)}")
    cap = limits.MAX_TRACE_TOKENS
    for name in workloads:
        if name == "trace":
            continue
        at_scale_1, each = token_bound(name, 1.0)
        most = (cap // each) / (at_scale_1 // each)  # requests (chat: sessions) that fit
        bound = token_bound(name, scale)[0] if scale <= 2 * most else None
        if bound is None or bound > cap:
            held = f"{bound:,}" if bound is not None else f"{scale:g} times its {at_scale_1:,}"
            raise BenchError(f"--scale {scale:g}: the {name} workload would hold up to "
                             f"{held} tokens, over the cap of {cap:,} "
                             f"(limits.MAX_TRACE_TOKENS); it fits up to --scale {most:.3g}")


def builtin(name: str, scale: float = 1.0, seed: int = 0) -> Workload:
    """The built-in workload ``name`` (one of ``BUILTIN`` or ``FLEET``). Raises ValueError
    otherwise."""
    makers = {"system-prompt": system_prompt, "chat": chat, "document": document,
              "pressure": pressure, "skewed": skewed}
    if name not in makers:
        raise ValueError(f"unknown workload {name!r}; choose from "
                         f"{', '.join(BUILTIN + FLEET)}")
    return makers[name](scale, seed)
