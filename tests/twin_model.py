"""Checks for tests that hold prefixkv to vLLM 0.33 past a freed twin.

A twin is a block caching a key that another block holds too. The two managers treat a
freed twin differently (docs/integration.md, the free-duplicate difference):
- vLLM keeps the copy cached, at the free queue's tail.
- prefixkv empties it (a spare) and moves its holder into its place.

From the first freed twin on, the free queues differ, so the two may evict different
blocks and give different hits. A test then holds each manager to the reference of its
own rule, exactly (tests/sized_model.py: ``twins=False`` for vLLM's, ``twins=True`` for
prefixkv's), and the two managers to each other where the rules must agree:
- ``rules_agree``: the two references cache the same keys of a prompt's prefixes, so
  both managers must find the same hit.
- ``Written``: whatever the rule, every block a hit names holds the KV of the prompt's
  prefix (what the request that wrote it computed there).
"""

from __future__ import annotations

from typing import Any


class Written:
    """What each block of one manager holds: ``(group, prefix tokens)`` written by the
    request that computed the block whole, or None (taken, not yet computed whole)."""

    def __init__(self, sizes: list[int], null: int | None) -> None:
        self.sizes, self.null = sizes, null
        self.kv: dict[int, tuple[int, tuple[int, ...]] | None] = {}

    def wrote(self, tables: Any, tokens: Any, computed: int) -> None:
        """A request whose tables are ``tables`` has computed its first ``computed`` of
        ``tokens``."""
        for g, (b, ids) in enumerate(zip(self.sizes, tables, strict=True)):
            for j, x in enumerate(ids):
                if x != self.null:
                    self.kv[x] = (g, tuple(tokens[:(j + 1) * b])) if (j + 1) * b <= computed else None

    def check_hit(self, tables: Any, tokens: Any) -> None:
        """Every block a hit for ``tokens`` names (per group, ``tables``) holds that
        group's KV of the prompt's prefix up to the block's end."""
        for g, (b, ids) in enumerate(zip(self.sizes, tables, strict=True)):
            for j, x in enumerate(ids):
                if x != self.null:
                    want = (g, tuple(tokens[:(j + 1) * b]))
                    assert self.kv.get(x) == want, (g, j, x, self.kv.get(x), want)


def prefix_keys(model: Any, tokens: Any, extra: Any = None) -> set[Any]:
    """The keys a reference caches (holders, not spares) of ``tokens``' prefixes."""
    return {k for k in model.holders if k[1] == extra and tuple(tokens[:len(k[2])]) == k[2]}


def rules_agree(plain: Any, twin: Any, tokens: Any, extra: Any = None) -> bool:
    """Whether vLLM's rule (``plain``) and prefixkv's (``twin``) cache the same keys of
    ``tokens``' prefixes. Then a lookup of ``tokens`` must give the same hit on both."""
    return prefix_keys(plain, tokens, extra) == prefix_keys(twin, tokens, extra)


def held_prefixes(held: Any, tokens: Any) -> set[Any]:
    """Of the ``(group, prefix tokens)`` a manager holds cached (as its events say),
    those that are prefixes of ``tokens``."""
    return {(g, p) for g, p in held if tuple(tokens[:len(p)]) == p}


def twin_events(entries: Any) -> list[Any]:
    """Announced entries ``(stored, group, prefix, ...)`` (or a one-item clear) as the
    reference's events: ``("stored" | "removed", (group, None, prefix))``."""
    return [("cleared",) if len(e) == 1 else ("stored" if e[0] else "removed", (e[1], None, e[2]))
            for e in entries]
