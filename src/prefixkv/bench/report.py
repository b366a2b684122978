"""The bench's outputs: a terminal table, ``report.md``, ``report.json`` and the plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cascade_bytes import CASCADE_COLUMNS, cascade_note, cascade_rows
from .hosttier import HOST_COLUMNS, host_note, host_rows, readmitted_cell
from .layer_groups import GROUP_COLUMNS, group_note, group_rows
from .plots import PLOTS, write_plots
from .store_cost import cost_note, cost_table
from .store_replicas import REPLICA_COLUMNS, TTFT_COLUMNS, replica_note, replica_rows, ttft_note, ttft_rows

FILES = ("report.md", "report.json", *PLOTS)
"""Every file name ``write_all`` may write (nothing else belongs in a report folder)."""

COLUMNS = ("workload", "allocator", "prefill computed", "prefill saved", "hit rate",
           "re-admitted tok (hit)", "peak blocks", "fit in pool", "frag", "us/admit", "us/token",
           "alloc/saved")


def rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row of formatted cells per (workload, allocator), in COLUMNS order."""
    out: list[tuple[str, ...]] = []
    for wl in data["workloads"]:
        for name, r in wl["results"].items():
            fit = f"{r['fit']}" + ("+" if r["fit"] == wl["requests"] else "")
            if "error" in r:
                out.append((wl["name"], name, "pool too small", "", "", "", "", fit, "", "", "", ""))
                continue
            share = r.get("alloc_share")
            out.append((wl["name"], name, f"{r['prefill_computed']:,}", f"{r['prefill_saved']:,}",
                        f"{r['hit_rate']:.1%}",
                        readmitted_cell(r["readmitted_tokens"], r["readmitted_hit_rate"]),
                        f"{r['peak_blocks']:,}", fit,
                        f"{r['fragmentation']:.1%}", f"{r['us_per_admission']:.1f}",
                        f"{r['us_per_decoded_token']:.2f}",
                        "-" if share is None else f"{share:.3%}"))
    return out


def share_note(data: dict[str, Any]) -> str:
    """What the alloc/saved column means, with the model and throughput it assumes."""
    return (f"alloc/saved: the allocator's own time (admissions + decode appends) as a share "
            f"of the prefill time it saved, an ESTIMATE for {data['prefill_cost']} (no model "
            f"ran; the allocator ran here, on this CPU)")


def table(header: tuple[str, ...], body: Sequence[tuple[str, ...]], markdown: bool = False,
          text_columns: int = 2) -> str:
    """Aligned columns (the first ``text_columns`` left, numbers right); a pipe table
    when ``markdown``."""
    widths = [max(len(c) for c in col) for col in zip(header, *body, strict=True)]
    numeric = [i >= text_columns for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)]
        return "| " + " | ".join(parts) + " |" if markdown else "  ".join(parts)

    rule = ("|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                           for w, num in zip(widths, numeric, strict=True)) + "|"
            if markdown else "  ".join("-" * w for w in widths))
    return "\n".join([line(header), rule] + [line(r) for r in body])


def e2e_rows(e2e: dict[str, Any]) -> list[tuple[str, ...]]:
    """Per turn: tokens cached, TTFT in CPU ms and in wall ms without and with the cache."""
    return [(str(t["turn"]), f"{t['prompt_tokens']}", f"{t['cached_tokens']}",
             f"{t['ttft_cpu_ms_nocache']:.1f}", f"{t['ttft_cpu_ms_cache']:.1f}",
             f"{t['ttft_wall_ms_nocache']:.1f}", f"{t['ttft_wall_ms_cache']:.1f}")
            for t in e2e["turns"]]


E2E_COLUMNS = ("turn", "prompt", "cached", "TTFT CPU ms (no cache)", "TTFT CPU ms (cache)",
               "TTFT wall ms (no cache)", "TTFT wall ms (cache)")


def e2e_note(e2e: dict[str, Any]) -> str:
    """How the end-to-end times were taken."""
    return (f"TTFT: from a turn's start until every chat of it has its first token, best of "
            f"{e2e['config']['repeats']} runs alternating without and with the cache; CPU ms: "
            f"the process's CPU time, which other work on the machine inflates far less than "
            f"wall time (shared cores and caches still slow it: 1.7-2x at a load of 7 on a 2-core "
            f"VM); wall ms: elapsed time")


