"""``prefixkv bench --replicas ... --route ...``: the fleet simulation swept over N and
routing policies, written as fleet.md, fleet.json and fleet.png (matplotlib, optional).
The events travel through the wire format, so this needs ``prefixkv[events]`` (msgpack).

Each row compares with the single-replica run of the same workload: ``kept`` is the
fleet hit rate as a fraction of it. Goals at N = 8: "cost" keeps >= 0.95 with imbalance
<= 1.15 on every workload, and its TTFT proxy (``replicas.py``) is below that of
"pure-prefix" and "least-loaded".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .replicas import simulate
from .workloads import builtin

DEFAULT_REPLICAS = (1, 2, 4, 8, 16)
DEFAULT_WORKLOADS = ("system-prompt", "chat", "skewed")


def run_fleet(replicas: Sequence[int], routes: Sequence[str],
              workloads: Sequence[str] = DEFAULT_WORKLOADS, *, scale: float = 1.0,
              seed: int = 0, block_size: int = 16, pool_blocks: int | None = None
              ) -> dict[str, Any]:
    """Simulate every (workload, N, route); returns ``{"rows": [...]}`` with each row's
    counts plus ``single_hit_rate`` and ``kept``."""
    rows = []
    for name in workloads:
        wl = builtin(name, scale, seed)
        single = simulate(wl, 1, "prefix", block_size=block_size, pool_blocks=pool_blocks)
        for n in replicas:
            for route in routes:
                res = single if n == 1 and route == "prefix" else simulate(
                    wl, n, route, block_size=block_size, pool_blocks=pool_blocks)
                row = res.to_dict()
                row["single_hit_rate"] = single.hit_rate
                row["kept"] = res.hit_rate / single.hit_rate if single.hit_rate else 0.0
                rows.append(row)
    return {"rows": rows, "scale": scale, "seed": seed, "block_size": block_size}


def table(data: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    out = ["| workload | N | route | hit rate | kept vs 1 replica | prefill computed | "
           "imbalance (max/mean) | TTFT proxy, mean (p90) tokens |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        out.append(f"| {r['workload']} | {r['replicas']} | {r['route']} | {r['hit_rate']:.1%} | "
                   f"{r['kept']:.1%} | {r['prefill_computed']:,} | {r['imbalance']:.2f} | "
                   f"{r['ttft_mean']:,.0f} ({r['ttft_p90']:,}) |")
    return "\n".join(out)


def write_fleet(data: dict[str, Any], out: Path, plots: bool = True) -> list[str]:
    """Write fleet.md, fleet.json and (when matplotlib is installed and ``plots``)
    fleet.png into ``out``; returns notes about what was skipped."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(data, indent=1))
    notes: list[str] = []
    md = ["# Fleet simulation", "", "Each replica has the single-replica pool; routing by "
          "`prefixkv.router.Router`, fed through the vLLM event wire format.", "", table(data)]
    if plots:
        try:
            _plot(data, out / "fleet.png")
            md += ["", "![fleet](fleet.png)"]
        except ImportError:
            notes.append("matplotlib is not installed: no fleet.png")
    (out / "fleet.md").write_text("\n".join(md) + "\n")
    return notes


def _plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in data["rows"]})
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 7), squeeze=False)
    for col, name in enumerate(names):
        rows = [r for r in data["rows"] if r["workload"] == name]
        for route in sorted({r["route"] for r in rows}):
            pts = sorted((r["replicas"], r["kept"], r["imbalance"]) for r in rows
                         if r["route"] == route)
            ns = [p[0] for p in pts]
            axes[0][col].plot(ns, [p[1] for p in pts], marker="o", label=route)
            axes[1][col].plot(ns, [p[2] for p in pts], marker="o", label=route)
        axes[0][col].set_title(f"{name}: hit rate kept vs 1 replica")
        axes[0][col].axhline(0.95, color="grey", lw=0.8, ls="--")
        axes[1][col].set_title(f"{name}: load imbalance (max/mean)")
        axes[1][col].axhline(1.15, color="grey", lw=0.8, ls="--")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("replicas")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
