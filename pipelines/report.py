"""Render benchmarks/results.json as the Markdown tables of docs/benchmarks.md.

    python pipelines/report.py benchmarks/results.json > /tmp/tables.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(x: float) -> str:
    return f"{x:,.0f}"


def rng(v: dict) -> str:
    return f"{fmt(v['median'])} ({fmt(v['min'])}–{fmt(v['max'])})"


def med(v: dict, f: str = "{:,.0f}") -> str:
    """A median with its range: ``1,234 (1,100–1,300)``."""
    return f"{f.format(v['median'])} ({f.format(v['min'])}–{f.format(v['max'])})"


def headline(h: dict) -> list[str]:
    """Default arguments against the peers (``bench_headline``, ``pipelines/bench/headline.py``)."""
    out = ["### Default arguments: one process's `sample()` loop (rows/s, median (min–max))", "",
           "| B | rayrb | × TorchRL O2O (best of 1–2 threads) | TorchRL O2O | × RayReplayBuffer | RayReplayBuffer | "
           "shards read (`local_reads=False`) | prioritized | gather limit |", "|---|---|---|---|---|---|---|---|---|"]
    for B, v in h["loop"].items():
        out.append(f"| {B} | {med(v['rayrb_sample_loop'])} | {med(v['ratio_vs_torchrl_o2o_best'], '{:.2f}')} | "
                   f"{med(v['torchrl_o2o_best'])} | {med(v['ratio_vs_torchrl_ray'], '{:.2f}')} | "
                   f"{med(v['torchrl_ray'])} | {fmt(v['rayrb_sample_loop_shard_reads']['median'])} | "
                   f"{fmt(v['rayrb_sample_loop_prioritized']['median'])} | {fmt(v['gather_limit']['median'])} |")
    c = h["consumers"]
    out += ["", f"### Default arguments: {c['count']} consumer actors' `iter_batches()` together "
            f"(prefetch {c['prefetch']})", "",
            "| B | rows/s in all | × TorchRL O2O | coordinator CPU ms per batch served | per batch planned | "
            "batches planned per served | "
            "consumers' PSS growth MiB | USS growth MiB |", "|---|---|---|---|---|---|---|---|"]
    for B, v in c.items():
        if isinstance(v, dict):
            out.append(f"| {B} | {med(v['consumers_rows_per_s'])} | {med(v['ratio_vs_torchrl_o2o_best'], '{:.2f}')} "
                       f"| {med(v['coordinator_cpu_ms_per_batch'], '{:.3f}')} | "
                       f"{v['coordinator_cpu_ms_per_batch_planned']['median']:.3f} | "
                       f"{v['coordinator_batches_planned_per_served']['median']:.2f} | "
                       f"{med(v['consumers_pss_growth_mib'], '{:,.1f}')} | {med(v['consumers_uss_growth_mib'], '{:,.1f}')} |")
    out.append(f"\nThe offline table is {c['dataset_mib']:,.0f} MiB.")
    return out + [""]


def preamble(r: dict) -> list[str]:
    """The command, mode, data, machine and versions."""
    return [f"Command: `{r['command']}`  ", f"Mode: {r['mode']}, {r['config']['repeats']} repeats; "
            f"data: {r['data']}  ",
            f"Machine: {r['machine']['cpus']} CPUs, {r['machine']['mem_gib']} GiB, {r['machine']['platform']}; "
            + ", ".join(f"{k} {v}" for k, v in r["versions"].items()), ""]


def sampling(s: dict) -> list[str]:
    out = ["### Sampling (rows/s, median (min–max); p50/p99 ms per batch)", "",
           "| B | peer | rows/s | batches/s | p50 ms | p99 ms |", "|---|---|---|---|---|---|"] if s else []
    for B, row in s.items():
        for k, v in row.items():
            out.append(f"| {B} | {k} | {rng(v['rows_per_s'])} | {v['batches_per_s']:,.1f} | {v['p50_ms']:.2f} | "
                       f"{v['p99_ms']:.2f} |")
    return out


def prefetch_sweep(sweep: dict) -> list[str]:
    out = ["", "### Prefetch depth (1 offline shard, iter_batches)", "", "| setting | rows/s | p50 ms |", "|---|---|---|"]
    for k, v in sweep.items():
        out.append(f"| {k} | {fmt(v['rows_per_s'])} | {v['p50_ms']:.2f} |")
    return out


def consumers(c: dict) -> list[str]:
    """Consumer actors at once, and where the machine's CPU time went while they ran."""
    out = ["", f"### Consumers at once (actors iterating with prefetch {c['prefetch']}, B={c['batch_size']}, "
           "2 offline and 2 online shards)", "",
           "| consumers | rows/s in all | × one | plans/s | coordinator ms per plan | coordinator busy | "
           "coordinator ceiling, plans/s | machine CPU busy |", "|---|---|---|---|---|---|---|---|"]
    for n, v in c.items():
        if isinstance(v, dict):
            out.append(f"| {n} | {rng(v['rows_per_s'])} | {v['speedup_vs_one']:.2f} | "
                       f"{v['plans_per_s']['median']:,.0f} | {v['coordinator_ms_per_plan']['median']:.3f} | "
                       f"{v['coordinator_busy_fraction']['median']:.2f} | "
                       f"{v['coordinator_plans_per_s_ceiling']['median']:,.0f} | "
                       f"{v['machine_cpu_busy_fraction']['median']:.2f} |")
    shares = [k for k in next(v for v in c.values() if isinstance(v, dict)) if k.startswith("cpu_share_")]
    if shares:
        out += ["", "Where the machine's CPU time went (share of all busy CPU time while the consumers ran):", "",
                "| consumers | " + " | ".join(k[len("cpu_share_"):].replace("_", " ") for k in shares) + " |",
                "|---|" + "---|" * len(shares)]
        out += [f"| {n} | " + " | ".join(f"{v[k]['median']:.2f}" for k in shares) + " |"
                for n, v in c.items() if isinstance(v, dict)]
    return out


