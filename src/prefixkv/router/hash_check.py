"""Whether a replica hashes its blocks as the router hashes prompts: a bounded sample.

A replica whose manager hashes with another mode, seed or hash format than the router
(the default ``xxhash`` with its random seed behind a ``sha256`` router, another
``seed``, ``"bytes"`` hashes to an ``"int"`` router) announces blocks that no prompt's
hashes ever meet: every route misses there, and nothing else says so. A ``BlockStored``
carries what the router needs to tell: the run's token ids, its parent's hash and each
block's extra keys: the router hashes a run's leading blocks as it hashes a prompt
(``hashing.chain_hashes``) and compares them with the hashes announced.

Compared are the blocks of a run whose parent is nil (so the root is the router's own)
up to its first with a multimodal input or prompt embeddings (their length is unsent).
A salt and a LoRA enter every block's hash: vLLM 0.33 sends the LoRA's name in
``lora_name`` and each block's ``extra_keys`` entry, the salt after it in the first
block's only; blocks whose entries hold just these are rehashed with them. A LoRA's
path enters its hash unsent: it is taken from the router's prompts (``learn``: the last
``MAX_PATHS`` paths given each name, so that replicas loading one name from different
paths each match one); a LoRA that no prompt named is not compared. Nor is a run of
another block size (``block_size_mismatches``), of a group the router does not score,
on a medium other than the GPU (a KV connector's tier, vLLM 0.33's CPU and STORAGE,
LMCache's: keyed by the connector, perhaps by its own hash), or whose token ids do not
fill its blocks (a snapshot's).

Lookahead keys (``Router(hash_lookahead_tokens=L)``; a ``LookaheadKVCacheManager``'s
events, vLLM's ``num_hash_lookahead_tokens``): a run's ``lookahead_token_ids`` (per block,
the tokens after it its hash covers) enter each block's hash as the replica's manager puts
them (``hashing.lookahead_bytes``). A run whose blocks cover another count of tokens after
them than the router's ``L`` (none when it sends no ``lookahead_token_ids``) is counted in
``hash_mismatches`` without rehashing: no prompt's hashes meet its blocks.

The sample is bounded: per replica at most ``SAMPLE_BLOCKS`` blocks compared, and at most
``SAMPLE_BATCHES`` batches read for them, from its first batch and again after each
``Router.forget`` (a restart, a resync) and reconnection; then nothing is read, so the
steady state pays one dict look-up a batch. A payload is read field by field, only as
far as the blocks still to compare need (the rest is skipped unbuilt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ExtraKeysError, TokenError
from ..extra_keys import ExtraKeys
from ..hashing import chain_hashes, encode_tokens, lookahead_bytes, make_hash_fn, token_bytes
from .index import GPU
from .marks import IndexMarks
from .sampled import Sampled, sample_runs
from .scored import FULL_KIND

__all__ = ["MAX_LORAS", "MAX_PATHS", "SAMPLE_BATCHES", "SAMPLE_BLOCKS", "HashCheck", "sample_runs"]

SAMPLE_BLOCKS = 32
"""Blocks compared per replica after each (re)start of its sample (module doc)."""
SAMPLE_BATCHES = 64
"""Batches read per replica, at most, for those blocks (a replica whose requests all have
an image in their first block, or a LoRA no prompt named, gives none: it stops there)."""
MAX_LORAS = 1024
"""LoRA names whose paths the check remembers (the most recently given; module doc)."""
MAX_PATHS = 4
"""Paths the check remembers per LoRA name (the most recently given; module doc)."""
_MASK64 = (1 << 64) - 1


class HashCheck:
    """The sample of the module doc for ``replicas`` (names the caller checked), hashed
    as the router hashes prompts (``block_size``, ``hash_mode``, ``seed``,
    ``hash_format``, checked by the router); a run that differs is counted in ``marks``
    (``hash_mismatches``, warned once per replica). ``checked``: blocks compared per
    replica, all lives together (0: nothing known yet)."""

    def __init__(self, replicas: Sequence[str], block_size: int, hash_mode: Any,
                 seed: int | bytes | None, hash_format: str, marks: IndexMarks,
                 lookahead: int = 0) -> None:
        self._fn, self._root = make_hash_fn(hash_mode, seed)
        self._bs, self._format, self._marks = block_size, hash_format, marks
        self._lookahead = lookahead
        self.checked = dict.fromkeys(replicas, 0)
        self._left: dict[str, list[int]] = {}  # replica -> [blocks, batches] still to read
        self._paths: dict[str, tuple[str | None, ...]] = {}  # LoRA name -> paths prompts gave
        for replica in replicas:
            self.rearm(replica)

    def rearm(self, replica: str) -> None:
        """Sample ``replica`` again from its next batch (a new life may hash otherwise)."""
        self._left[replica] = [SAMPLE_BLOCKS, SAMPLE_BATCHES]

    def learn(self, extra: ExtraKeys | None) -> None:
        """Remember the path a prompt's ``extra`` (checked) gives its LoRA name, if any:
        a run of that LoRA matches when its hashes are those of one of the name's last
        ``MAX_PATHS`` paths (module doc; the last ``MAX_LORAS`` names)."""
        if extra is None or extra.lora is None:
            return
        if not (known := (paths := self._paths).pop(extra.lora, ())) and len(paths) >= MAX_LORAS:
            del paths[next(iter(paths))]
        path = extra.lora_path
        paths[extra.lora] = (*[p for p in known if p != path][1 - MAX_PATHS:], path)

    def due(self, replica: str) -> bool:
        """Whether ``replica``'s next batch is read for the sample."""
        return replica in self._left

    def check(self, replica: str, payload: bytes, scored: int | None) -> None:
        """Compare the runs of ``payload`` (a batch of ``replica``'s, applied) that the
        router indexes (``scored``: the replica's scored group, None for none yet) and
        can rehash (module doc); nothing when the sample is spent."""
        left = self._left.get(replica)
        if left is None:
            return
        left[1] -= 1
        for run in sample_runs(payload, self._bs, left[0]):
            if run.medium not in (None, GPU) or run.block_size not in (None, self._bs) \
                    or run.kind not in (None, FULL_KIND) \
                    or None not in (scored, run.group) and run.group != scored:
                continue
            widths = {len(e) for e in run.lookahead} if run.lookahead is not None else {0}
            other = widths != {self._lookahead}  # (another lookahead: nothing to rehash)
            mine = [] if other else self._hashes(run, len(run.hashes))
            if not (other or mine):
                continue
            left[0] -= len(run.hashes)
            self.checked[replica] += len(run.hashes)
            if other:
                self._marks.hash_mismatched(replica, run.medium, (min(widths), self._lookahead))
            elif run.hashes not in mine:
                self._marks.hash_mismatched(replica, run.medium)
        if left[0] <= 0 or left[1] <= 0:
            del self._left[replica]

    def _hashes(self, run: Sampled, n: int) -> list[list[int | bytes]]:
        """The first ``n`` blocks' hashes of ``run``'s tokens from the root with its LoRA
        (under each path known for it) and salt, in wire form; none when the token ids
        are not ids or its LoRA's path is unknown (nothing to compare)."""
        out: list[list[int | bytes]] = []
        try:
            data, step = token_bytes(encode_tokens(run.tokens)), 4 * self._bs  # type: ignore[arg-type]
            chunks = [data[i * step:(i + 1) * step] for i in range(n)]
            after = [b""] * n if not self._lookahead or run.lookahead is None else [
                lookahead_bytes(None, encode_tokens(t), 0, len(t))  # type: ignore[arg-type]
                for t in run.lookahead[:n]]
            for path in (None,) if run.lora is None else self._paths.get(run.lora, ()):
                extra = ExtraKeys(lora=run.lora, cache_salt=run.salt, lora_path=path).base_bytes()
                digests = chain_hashes(self._fn, self._root, chunks, [extra + a for a in after])
                out.append(list(digests) if self._format == "bytes"
                           else [int.from_bytes(d, "big") & _MASK64 for d in digests])
        except (TokenError, ExtraKeysError):
            return []
        return out
