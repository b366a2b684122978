"""KV bytes the attention kernel reads per step, with and without cascade attention, on the
shared-system-prompt and document workloads.

    python benchmarks/bench_cascade.py [--scale 1.0] [--out benchmarks/results]

A count, not a timing (no GPU here): a simple scheduler replays each workload through a
``KVCacheManager`` (admit up to 64 running requests in arrival order, a new request's
uncached prompt in one step, then one decode token per step), and for every step counts
the keys the Triton kernel loads, from its tiling: a program of ``block_q`` query
positions of one request and one KV head loads every key its rows may attend (causal:
up to its last row's position), so a request of ``q_len`` new tokens on ``kv_len`` keys
reads ``sum_t (kv_len - q_len + min((t + 1) * block_q, q_len))`` keys per KV head, with
``block_q`` from ``choose_tiles`` for the step's longest ``q_len`` (H100 tiles).

Cascade: the groups come from ``KVCacheManager.shared_prefixes`` and
``build_cascade_batch`` (the real metadata): pass 2 reads each request's keys past its
group's prefix as above, pass 1 reads each group's prefix once per tile of its packed
query rows. Bytes: keys x KV heads x head_dim x 2 (K and V) x 2 (bf16), one layer; model
shape 32 query / 8 KV heads, head_dim 128, blocks of 16.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kernel_problems import keys_read
from prefixkv import KVCacheManager
from prefixkv.bench.workloads import Workload, document, system_prompt
from prefixkv.kernels import build_cascade_batch
from prefixkv.kernels.tiling import choose_tiles

HEADS, KV_HEADS, DIM, BLOCK_SIZE, ELEM, MAX_RUNNING = 32, 8, 128, 16, 2, 64
BYTES_PER_KEY = KV_HEADS * DIM * 2 * ELEM  # one layer, K and V


def block_q(max_q_len: int) -> int:
    """Query positions per program of the kernel for a call whose longest request has ``max_q_len``."""
    group = HEADS // KV_HEADS
    return choose_tiles(group=group, head_dim=DIM, max_seqlen_q=max_q_len, on_gpu=True).block_m // group


def run(workload: Workload) -> dict:
    """Replay ``workload``; per step, keys read without and with cascade (one KV head)."""
    m = KVCacheManager(workload.pool_tokens // BLOCK_SIZE, BLOCK_SIZE, seed=0)
    waiting = list(workload.requests)
    running: dict[str, list] = {}  # rid -> [num_computed, q_len, outputs left, request]
    plain = cascade = steps = grouped = 0
    decode = [0, 0, 0]  # steps of decode tokens only: count, keys plain, keys cascade
    while waiting or running:
        while waiting and len(running) < MAX_RUNNING:
            adm = m.add_request(waiting[0].rid, waiting[0].prompt)
            if adm is None:
                break
            req = waiting.pop(0)
            cached = adm.num_cached_tokens
            running[req.rid] = [cached, len(req.prompt) - cached, len(req.output), req]
        rids = list(running)
        computed = [running[r][0] for r in rids]
        new = [running[r][1] for r in rids]
        bq = block_q(max(new))
        before = (plain, cascade)
        plain += sum(keys_read(q, c + q, bq) for c, q in zip(computed, new, strict=True))
        ids = [m.get_block_ids(r) for r in rids]
        cb = build_cascade_batch(m.shared_prefixes(rids), ids, computed, new, BLOCK_SIZE)
        shift = [s * BLOCK_SIZE for s in cb.shift_blocks.tolist()]
        cascade += sum(keys_read(q, c + q - s, bq) for c, q, s in zip(computed, new, shift, strict=True))
        cu, used = cb.cu_seqlens_q.tolist(), cb.seqused_k.tolist()
        if used:
            bq1 = block_q(cb.max_seqlen_q)
            cascade += sum(-(-(cu[g + 1] - cu[g]) // bq1) * used[g] for g in range(len(used)))
            grouped += sum(s > 0 for s in shift)
        steps += 1
        if max(new) == 1:
            decode = [decode[0] + 1, decode[1] + plain - before[0], decode[2] + cascade - before[1]]
        for r in rids:  # the step ran: its tokens are computed; decode the next or finish
            st = running[r]
            st[0] += st[1]
            if st[2] == 0:
                m.free(r)
                del running[r]
                continue
            st[2] -= 1
            st[1] = 1
            if m.append_tokens(r, [st[3].output[len(st[3].output) - st[2] - 1]]) is None:
                raise RuntimeError(f"the pool ran out for {r}: raise pool_tokens")
    return {"workload": workload.name, "requests": len(workload.requests), "steps": steps,
            "grouped_request_steps": grouped,
            "plain_bytes_per_step": plain * BYTES_PER_KEY / steps,
            "cascade_bytes_per_step": cascade * BYTES_PER_KEY / steps, "ratio": plain / cascade,
            "decode_steps": decode[0],
            "decode_plain_bytes_per_step": decode[1] * BYTES_PER_KEY / max(1, decode[0]),
            "decode_cascade_bytes_per_step": decode[2] * BYTES_PER_KEY / max(1, decode[0]),
            "decode_ratio": decode[1] / decode[2] if decode[2] else 1.0}


def markdown(rows: list[dict], scale: float) -> str:
    lines = ["# Cascade attention: KV bytes read per step (counted, not timed)", "",
             f"`python benchmarks/bench_cascade.py --scale {scale}`. "
             + __doc__.split("\n\n")[2].replace("\n", " "),
             "", "All steps, and the steps that decode only (no prefill in the batch).", "",
             "| workload | requests | steps | request-steps in a group | MB/step plain | MB/step cascade | "
             "plain / cascade | decode-only steps | MB/step plain | MB/step cascade | plain / cascade |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['requests']} | {r['steps']} | {r['grouped_request_steps']} | "
                     f"{r['plain_bytes_per_step'] / 1e6:.1f} | {r['cascade_bytes_per_step'] / 1e6:.1f} | "
                     f"{r['ratio']:.2f}x | {r['decode_steps']} | "
                     f"{r['decode_plain_bytes_per_step'] / 1e6:.1f} | "
                     f"{r['decode_cascade_bytes_per_step'] / 1e6:.1f} | {r['decode_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="workload scale (requests)")
    parser.add_argument("--out", type=Path, default=None, help="write cascade-cpu.{json,md} here")
    args = parser.parse_args()
    rows = [run(w(args.scale)) for w in (system_prompt, document)]
    md = markdown(rows, args.scale)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"scale": args.scale, "rows": rows}
        (args.out / "cascade-cpu.json").write_text(json.dumps(data, indent=2) + "\n")
        (args.out / "cascade-cpu.md").write_text(md)


if __name__ == "__main__":
    main()