def sampling_real(sr: dict) -> list[str]:
    out = ["", f"### Real data: {sr['dataset']}, B={sr['batch_size']}", "", "| peer | rows/s |", "|---|---|"]
    return out + [f"| {k} | {rng(v['rows_per_s'])} |" for k, v in sr.items() if isinstance(v, dict)]


def writing(w: dict) -> list[str]:
    out = ["", "### Writing (online `extend`: writers x rows a call; rows/s of all writers; p50 / p99 ms a call)", "",
           "| writers x rows | rayrb | rayrb, pipelined | sent to the shard | placed by the coordinator | TorchRL "
           "RayReplayBuffer |", "|---|---|---|---|---|---|"]
    kinds = ("rayrb", "rayrb_pipelined", "rayrb_sent", "rayrb_coordinator", "torchrl_ray")
    for n, row in w.items():
        out.append(f"| {n} | " + " | ".join(f"{rng(row[k]['rows_per_s'])}; {row[k]['p50_ms']:.2f} / {row[k]['p99_ms']:.2f}"
                                            if k in row else "not run" for k in kinds) + " |")
    return out


def preprocess(r: dict) -> list[str]:
    p = r["preprocess"]
    out = ["", f"### Preprocess ({fmt(p['rows'])} rows, 2 workers; rows/s)", "", "| method | rows/s |", "|---|---|"]
    out += [f"| {k} | {rng(v['rows_per_s'])} |" for k, v in p.items() if isinstance(v, dict)]
    out.append(f"\nFirst use of the workers (imports; reported apart): {r.get('preprocess_cold_start_s', 0):.1f} s. "
               f"Peak RSS of a preprocess worker: {p['peak_worker_rss_bytes'] / 2**20:,.0f} MiB. "
               f"Equal to TorchRL's output: {r.get('checks', {}).get('preprocess_equal_to_torchrl')}.")
    return out


def memory(m: dict) -> list[str]:
    return ["", "### Memory", "",
            f"- dataset bytes: {m['dataset_bytes'] / 2**20:,.1f} MiB over {m['offline_shards']} offline shards",
            f"- offline shards' private (anonymous) RSS: {m['rss_anon_bytes_total'] / 2**20:,.1f} MiB in all, of "
            f"which {m['per_actor_overhead_anon_bytes'] / 2**20:,.1f} MiB per actor before any sampling; grew by "
            f"{m['anon_growth_while_sampling_bytes'] / 2**20:,.1f} MiB (anon) and "
            f"{m['file_growth_while_sampling_bytes'] / 2**20:,.1f} MiB (file-backed: mapped chunk pages, "
            f"shared with the page cache) while sampling"]


def object_store(o: dict) -> list[str]:
    return [f"- object store during a prefetching iterator (B={o['batch_size']}, prefetch={o['prefetch']}): "
            f"peak {o['peak_needed_mib']:.1f} MiB held by live references ({o['peak_used_mib']:.0f} MiB including "
            f"freed objects the store had not reclaimed yet; {o['polls']} polls); one batch is "
            f"{o['batch_mib']:.1f} MiB, so prefetch x batch = {o['prefetch'] * o['batch_mib']:.1f} MiB"]


def by_nodes(runs: dict) -> str:
    return "; ".join(f"{v['nodes']} node(s): {fmt(v['rows_per_s'])} rows/s" for v in runs.values()
                     if isinstance(v, dict) and "nodes" in v)


def cluster(c: dict) -> list[str]:
    """Rows/s by node count, and a plain ``sample()`` loop on the shards' node and on the other."""
    out = ["", "### Two-node Cluster (prefetch 4, 2 offline shards, SPREAD)", "", f"- {by_nodes(c)} ({c['note']})"]
    if "baseline" in c:
        out.append(f"- the same on `{c['baseline']['path']}`: {by_nodes(c['baseline'])}")
    if "loops_by_node" in c:
        out += ["", "A plain `sample()` loop (rows/s) on the shards' node and on the other node:", "",
                "| B | same node, defaults | same node, shards read | other node, defaults | other / shards read |"
                " other node vs older code | same node vs older code |", "|---|---|---|---|---|---|---|"]
        for B, v in c["loops_by_node"].items():
            out.append(f"| {B} | {fmt(v['same_node_default'])} | {fmt(v['same_node_shard_reads'])} | "
                       f"{fmt(v['other_node_default'])} | {v['other_node_vs_shard_reads']:.2f} | "
                       f"{v.get('other_node_vs_baseline', float('nan')):.2f} | "
                       f"{v.get('same_node_vs_baseline', float('nan')):.2f} |")
    return out


def render(r: dict) -> str:
    out = preamble(r)
    if "headline" in r:
        out += headline(r["headline"])
    out += sampling(r.get("sampling", {}))
    if "prefetch_sweep" in r:
        out += prefetch_sweep(r["prefetch_sweep"])
    if "consumers" in r:
        out += consumers(r["consumers"])
    if "sampling_real" in r:
        out += sampling_real(r["sampling_real"])
    if "writing" in r:
        out += writing(r["writing"])
    if "preprocess" in r:
        out += preprocess(r)
    if "memory" in r:
        out += memory(r["memory"])
    if "object_store" in r:
        out += object_store(r["object_store"])
    if "cluster" in r:
        out += cluster(r["cluster"])
    out += ["", "### Ratios (medians)", "", "| ratio | value |", "|---|---|"]
    out += [f"| {k} | {v:.3f} |" for k, v in r.get("ratios", {}).items()]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results.json").read_text())))
