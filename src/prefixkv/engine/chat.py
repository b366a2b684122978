"""Multi-turn chat through the engine: each turn re-sends the whole history (earlier
prompts and replies) plus the new user message, the way chat APIs are called, so every
turn after the first can hit the blocks cached by the previous one::

    turn t prompt = | system | user 0 | reply 0 | ... | user t-1 | reply t-1 | user t |
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .engine import Engine
from .outputs import GenerateResult, StepRecord
from .sequence import SamplingParams


@dataclass(frozen=True, slots=True)
class ChatResult:
    """``turns[t]``: the GenerateResult of turn t, its outputs in the order of the
    conversations that have a turn t. ``replies[c][t]``: conversation c's reply in turn t
    (sample 0). ``histories[c]``: conversation c's final tokens."""

    turns: tuple[GenerateResult, ...]
    replies: tuple[tuple[tuple[int, ...], ...], ...]
    histories: tuple[tuple[int, ...], ...]

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed by prefills over all turns (what prefix caching saves)."""
        return sum(t.num_prefill_tokens for t in self.turns)


def run_chat(engine: Engine, conversations: Sequence[Sequence[Sequence[int]]],
             params: SamplingParams | None = None, *, system_prompt: Sequence[int] = (),
             on_step: Callable[[StepRecord], None] | None = None) -> ChatResult:
    """Run every conversation (a list of user messages, each a token id list) turn by
    turn; in turn t all conversations with a message t are batched together. Raises
    ValueError when a conversation is empty."""
    if any(len(c) == 0 for c in conversations):
        raise ValueError("every conversation needs at least one user message")
    histories = [list(system_prompt) for _ in conversations]
    replies: list[list[tuple[int, ...]]] = [[] for _ in conversations]
    turns = []
    for t in range(max((len(c) for c in conversations), default=0)):
        active = [c for c in range(len(conversations)) if len(conversations[c]) > t]
        prompts = [histories[c] + list(conversations[c][t]) for c in active]
        result = engine.generate(prompts, params, on_step=on_step)
        for c, prompt, out in zip(active, prompts, result.outputs, strict=True):
            histories[c] = prompt + list(out.token_ids)
            replies[c].append(out.token_ids)
        turns.append(result)
    return ChatResult(tuple(turns), tuple(tuple(r) for r in replies),
                      tuple(tuple(h) for h in histories))


def synthetic_conversations(num_conversations: int, num_turns: int, message_len: int, *,
                            vocab_size: int, seed: int = 0) -> list[list[list[int]]]:
    """Random user messages: ``[conversation][turn] -> message_len token ids`` drawn
    from ``[1, vocab_size)`` with ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [[[rng.randrange(1, vocab_size) for _ in range(message_len)] for _ in range(num_turns)]
            for _ in range(num_conversations)]
