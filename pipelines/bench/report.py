"""What a run derives from its results: the ratios it prints and stores, and its plots (``pipelines/report.py``
renders a results file's tables afterwards)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def ratios(results: dict) -> dict[str, float]:
    r = {}
    s = results.get("sampling", {})
    for B, row in s.items():
        r[f"B={B} prioritized cost / uniform (1 shard, prefetch)"] = (
            row["rayrb_1shard_prefetch"]["rows_per_s"]["median"]
            / row["rayrb_1shard_prefetch_prioritized"]["rows_per_s"]["median"])
        r[f"B={B} rate limiter configured, never blocking / none (1 shard, prefetch)"] = (
            row["rayrb_1shard_prefetch_limited"]["rows_per_s"]["median"]
            / row["rayrb_1shard_prefetch"]["rows_per_s"]["median"])
        for k, v in row.items():
            if k.startswith("rayrb") and "prioritized" not in k and "limited" not in k and "noahead" not in k:
                med = v["rows_per_s"]["median"]
                r[f"B={B} {k} / torchrl_o2o"] = med / row["torchrl_o2o"]["rows_per_s"]["median"]
                r[f"B={B} {k} / torchrl_ray"] = med / row["torchrl_ray"]["rows_per_s"]["median"]
                r[f"B={B} {k} / index_select"] = med / row["index_select"]["rows_per_s"]["median"]
    w = results.get("writing", {})
    for n, row in w.items():
        for k in ("rayrb", "rayrb_pipelined", "rayrb_sent", "rayrb_coordinator"):
            if k in row:
                r[f"extend {n} {k} / torchrl_ray"] = (row[k]["rows_per_s"]["median"]
                                                     / row["torchrl_ray"]["rows_per_s"]["median"])
    p = results.get("preprocess")
    if p:
        r["preprocess batched rayrb / torchrl"] = (p["rayrb_batched"]["rows_per_s"]["median"]
                                                  / p["torchrl"]["rows_per_s"]["median"])
    m = results.get("memory")
    if m:
        r["offline shards: (anon RSS - per-actor overhead) / dataset bytes"] = (
            m["rss_anon_bytes_total"] - m["offline_shards"] * m["per_actor_overhead_anon_bytes"]) / m["dataset_bytes"]
        r["offline shards: RSS (anon + file) growth while sampling / dataset bytes"] = (
            m["anon_growth_while_sampling_bytes"] + m["file_growth_while_sampling_bytes"]) / m["dataset_bytes"]
    return r


def _pyplot() -> Any:
    """matplotlib's pyplot drawing to files, or None where matplotlib is not installed (no plots then)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig: Any, ax: Any, out_dir: Path, name: str) -> str:
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    return name


def plots(results: dict, out_dir: Path) -> list[str]:
    """Sampling rows/s against batch size, every peer and buffer; rayrb's against its offline shard count."""
    plt = _pyplot()
    if plt is None:
        return []
    if "sampling" not in results:
        names = writing_plot(results, out_dir, plt)
        plt.close("all")
        return names
    s = results["sampling"]
    Bs = sorted(int(b) for b in s)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in s[str(Bs[0])]:
        ax.plot(Bs, [s[str(b)][k]["rows_per_s"]["median"] for b in Bs], marker="o", label=k)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="rows/s (median)", title="Sampling throughput")
    names = [_save(fig, ax, out_dir, "throughput_vs_batch.png")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shards = sorted({int(k.split("_")[1][:-5]) for k in s[str(Bs[0])] if k.startswith("rayrb") and "prior" not in k})
    for b in Bs:
        for mode in ("", "_prefetch"):
            ax.plot(shards, [s[str(b)][f"rayrb_{m}shard{mode}"]["rows_per_s"]["median"] for m in shards],
                    marker="o", label=f"B={b}{mode}")
    ax.set(yscale="log", xlabel="offline shards", ylabel="rows/s (median)", title="rayrb throughput vs shards")
    ax.set_xticks(shards)
    names.append(_save(fig, ax, out_dir, "throughput_vs_shards.png"))
    names += writing_plot(results, out_dir, plt)
    plt.close("all")
    return names


def writing_plot(results: dict, out_dir: Path, plt: Any) -> list[str]:
    """Rows/s of all writers against rows per ``extend``, every writer count and kind on one plot."""
    w = results.get("writing")
    if not w:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    writers = sorted({int(k.split("x")[0]) for k in w})
    rows = sorted({int(k.split("x")[1]) for k in w})
    for n in writers:
        for kind in next(iter(w.values())):
            ys = [w[f"{n}x{r}"][kind]["rows_per_s"]["median"] if f"{n}x{r}" in w else None for r in rows]
            ax.plot(rows, ys, marker="o", linestyle="-" if kind.startswith("rayrb") else "--",
                    label=f"{kind}, {n} writer{'s' if n > 1 else ''}")
    ax.set(xscale="log", yscale="log", xlabel="rows per extend", ylabel="rows/s, all writers",
           title="Writing throughput")
    return [_save(fig, ax, out_dir, "writing_throughput.png")]


def headline_plot(results: dict, out_dir: Path) -> list[str]:
    """Rows/s against batch size with default arguments: rayrb's plain sample() loop on the shards' node and on
    another node, the shards' reads (the path before local reads), TorchRL's peers and the machine's gather limit."""
    plt = _pyplot()
    if plt is None:
        return []
    loop = results["headline"]["loop"]
    by_node = results.get("cluster", {}).get("loops_by_node", {})
    Bs = sorted(int(b) for b in loop)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {"rayrb, same node (defaults)": [loop[str(b)]["rayrb_sample_loop"]["median"] for b in Bs],
              "TorchRL O2O, in process (best of 1-2 threads)": [loop[str(b)]["torchrl_o2o_best"]["median"] for b in Bs],
              "rayrb, prioritized (its shards read)": [loop[str(b)]["rayrb_sample_loop_prioritized"]["median"]
                                                       for b in Bs],
              "TorchRL RayReplayBuffer": [loop[str(b)]["torchrl_ray"]["median"] for b in Bs],
              "gather limit (index_select x cores)": [loop[str(b)]["gather_limit"]["median"] for b in Bs]}
    series["rayrb, shards read (local_reads=False)"] = [loop[str(b)]["rayrb_sample_loop_shard_reads"]["median"]
                                                        for b in Bs]
    if all(str(b) in by_node for b in Bs):
        series["rayrb, other node (defaults; simulated node)"] = [by_node[str(b)]["other_node_default"] for b in Bs]
    for label, ys in series.items():
        ax.plot(Bs, ys, marker="o", label=label, linestyle="--" if "limit" in label else "-")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="rows/s (one sample() loop)",
           title="Sampling throughput with default arguments")
    names = [_save(fig, ax, out_dir, "headline_throughput.png")]
    plt.close("all")
    return names
