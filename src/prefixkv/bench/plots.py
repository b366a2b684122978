"""PNG plots of a bench report (matplotlib, the ``bench`` extra; imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"contiguous": "#b0b0b0", "paged": "#6a8caf", "prefixkv": "#d1603d"}
PLOTS = ("capacity.png", "allocators.png", "e2e_ttft.png", "host_tier.png")
"""Every file name ``write_plots`` may write."""


def layered(k: int) -> dict[str, Any]:
    """Line style of the k-th of several lines that may coincide: each drawn after the
    last with a thinner line, a smaller marker of another shape and another dash, so that
    a line on top of another leaves the one below it visible."""
    return {"marker": "osD^v"[k % 5], "markersize": max(3.0, 9.0 - 2 * k),
            "linewidth": max(1.0, 3.0 - 0.7 * k), "linestyle": ("-", "--", "-.", ":")[k % 4]}


def write_plots(data: dict[str, Any], out: Path) -> list[str]:
    """Draw the plots into ``out`` and return their file names.
    Raises ImportError when matplotlib is not installed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [_capacity(plt, data, out), _allocators(plt, data, out)]
    e2e = data.get("e2e")
    if e2e and "turns" in e2e:
        names.append(_e2e(plt, e2e, out))
    if data.get("host_tiers"):
        names.append(_host_tier(plt, data, out))
    return names


def _capacity(plt: Any, data: dict[str, Any], out: Path) -> str:
    """Hit rate and prefill saved against the paged baseline, as the pool grows."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, wl in enumerate(data["workloads"]):
        x = [p["pool_blocks"] for p in wl["sweep"]]
        left.plot(x, [100 * p["prefixkv"]["hit_rate"] for p in wl["sweep"]], label=wl["name"],
                  **layered(k))
        right.plot(x, [100 * p["saved_vs_paged"] for p in wl["sweep"]], label=wl["name"],
                   **layered(k))
    for ax, title in ((left, "prefix-cache hit rate (first admissions)"),
                      (right, "prefill compute saved vs paged, no cache")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"pool size (blocks of {data['config']['block_size']} tokens)")
        ax.set_ylabel("%")
        ax.set_ylim(0, 100)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, out, "capacity.png")


def _allocators(plt: Any, data: dict[str, Any], out: Path) -> str:
    """Per workload and allocator: prefill tokens computed, and requests that fit."""
    wls = data["workloads"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    allocators = list(wls[0]["results"]) if wls else []
    width = 0.8 / max(len(allocators), 1)
    for k, name in enumerate(allocators):
        xs = [i + (k - (len(allocators) - 1) / 2) * width for i in range(len(wls))]
        computed = [wl["results"][name].get("prefill_computed", 0) for wl in wls]
        left.bar(xs, computed, width, label=name, color=COLORS.get(name))
        fits = [wl["results"][name]["fit"] for wl in wls]
        bars = right.bar(xs, fits, width, label=name, color=COLORS.get(name))
        # "N+": all N requests of the workload fit at once (the pool holds more)
        labels = [f"{f}+" if f == wl["requests"] else f"{f}" for f, wl in zip(fits, wls, strict=True)]
        right.bar_label(bars, labels, fontsize=7, padding=1)
    for ax, title, ylabel in ((left, "prefill tokens computed", "prompt tokens computed (log scale)"),
                              (right, "requests resident at once in the pool",
                               "requests (N+: all N fit)")):
        ax.set_xticks(range(len(wls)), [wl["name"] for wl in wls])
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    left.set_yscale("log")
    return _save(plt, fig, out, "allocators.png")


def _e2e(plt: Any, e2e: dict[str, Any], out: Path) -> str:
    """Time to first token per turn (process CPU time), with and without the cache."""
    fig, ax = plt.subplots(figsize=(6, 4))
    turns = [t["turn"] for t in e2e["turns"]]
    ax.plot(turns, [t["ttft_cpu_ms_nocache"] for t in e2e["turns"]], "o-", label="no cache",
            color=COLORS["paged"])
    ax.plot(turns, [t["ttft_cpu_ms_cache"] for t in e2e["turns"]], "o-", label="prefixkv",
            color=COLORS["prefixkv"])
    ax.set_xticks(turns)
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, CPU ms (best of runs)")
    ax.set_title(f"end to end, {e2e['device']}")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, out, "e2e_ttft.png")


def _host_tier(plt: Any, data: dict[str, Any], out: Path) -> str:
    """Hit rate (and its host share) against the host tier size, per workload."""
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for s in data["host_tiers"]:
        x = [p["factor"] for p in s["points"]]
        line = ax.plot(x, [100 * p["hit_rate"] for p in s["points"]], "o-",
                       label=f"{s['name']} ({s['pool_blocks']:,} device blocks)")[0]
        ax.plot(x, [100 * p["host_hit_rate"] for p in s["points"]], "o--", color=line.get_color(),
                alpha=0.6, label=f"{s['name']}: from host")
        bound = s.get("bounds", {}).get("host never evicts")
        if bound is not None:
            ax.axhline(100 * bound["hit_rate"], color=line.get_color(), linestyle=":", alpha=0.8,
                       label=f"{s['name']}: bound (host never evicts)")
    ax.set_xscale("symlog", linthresh=1, base=2)
    ax.set_xticks([p["factor"] for p in data["host_tiers"][0]["points"]])
    ax.set_xticklabels([f"{p['factor']}x" for p in data["host_tiers"][0]["points"]])
    ax.minorticks_off()
    ax.set_xlabel("host tier size (multiples of the device pool)")
    ax.set_ylabel("% of prompt tokens")
    ax.set_ylim(0, 100)
    ax.set_title("prefix-cache hit rate with a host tier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return _save(plt, fig, out, "host_tier.png")


def _save(plt: Any, fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name