E2E_HOST_COLUMNS = ("setup", "prefill computed", "cached", "TTFT CPU ms")


def e2e_host_rows(e2e: dict[str, Any]) -> list[tuple[str, ...]]:
    return [(r["setup"], f"{r['prefill_tokens']:,}", f"{r['cached_tokens']:,}",
             f"{r['ttft_cpu_ms']:.1f}") for r in e2e["rows"]]


def host_parts(data: dict[str, Any], markdown: bool = False) -> list[str]:
    """The host-tier table, its note and the end-to-end run with a host tier, if run."""
    if "host_tiers" not in data:
        return []
    parts = [table(HOST_COLUMNS, host_rows(data["host_tiers"]), markdown=markdown),
             host_note(data) + ("." if markdown else "")]
    e2e = data.get("e2e_host")
    if e2e and "rows" in e2e:
        parts += [f"end to end with a host tier ({e2e['model']}); mean TTFT per request, CPU "
                  f"time, best of {e2e['config']['repeats']}:",
                  table(E2E_HOST_COLUMNS, e2e_host_rows(e2e), markdown=markdown, text_columns=1),
                  f"generated tokens identical in the three runs: "
                  f"{'yes' if e2e['identical'] else 'NO'}"]
    elif e2e:
        parts.append(f"end to end with a host tier skipped: {e2e['skipped']}")
    return parts


def replica_parts(data: dict[str, Any], markdown: bool = False) -> list[str]:
    """The replicas table and its note, if the scenario ran."""
    rep = data.get("replicas")
    if rep is None:
        return []
    if "skipped" in rep:
        return [f"replicas sharing a store skipped: {rep['skipped']}"]
    end = "." if markdown else ""
    parts = [table(REPLICA_COLUMNS, replica_rows(rep), markdown=markdown, text_columns=2),
             replica_note(rep) + end]
    if "cost" in rep:
        cols, rows = cost_table(rep["cost"])
        parts += [table(cols, rows, markdown=markdown, text_columns=1), cost_note(rep["cost"]) + end]
    if "ttft" in rep:
        parts += [table(TTFT_COLUMNS, ttft_rows(rep), markdown=markdown, text_columns=1),
                  ttft_note(rep) + end]
    return parts


def group_parts(data: dict[str, Any], markdown: bool = False) -> list[str]:
    """The layer-groups table and its note, if that section ran."""
    if "groups" not in data:
        return []
    return [table(GROUP_COLUMNS, group_rows(data["groups"]), markdown=markdown),
            group_note(data["groups"]) + ("." if markdown else "")]


def cascade_parts(data: dict[str, Any], markdown: bool = False) -> list[str]:
    """The cascade-attention table and its note, if that section ran."""
    cascade = data.get("cascade")
    if cascade is None:
        return []
    if "skipped" in cascade:
        return [f"cascade attention skipped: {cascade['skipped']}"]
    return [table(CASCADE_COLUMNS, cascade_rows(cascade["rows"]), markdown=markdown, text_columns=1),
            cascade_note(cascade) + ("." if markdown else "")]


def terminal(data: dict[str, Any]) -> str:
    """The summary printed at the end of a run."""
    parts = [table(COLUMNS, rows(data)), share_note(data), *host_parts(data), *replica_parts(data),
             *group_parts(data), *cascade_parts(data)]
    e2e = data.get("e2e")
    if e2e and "turns" in e2e:
        parts.append(f"end to end ({e2e['device']}, {e2e['model']}):")
        parts.append(table(E2E_COLUMNS, e2e_rows(e2e), text_columns=0))
        parts.append(e2e_note(e2e))
        parts.append(f"generated tokens identical with and without the cache: "
                     f"{'yes' if e2e['identical'] else 'NO'}")
    elif e2e:
        parts.append(f"end to end skipped: {e2e['skipped']}")
    parts.append(f"wall time {data['wall_s']:.1f} s")
    return "\n\n".join(parts)


