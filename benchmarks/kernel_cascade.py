"""Cascade attention on a GPU: plain ``paged_prefill_attention`` against ``cascade_attention``
for a batch whose requests all share one long cached prefix (helper of ``bench_kernels.py``).

Two steps of ``CASCADE_REQUESTS`` requests sharing ``CASCADE_PREFIX`` cached tokens (whole
blocks, the same physical ids), each with its own part after it:

* decode: ``own`` cached tokens of its own (a few hundred, different per request) and
  one new token;
* short prefill: ``own`` new tokens of its own (the prompt past the shared system prompt).

Each is timed both ways on the same inputs; the two outputs are compared (max abs
difference, which must stay under ``AGREE``) and, in ``--smoke``, both against the
torch reference. The bytes are those the kernel's tiles load from the cache (K and V,
all KV heads): a program of ``block_q`` query positions of one KV head loads every key
its rows may attend (:func:`kernel_problems.keys_read`), with ``block_q`` from
``choose_tiles`` for each launch as the launcher calls it (the cascade's two passes ask
for the LSE). Shared-prefix blocks that several programs load count once per program:
these are the L2-to-SM bytes, not DRAM's.
"""

from __future__ import annotations

from kernel_problems import keys_read

CASCADE_REQUESTS, CASCADE_PREFIX = 64, 4096
AGREE = 2e-2  # bf16 outputs of two summation orders (merge of two passes vs one pass)


def cascade_shapes(smoke: bool) -> list[dict]:
    """The two steps; ``own``: each request's own tokens (cached for decode, new for prefill)."""
    if smoke:
        return [dict(name="decode", batch=3, prefix=32, own=[5, 9, 2], q_len=1),
                dict(name="prefill", batch=3, prefix=32, own=[7, 3, 12], q_len=None)]
    own = [256 + (97 * i) % 128 for i in range(CASCADE_REQUESTS)]  # 256..383, all different
    return [dict(name="decode", batch=CASCADE_REQUESTS, prefix=CASCADE_PREFIX, own=own, q_len=1),
            dict(name="prefill", batch=CASCADE_REQUESTS, prefix=CASCADE_PREFIX, own=own, q_len=None)]


def _block_q(tiling, *, group: int, head_dim: int, max_q: int, on_gpu: bool, lse: bool) -> int:
    tiles = tiling.choose_tiles(group=group, head_dim=head_dim, max_seqlen_q=max_q, on_gpu=on_gpu,
                                return_lse=lse)
    return tiles.block_m // (1 << (group - 1).bit_length())  # GROUP_P2 rows a query position


