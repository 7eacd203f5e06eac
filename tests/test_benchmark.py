"""The benchmark harness's smoke mode runs end to end, so it cannot rot (figures are not checked: not a timed test).
The headline (the README's figures) runs in the default suite; every other section (sampling, writing, preprocess,
the draw path's CPU by role, consumer actors, the real table, start-up, and those that start clusters of their own: four
fifths of the smoke run's time) under the ``bench`` marker, ``make test-bench``."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SHARED_DATA

DEFAULT_SECTIONS = "headline"


def smoke(tmp_path, sections: str) -> dict:
    """``benchmark.py --smoke`` with these sections in a process (and a Ray) of its own; its results.json."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, str(REPO / "pipelines" / "benchmark.py"), "--smoke", "--out", str(tmp_path),
           "--sections", sections]
    if (SHARED_DATA / "openml").is_dir():
        cmd += ["--data-home", str(SHARED_DATA)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mode"] == "smoke" and results["command"]
    return results


def render(tmp_path) -> str:
    """What ``report.py`` prints for the run's results.json (it renders every section the run wrote)."""
    tables = subprocess.run([sys.executable, str(REPO / "pipelines" / "report.py"), str(tmp_path / "results.json")],
                            capture_output=True, text=True, timeout=60)
    assert tables.returncode == 0, tables.stderr[-4000:]
    return tables.stdout


def test_benchmark_smoke_writes_results(tmp_path):
    results = smoke(tmp_path, DEFAULT_SECTIONS)
    assert results["ray_config"] == {}
    # the headline: default arguments against the peers at their best, the coordinator's CPU, memory, other nodes
    loop = results["headline"]["loop"]["64"]
    for key in ("rayrb_sample_loop", "torchrl_o2o_1_threads", "torchrl_o2o_2_threads", "torchrl_o2o_best",
                "torchrl_ray", "gather_limit", "rayrb_sample_loop_shard_reads", "rayrb_sample_loop_prioritized"):
        assert loop[key]["median"] > 0, key
    consumers = results["headline"]["consumers"]["64"]
    assert consumers["consumers_rows_per_s"]["median"] > 0 and consumers["coordinator_cpu_ms_per_batch"]["median"] > 0
    assert "consumers_pss_growth_mib" in consumers and "consumers_uss_growth_mib" in consumers
    assert "Default arguments" in render(tmp_path)


@pytest.mark.bench
def test_benchmark_smoke_of_the_other_sections(tmp_path):
    results = smoke(tmp_path, "sampling,writing,preprocess,draw_path,consumers,real,slices,startup,cluster,replicas,"
                              "rows_in_call")
    for section in ("sampling", "prefetch_sweep", "writing", "preprocess", "memory", "object_store"):
        assert section in results, section
    for peer in ("index_select", "torchrl_o2o", "torchrl_ray", "rayrb_1shard", "rayrb_1shard_noahead",
                 "rayrb_1shard_prefetch"):
        assert results["sampling"]["64"][peer]["rows_per_s"]["median"] > 0
    assert results["checks"]["preprocess_equal_to_torchrl"] is True
    assert any(k.startswith("B=64 rayrb") for k in results["ratios"])
    assert results["consumers"]["2"]["rows_per_s"]["median"] > 0 and results["consumers"]["1"]["speedup_vs_one"] == 1
    # the draw path reports where the machine's CPU went, per role, and the Ray settings it ran under
    draw = results["draw_path"]["64"]
    for role in ("consumers", "shards", "coordinator", "ray_system"):
        assert draw[f"cpu_ms_per_batch_{role}"]["median"] >= 0, role
    assert sum(draw[k]["median"] for k in draw if k.startswith("cpu_ms_per_batch_")) > 0
    by_node = results["cluster"]["loops_by_node"]["64"]
    assert by_node["same_node_default_local_reads"] > 0 and by_node["other_node_default_local_reads"] == 0
    assert by_node["same_node_shard_reads_local_reads"] == 0 and by_node["other_node_default"] > 0
    assert "replicas" in results
    for way in ("one_argument", "parts", "one_argument_forwarded", "parts_forwarded"):
        assert results["rows_in_call"]["1000"][way]["calls_per_s"] > 0, way
    slices = results["slices"]["by_slice_len"]["8"]
    assert slices["rayrb_offline"]["median"] > 0 and slices["torchrl_slice_sampler"]["median"] > 0
    assert slices["rayrb_prioritized_half_online"]["median"] > 0
    written = results["slices"]["while_written"]["by_steps"]["4000"]
    assert all(written[f"{k}_ms"]["median"] > 0 for k in ("rayrb", "rayrb_rescan", "rayrb_prioritized", "torchrl"))
    startup = results["startup"]
    for kind in ("empty_actor", "torchrl_ray", "rayrb_default"):  # each started, ready, and what that cost
        assert startup[f"{kind}_ready_s"]["median"] > 0 and startup[f"{kind}_machine_cpu_s"]["median"] > 0, kind
    assert "Two-node Cluster" in render(tmp_path)


@pytest.mark.bench
def test_benchmark_smoke_of_cold_reads(tmp_path):
    """The cold and ahead sections at their smoke sizes (a few MiB, only their own files evicted, no root needed)."""
    results = smoke(tmp_path, "cold,ahead")
    ahead = results["ahead"]
    assert ahead["disk_random_4k"]["reads_per_s"] > 0 and ahead["disk_sequential"]["mib_per_s"] > 0
    for key, row in ahead["loops"].items():
        for hints in ("off", "on"):
            assert row[hints]["rows_per_s"] > 0 and row[hints]["local_reads"]["local"] > 0, (key, hints)
        assert row["on_vs_off"] > 0
    cold = results["cold"]
    assert cold["limits"]["random_4k"]["reads_per_s"] > 0 and cold["limits"]["sequential"]["mib_per_s"] > 0
    for regime in ("cold", "warm"):
        for key in ("256/256", "28672/256"):
            row = cold[regime][key]
            for peer in ("rayrb", "take", "torchrl_1_threads", "torchrl_2_threads"):
                assert row[peer]["rows_per_s"] > 0 and row[peer]["private_mib_after"]["private"] > 0, (regime, peer)
    assert cold["cold"]["256/256"]["rayrb_vs_disk_random_reads"] > 0


def test_ray_settings_are_refused_for_a_cluster_the_benchmark_joins(tmp_path):
    """``--ray-config`` sets up an instance the benchmark starts; joining a running one, it fails before any work."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "127.0.0.1:1"}
    out = subprocess.run([sys.executable, str(REPO / "pipelines" / "benchmark.py"), "--smoke", "--out", str(tmp_path),
                          "--ray-config", '{"max_direct_call_object_size": 1048576}'],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode != 0
    assert "--ray-config sets up a Ray instance this starts; got RAY_ADDRESS='127.0.0.1:1'" in out.stderr
    assert not (tmp_path / "results.json").exists()