def markdown(data: dict[str, Any], plots: list[str]) -> str:
    """The markdown report: machine, settings, the table, sweeps, e2e, plots."""
    m, c = data["machine"], data["config"]
    out = ["# prefixkv bench", "",
           f"Machine: {m['platform']}, {m['cpu_cores']} CPU cores, Python {m['python']}, "
           f"prefixkv {m['prefixkv']}. Wall time {data['wall_s']:.1f} s.", "",
           f"Settings: scale {c['scale']}, block size {c['block_size']}, seed {c['seed']}, "
           f"pool {c['pool_blocks'] or 'per workload'}.", "",
           "Prefill counts prompt tokens (recomputes after preemption included); *hit rate*: "
           "saved / prompt tokens of first admissions; *re-admitted tok (hit)*: prompt tokens "
           "of preempted requests admitted again, and their hit rate (apart: a pool that "
           "preempts more would otherwise hit more); *fit in pool*: "
           "requests resident at once, each with its whole output, before the first that does "
           "not fit (`+`: all of them); *frag*: reserved-but-unused slots / reserved slots, "
           "averaged over steps; contiguous reserves the workload's longest request; "
           f"{share_note(data)}.", "",
           table(COLUMNS, rows(data), markdown=True), ""]
    for wl in data["workloads"]:
        out += [f"## {wl['name']}", "",
                f"{wl['description']}: {wl['requests']} requests, {wl['prompt_tokens']:,} "
                f"prompt tokens, pool {wl['pool_blocks']:,} blocks of {wl['block_size']}.", ""]
        sweep = [(f"{p['pool_blocks']:,}", f"{p['prefixkv']['hit_rate']:.1%}",
                  readmitted_cell(p["prefixkv"]["readmitted_tokens"],
                                  p["prefixkv"]["readmitted_hit_rate"]),
                  f"{p['prefixkv']['prefill_computed']:,}", f"{p['paged']['prefill_computed']:,}",
                  f"{p['saved_vs_paged']:.1%}") for p in wl["sweep"]]
        out += [table(("pool blocks", "hit rate", "re-admitted tok (hit)", "prefill prefixkv",
                       "prefill paged", "saved vs paged"), sweep, markdown=True, text_columns=0), ""]
    if "host_tiers" in data:
        out += ["## Host tier (L2)", ""]
        for part in host_parts(data, markdown=True):
            out += [part, ""]
    if "replicas" in data:
        out += ["## Replicas sharing a store (L3)", ""]
        for part in replica_parts(data, markdown=True):
            out += [part, ""]
    if "groups" in data:
        out += ["## Layer groups (hybrid models)", ""]
        for part in group_parts(data, markdown=True):
            out += [part, ""]
    if "cascade" in data:
        out += ["## Cascade attention: KV read per step", ""]
        for part in cascade_parts(data, markdown=True):
            out += [part, ""]
    e2e = data.get("e2e")
    if e2e and "turns" in e2e:
        out += ["## End to end", "", f"{e2e['model']} on {e2e['device']}. Generated tokens "
                f"identical with and without the cache: **{'yes' if e2e['identical'] else 'NO'}**.",
                "", table(E2E_COLUMNS, e2e_rows(e2e), markdown=True, text_columns=0), "",
                f"{e2e_note(e2e)}.", ""]
    elif e2e:
        out += ["## End to end", "", f"Skipped: {e2e['skipped']}.", ""]
    out += [f"![{p}]({p})" for p in plots]
    return "\n".join(out) + "\n"


def write_all(data: dict[str, Any], out: Path, plots: bool = True) -> list[str]:
    """Write report.json, the plots (when asked and matplotlib is there) and report.md
    into ``out`` (created). Returns notes for the user (e.g. plots skipped)."""
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    names: list[str] = []
    if plots:
        try:
            names = write_plots(data, out)
        except ImportError:
            notes.append("matplotlib is not installed (pip install 'prefixkv[bench]'): "
                         "no plots, markdown and JSON only")
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "report.md").write_text(markdown(data, names))
    return notes
