"""Layer groups in numbers: KV memory per request, requests resident and hit rates of a
hybrid model's manager (``HybridKVCacheManager``), against giving every layer a
full-length table.

Two layer mixes, each split into groups of equal layer count (as vLLM's hybrid allocator
does, so a block costs the same bytes in every group), bf16 KV:

    gemma3-like : 60 layers (Gemma 3 27B has 62), 5 sliding-window (W=1024) per
                  full-attention layer: 6 groups of 10 layers; 16 KV heads x 128 dims
    gpt-oss-like: 36 layers (gpt-oss-120b), alternating sliding window (W=128) and full:
                  2 groups of 18 layers; 8 KV heads x 64 dims

The baseline is the same groups, all full attention (``full_attention()`` for every
group: the same manager, no release). Block size 16.

- capacity: requests of 4k (then 16k) unique prompt tokens are prefilled in chunks of
  2048 tokens (the windows release as the prefill advances) and decode one token each,
  until the pool (8192 blocks) cannot take the next chunk: requests resident, and KV
  blocks (and MiB) held per request;
- hit rate: 400 questions (64 tokens, 32 decoded; ``--scale`` multiplies their number)
  on one of 8 shared 4k-token documents, one request at a time, a pool of 4096 blocks (a
  request's own blocks, and what is left caches documents; each miss evicts).

Counts only (no timing): the same seed gives the same figures on any machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import PromptTooLongError
from ..groups import GroupSpec, HybridKVCacheManager, full_attention, sliding_window
from .errors import BenchError

BLOCK_SIZE = 16
CHUNK = 2048
POOL_BLOCKS = 8192
PROMPT_LENS = (4096, 16384)
HIT_POOL_BLOCKS = 4096
QUESTIONS = 400
VOCAB = 50_000


@dataclass(frozen=True)
class LayerMix:
    """A model's attention layers as groups of ``layers_per_group`` layers each, and the
    KV bytes of one token in one layer (K and V)."""

    name: str
    groups: tuple[GroupSpec, ...]
    layers_per_group: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of one group (all its layers)."""
        return block_size * self.layers_per_group * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def all_full(self) -> tuple[GroupSpec, ...]:
        """The baseline: every group full attention."""
        return (full_attention(),) * len(self.groups)


MIXES = {m.name: m for m in (
    LayerMix("gemma3-like", (full_attention(),) + (sliding_window(1024),) * 5, 10, 16, 128),
    LayerMix("gpt-oss-like", (sliding_window(128), full_attention()), 18, 8, 64),
)}
"""The layer mixes ``prefixkv bench --groups`` knows, by name."""


def capacity(groups: Sequence[GroupSpec], prompt_len: int, *, num_blocks: int = POOL_BLOCKS,
             block_size: int = BLOCK_SIZE, chunk: int = CHUNK, seed: int = 1) -> tuple[int, float]:
    """Admit requests of ``prompt_len`` unique tokens, prefill each in chunks of ``chunk``
    tokens and decode one token, until one does not fit (it is freed). Returns the
    requests resident and the blocks held per request (the null block excluded)."""
    m = HybridKVCacheManager(groups, num_blocks, block_size, seed=0)
    rng = random.Random(seed)
    n = 0
    while True:
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        if m.add_request(n, prompt, num_new_tokens=chunk) is None:
            break
        ok = True
        while ok and m.num_scheduled_tokens(n) < prompt_len:
            ok = m.extend(n, min(chunk, prompt_len - m.num_scheduled_tokens(n))) is not None
        if not ok or m.append_tokens(n, [1]) is None:  # decode releases the prompt's tail
            m.free(n)
            break
        n += 1
    held = (num_blocks - (m.null_block_id is not None)) - m.num_free_blocks
    m.check_invariants()
    return n, held / max(n, 1)