def cascade_problem(torch, kernels, shape: dict, *, heads: int, kv_heads: int, head_dim: int, block_size: int,
                    dtype, device: str) -> dict:
    """Random cache, the batch's metadata and its cascade metadata (one group of all requests)."""
    from prefixkv.results import SharedPrefix

    b, prefix = shape["batch"], shape["prefix"]
    if prefix % block_size:
        raise ValueError(f"the shared prefix ({prefix}) must be whole blocks of {block_size}")
    new = [1] * b if shape["q_len"] == 1 else list(shape["own"])
    computed = [prefix + o for o in shape["own"]] if shape["q_len"] == 1 else [prefix] * b
    shared = prefix // block_size
    own_blocks = [-(-(c + n) // block_size) - shared for c, n in zip(computed, new, strict=True)]
    perm = torch.randperm(shared + sum(own_blocks)).tolist()  # scattered, as after churn
    ids, at = [], shared
    for n in own_blocks:
        ids.append(perm[:shared] + perm[at:at + n])
        at += n
    cache_shape = (len(perm), block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    step = kernels.build_paged_batch(ids, computed, new, block_size, device=device)
    q = torch.randn(sum(new), heads, head_dim, dtype=dtype, device=device)
    args = (q, k_cache, v_cache, step.block_table, step.cu_seqlens_q, step.seqused_k, step.max_seqlen_q,
            step.max_seqlen_k)
    groups = [SharedPrefix(num_blocks=shared, members=tuple(range(b)))]
    casc = kernels.build_cascade_batch(groups, ids, computed, new, block_size, device=device)
    return dict(args=args, cascade=casc, computed=computed, new=new)


def kv_bytes(tiling, problem: dict, *, heads: int, kv_heads: int, head_dim: int, block_size: int, elem: int,
             on_gpu: bool) -> dict:
    """Bytes of K and V the tiles of each way load (all KV heads), see the module docstring."""
    group, casc = heads // kv_heads, problem["cascade"]
    per_key = kv_heads * head_dim * 2 * elem
    computed, new = problem["computed"], problem["new"]
    bq = _block_q(tiling, group=group, head_dim=head_dim, max_q=max(new), on_gpu=on_gpu, lse=False)
    plain = sum(keys_read(n, c + n, bq) for c, n in zip(computed, new, strict=True))
    shift = [s * block_size for s in casc.shift_blocks.tolist()]
    bq2 = _block_q(tiling, group=group, head_dim=head_dim, max_q=max(new), on_gpu=on_gpu, lse=True)
    own = sum(keys_read(n, c + n - s, bq2) for c, n, s in zip(computed, new, shift, strict=True))
    cu, used = casc.cu_seqlens_q.tolist(), casc.seqused_k.tolist()
    bq1 = _block_q(tiling, group=group, head_dim=head_dim, max_q=casc.max_seqlen_q, on_gpu=on_gpu, lse=True)
    pre = sum(-(-(cu[g + 1] - cu[g]) // bq1) * used[g] for g in range(len(used)))
    return {"plain_gb": plain * per_key / 1e9, "cascade_gb": (own + pre) * per_key / 1e9,
            "cascade_prefix_gb": pre * per_key / 1e9, "block_q": {"plain": bq, "own": bq2, "prefix": bq1}}


def run_cascade(torch, kernels, timer, shape: dict, base: dict, *, reference: bool) -> dict:
    """Time one step both ways; ``base``: heads, kv_heads, head_dim, block_size, dtype, device."""
    from prefixkv.kernels import tiling

    dims = {k: base[k] for k in ("heads", "kv_heads", "head_dim", "block_size")}
    problem = cascade_problem(torch, kernels, shape, **dims, dtype=base["dtype"], device=base["device"])
    args, casc = problem["args"], problem["cascade"]
    out_plain, out_casc = torch.empty_like(args[0]), torch.empty_like(args[0])
    row = {"step": shape["name"], "batch": shape["batch"], "shared_prefix": shape["prefix"],
           "own_tokens": [min(shape["own"]), max(shape["own"])], "q_tokens": args[0].shape[0], **dims,
           "dtype": str(base["dtype"]).replace("torch.", ""), "groups": casc.num_groups}
    row["plain_ms"] = timer(lambda: kernels.paged_prefill_attention(*args, out=out_plain, backend="triton"))
    row["cascade_ms"] = timer(lambda: kernels.cascade_attention(*args, casc, out=out_casc, backend="triton"))
    row["speedup"] = row["plain_ms"] / row["cascade_ms"]
    row["max_abs_diff"] = diff = float((out_plain.float() - out_casc.float()).abs().max())
    row["agree"] = diff < AGREE
    if reference:
        want = kernels.paged_prefill_attention_reference(*args).float()
        errs = [float((o.float() - want).abs().max()) for o in (out_plain, out_casc)]
        row["max_abs_err_vs_reference"] = max(errs)
    row.update(kv_bytes(tiling, problem, **dims, elem=args[1].element_size(), on_gpu=args[0].is_cuda))
    return row


def cascade_markdown(rows: list[dict]) -> list[str]:
    """The bench report's cascade section."""
    lines = ["## Cascade attention (shared prefix)", "",
             "Each step: all requests share one cached prefix (one group); plain `paged_prefill_attention` "
             "against `cascade_attention` on the same inputs. MB: K/V bytes the tiles load (per "
             "program, all KV heads); diff: max abs difference of the two outputs.", "",
             "| step | requests | shared prefix | own tokens | plain ms | cascade ms | plain / cascade | "
             "plain MB | cascade MB (prefix pass) | block_q plain / own / prefix | diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['step']} | **error** `{r['error'][:300]}` |")
            continue
        bq = r["block_q"]
        lines.append(f"| {r['step']} | {r['batch']} | {r['shared_prefix']} | {r['own_tokens'][0]}-"
                     f"{r['own_tokens'][1]} | {r['plain_ms']:.3f} | {r['cascade_ms']:.3f} | "
                     f"{r['speedup']:.2f}x | "
                     f"{1e3 * r['plain_gb']:.3f} | {1e3 * r['cascade_gb']:.3f} "
                     f"({1e3 * r['cascade_prefix_gb']:.3f}) | "
                     f"{bq['plain']} / {bq['own']} / {bq['prefix']} | {r['max_abs_diff']:.1e}"
                     + ("" if r["agree"] else " **disagree**") + " |")
    return lines + [""]
