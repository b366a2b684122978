"""KV bytes the attention kernel reads per step, with and without cascade attention, on
the shared-system-prompt and document workloads: a count, not a timing.

A simple scheduler replays a workload through a ``KVCacheManager``: it admits up to 64
running requests in arrival order (one whose admission would leave too few free blocks
for the running requests' remaining output waits), computes a new request's uncached
prompt in one step, then decodes one token per step. For every step it counts the keys
the Triton kernel loads, from its tiling: a program of ``block_q`` query positions of one
request and one KV head loads every key its rows may attend (causal: up to its last
row's position), so a request of ``q_len`` new tokens on ``kv_len`` keys reads
``sum_t (kv_len - q_len + min((t + 1) * block_q, q_len))`` keys per KV head, with
``block_q`` from ``choose_tiles`` for the call's longest ``q_len`` (H100 tiles).

Cascade: the groups come from ``KVCacheManager.shared_prefixes`` and
``build_cascade_batch`` (the real metadata): pass 2 reads each request's keys past its
group's prefix as above, pass 1 reads each group's prefix once per tile of its packed
query rows; both passes return the LSE, so their tiles are those of an LSE call (128
rows at most: a long prefill's own part takes twice the tiles of the plain call's 256).
A step that keeps no group runs the plain kernel. Bytes: keys x KV heads x head_dim x 2
(K and V) x element size, one layer.

Imports neither torch nor triton at import time (the command line stays light): the
calls that count import ``prefixkv.kernels`` (torch) and its tiling (triton).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..core.block import blocks_for
from ..core.manager import KVCacheManager
from ..results import SharedPrefix, StoreWait
from .capacity import default_pool_blocks
from .errors import BenchError
from .workloads import BenchRequest, Workload, builtin

CASCADE_WORKLOADS = ("system-prompt", "document")
"""The built-in workloads the command's cascade section counts."""
MAX_RUNNING = 64


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The attention layer counted: query and KV heads, head_dim, bytes per element, and
    the model it is like (the default: Llama-3-8B's attention, bf16)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    elem_bytes: int = 2
    like: str = "Llama-3-8B-like"

    @property
    def bytes_per_key(self) -> int:
        """K and V of one token position, every KV head, one layer."""
        return self.kv_heads * self.head_dim * 2 * self.elem_bytes

    def describe(self) -> str:
        """One line: ``Llama-3-8B-like (32 query / 8 KV heads, ...)``."""
        return (f"{self.like} ({self.heads} query / {self.kv_heads} KV heads, head_dim "
                f"{self.head_dim}, {8 * self.elem_bytes}-bit KV, one layer)")


class StepKeys(NamedTuple):
    """Keys one KV head loads in one step, plain and cascade, and the requests in a group."""

    plain: int
    cascade: int
    grouped: int


def keys_read(q_len: int, kv_len: int, block_q: int) -> int:
    """Keys one KV head's programs of a request load (causal, bottom-right aligned): a
    program of ``block_q`` query positions loads every key up to its last row's position."""
    return sum(kv_len - q_len + min((t + 1) * block_q, q_len) for t in range(blocks_for(q_len, block_q)))


def block_q(shape: ModelShape, max_q_len: int, *, lse: bool = False) -> int:
    """Query positions per program of the kernel (GPU tiles) for a call whose longest
    request has ``max_q_len`` new tokens; ``lse``: the call returns the LSE."""
    import triton

    from ..kernels.tiling import choose_tiles

    group_p2 = int(triton.next_power_of_2(shape.heads // shape.kv_heads))
    tile = choose_tiles(group=shape.heads // shape.kv_heads, head_dim=shape.head_dim,
                        max_seqlen_q=max_q_len, on_gpu=True, elem_bytes=shape.elem_bytes,
                        return_lse=lse)
    return max(tile.block_m, group_p2) // group_p2


def step_keys(shape: ModelShape, groups: Sequence[SharedPrefix], block_ids: Sequence[Sequence[int]],
              num_computed: Sequence[int], num_new: Sequence[int], block_size: int) -> StepKeys:
    """Keys one KV head loads for one step of a batch (the arguments of
    ``build_cascade_batch``), without cascade and with it. With it: a step whose batch
    keeps no group runs the plain kernel; otherwise both passes take the tiles of a call
    that returns the LSE (they do, for the merge), which never has the 256-row prefill
    tile."""
    from ..kernels import build_cascade_batch, cascade_keys

    cb = build_cascade_batch(groups, block_ids, num_computed, num_new, block_size)
    keys = cascade_keys(cb, group=shape.heads // shape.kv_heads, head_dim=shape.head_dim,
                        max_seqlen_q=max(num_new), elem_bytes=shape.elem_bytes)
    if not cb.prefix_groups:
        return StepKeys(keys.plain, keys.plain, 0)
    return StepKeys(keys.plain, keys.cascade, int((cb.shift_blocks > 0).sum()))


@dataclass(slots=True)
class _Running:
    """A running request: tokens computed, new tokens of this step, outputs left to decode."""

    req: BenchRequest
    computed: int
    new: int
    left: int

    def growth(self, block_size: int) -> int:
        """Blocks it still appends before it finishes."""
        return (blocks_for(len(self.req.prompt) + len(self.req.output), block_size)
                - blocks_for(self.computed + self.new, block_size))


def _admit(m: KVCacheManager, waiting: list[BenchRequest], running: dict[str, _Running], name: str) -> None:
    """Admit waiting requests in order while fewer than MAX_RUNNING run and the pool keeps
    the blocks every running request still appends (so the replay never runs out)."""
    bs = m.block_size
    while waiting and len(running) < MAX_RUNNING:
        req = waiting[0]
        adm = m.add_request(req.rid, req.prompt, extra=req.extra)
        assert not isinstance(adm, StoreWait), "this manager has no shared store"
        if adm is not None:
            cached = adm.num_cached_tokens
            st = _Running(req, cached, len(req.prompt) - cached, len(req.output))
            if m.num_free_blocks >= st.growth(bs) + sum(r.growth(bs) for r in running.values()):
                waiting.pop(0)
                running[req.rid] = st
                continue
            m.free(req.rid, num_computed_tokens=0)  # its output may not fit: it waits
        if not running:
            raise BenchError(f"{name}: request {req.rid} does not fit a pool of {m.num_blocks:,} "
                             f"blocks of {bs}")
        return


def count_workload(workload: Workload, block_size: int = 16, shape: ModelShape = ModelShape()
                   ) -> dict[str, Any]:
    """Replay ``workload`` (requests without ``after``) in its own pool; bytes per step,
    all steps and decode-only steps, without and with cascade. Raises BenchError."""
    if any(r.after is not None for r in workload.requests):
        raise BenchError(f"{workload.name}: the cascade count replays requests that wait on none")
    m = KVCacheManager(default_pool_blocks(workload, block_size), block_size, seed=0)
    waiting = list(workload.requests)
    running: dict[str, _Running] = {}
    total = [0, 0, 0, 0]  # steps, keys plain, keys cascade, requests in a group
    decode = [0, 0, 0]  # decode-only steps: count, keys plain, keys cascade
    while waiting or running:
        _admit(m, waiting, running, workload.name)
        rids = list(running)
        new = [running[r].new for r in rids]
        keys = step_keys(shape, m.shared_prefixes(rids), [m.get_block_ids(r) for r in rids],
                         [running[r].computed for r in rids], new, block_size)
        total = [total[0] + 1, total[1] + keys.plain, total[2] + keys.cascade, total[3] + keys.grouped]
        if max(new) == 1:
            decode = [decode[0] + 1, decode[1] + keys.plain, decode[2] + keys.cascade]
        for r in rids:  # the step ran: its tokens are computed; decode the next or finish
            st = running[r]
            st.computed += st.new
            if st.left == 0:
                m.free(r)
                del running[r]
                continue
            st.left -= 1
            st.new = 1
            if m.append_tokens(r, [st.req.output[len(st.req.output) - st.left - 1]]) is None:
                raise AssertionError(f"{r}: the pool ran out although admission kept its output's blocks")
    per_key, steps = shape.bytes_per_key, total[0]
    return {"workload": workload.name, "requests": len(workload.requests), "steps": steps,
            "grouped_request_steps": total[3],
            "plain_bytes_per_step": total[1] * per_key / steps,
            "cascade_bytes_per_step": total[2] * per_key / steps, "ratio": total[1] / total[2],
            "decode_steps": decode[0],
            "decode_plain_bytes_per_step": decode[1] * per_key / max(1, decode[0]),
            "decode_cascade_bytes_per_step": decode[2] * per_key / max(1, decode[0]),
            "decode_ratio": decode[1] / decode[2] if decode[2] else 1.0}


def run_cascade(scale: float = 1.0, seed: int = 0, block_size: int = 16,
                tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The command's section: ``count_workload`` of ``CASCADE_WORKLOADS`` at ``scale``, or
    ``{"skipped": why}`` when torch or triton is not installed."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"needs torch and triton (pip install 'prefixkv[kernels]'): {exc}"}
    shape = ModelShape()
    rows = []
    for name in CASCADE_WORKLOADS:
        if tick is not None:
            tick(f"cascade {name}")
        rows.append(count_workload(builtin(name, scale, seed), block_size, shape))
    return {"model": shape.describe(), "block_size": block_size, "max_running": MAX_RUNNING, "rows": rows}


CASCADE_COLUMNS = ("workload", "requests", "steps", "request-steps in a group", "MB/step plain",
                   "MB/step cascade", "plain / cascade", "decode-only steps", "decode MB/step plain",
                   "decode MB/step cascade", "decode plain / cascade")


def cascade_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row of cells per workload of ``count_workload``, in CASCADE_COLUMNS order."""
    return [(r["workload"], f"{r['requests']}", f"{r['steps']}", f"{r['grouped_request_steps']}",
             f"{r['plain_bytes_per_step'] / 1e6:.1f}", f"{r['cascade_bytes_per_step'] / 1e6:.1f}",
             f"{r['ratio']:.2f}x", f"{r['decode_steps']}", f"{r['decode_plain_bytes_per_step'] / 1e6:.1f}",
             f"{r['decode_cascade_bytes_per_step'] / 1e6:.1f}", f"{r['decode_ratio']:.2f}x")
            for r in rows]


def cascade_note(data: dict[str, Any]) -> str:
    """What the cascade table counts, for ``run_cascade``'s result."""
    return (f"cascade attention: KV bytes the attention kernel reads per step, a COUNT from its "
            f"tiling (no kernel ran), {data['model']}, blocks of "
            f"{data['block_size']}, up to {data['max_running']} running requests; with cascade, "
            f"each group of requests sharing cached blocks (KVCacheManager.shared_prefixes) reads "
            f"them once per query tile of the group instead of once per request's tile "
            f"(docs/bench.md)")