def hit_rate(groups: Sequence[GroupSpec], *, num_blocks: int = HIT_POOL_BLOCKS,
             block_size: int = BLOCK_SIZE, docs: int = 8, doc_len: int = 4096,
             questions: int = QUESTIONS, question_len: int = 64, answer_len: int = 32,
             seed: int = 2) -> float:
    """Questions on shared documents, one request at a time: each prompt is a random
    document of ``docs`` plus ``question_len`` unique tokens, decodes ``answer_len``
    tokens and is freed. Returns the prefix-cache hit rate (hit tokens / prompt tokens).
    Raises BenchError when one request does not fit the pool."""
    m = HybridKVCacheManager(groups, num_blocks, block_size, seed=0)
    rng = random.Random(seed)
    texts = [[rng.randrange(VOCAB) for _ in range(doc_len)] for _ in range(docs)]
    for i in range(questions):
        prompt = texts[rng.randrange(docs)] + [rng.randrange(VOCAB) for _ in range(question_len)]
        try:
            adm = m.add_request(i, prompt)
        except PromptTooLongError:
            adm = None
        if adm is None:
            raise BenchError(f"a {len(prompt)}-token question does not fit {num_blocks} blocks")
        for _ in range(answer_len):
            if m.append_tokens(i, [rng.randrange(VOCAB)]) is None:
                raise BenchError(f"an answer does not fit {num_blocks} blocks")
        m.free(i)
    m.check_invariants()
    return m.stats.hit_rate


def questions_at(scale: float) -> int:
    """The hit rate's questions at ``--scale`` ``scale``: ``QUESTIONS`` times it, at least one."""
    return max(1, round(QUESTIONS * scale))


def run_groups(names: Sequence[str], seed: int = 0,
               tick: Callable[[str], None] = lambda label: None, scale: float = 1.0) -> dict[str, Any]:
    """Capacity and hit rate of each named mix, hybrid tables against all full; rows of
    plain JSON types. ``scale`` multiplies the hit rate's ``QUESTIONS`` (at least one), as
    ``--scale`` does the built-in workloads' requests; the capacity fills its pool whatever
    the scale. Raises KeyError for a name not in ``MIXES``."""
    questions = questions_at(scale)
    rows = []
    for name in names:
        mix = MIXES[name]
        per_block = mix.block_bytes(BLOCK_SIZE) / 2**20
        for tables, specs in (("hybrid", mix.groups), ("all full", mix.all_full())):
            tick(f"layer groups {name} {tables}")
            row: dict[str, Any] = {"mix": name, "tables": tables,
                                   "groups": [[s.kind, s.tokens] for s in specs]}
            for plen in PROMPT_LENS:
                n, per_req = capacity(specs, plen, seed=2 * seed + 1)
                row[f"resident_{plen}"] = n
                row[f"blocks_per_req_{plen}"] = round(per_req, 1)
                row[f"mib_per_req_{plen}"] = round(per_req * per_block, 1)
            row["hit_rate"] = round(hit_rate(specs, questions=questions, seed=2 * seed + 2), 4)
            rows.append(row)
    return {"block_size": BLOCK_SIZE, "pool_blocks": POOL_BLOCKS, "chunk": CHUNK,
            "hit_pool_blocks": HIT_POOL_BLOCKS, "questions": questions, "rows": rows}


GROUP_COLUMNS = ("mix", "tables", "resident (4k)", "KV MiB/request (4k)", "resident (16k)",
                 "KV MiB/request (16k)", "hit rate")


def group_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of formatted cells per (mix, tables), in GROUP_COLUMNS order."""
    return [(r["mix"], r["tables"], f"{r['resident_4096']}", f"{r['mib_per_req_4096']:,.1f}",
             f"{r['resident_16384']}", f"{r['mib_per_req_16384']:,.1f}", f"{r['hit_rate']:.1%}")
            for r in data["rows"]]


def group_note(data: dict[str, Any]) -> str:
    """What the layer-groups table measured."""
    return (f"layer groups: gemma3-like = 5 sliding-window (W=1024) : 1 full, 60 layers, "
            f"16 KV heads x 128; gpt-oss-like = alternating W=128 and full, 36 layers, 8 KV "
            f"heads x 64; bf16, blocks of {data['block_size']}. hybrid: a table per group, "
            f"windows release their blocks; all full: every layer a full-length table. "
            f"resident: requests of 4k/16k unique tokens (prefilled in chunks of "
            f"{data['chunk']}, one token decoded) held at once in one pool of "
            f"{data['pool_blocks']:,} blocks; hit rate: {data.get('questions', QUESTIONS)} questions "
            f"on 8 shared 4k-token documents, one at a time, {data['hit_pool_blocks']:,} blocks "
            f"(counts, not timings)")
